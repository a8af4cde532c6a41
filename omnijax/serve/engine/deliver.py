"""What an engine worker's tick hands back to its sessions (`deliver`, `EngineWorker._deliver`): each served chunk's
result to its feed, frame or answer, and which answers ended and why."""

from __future__ import annotations

from typing import Any

__all__ = ["deliver"]


def deliver(worker: Any, plan: dict, report: Any, failed: dict) -> list:
    """Hands each served chunk's result to its feed or answer; returns the answers that ended."""
    ended = []
    for sid, (_, asked, item, answer) in plan.items():
        lane = worker.lanes.get(sid)
        if lane is None:  # closed during the tick
            continue
        if sid in failed:
            if item is not None and item.frame is not None and not item.frame.done():
                item.frame.set_exception(RuntimeError(failed[sid]))
            worker._fail(lane, failed[sid])
            continue
        out = report.outputs.get(sid)
        if item is not None and item.frame is not None and not item.frame.done():
            item.frame.set_result(out)
        if item is not None and item.fed is not None and not item.fed.done():
            if out is not None and out.preempted:
                item.fed.set_exception(RuntimeError("the session was preempted: the KV pool is exhausted"))
            else:
                item.fed.set_result(None)
        if answer is None:
            continue
        if answer.cancelled:
            lane.answer = None
            answer._ending = ("cancelled", "cancelled")
            ended.append((sid, answer))
            continue
        if asked == 0:  # its prompt part was not the last one yet (cannot happen: answers sit on last parts)
            continue
        tokens = [] if out is None else [int(t) for t in out.tokens]
        cut = next((i + 1 for i, t in enumerate(tokens) if t in answer.stop), None)
        tokens = tokens[:cut] if cut is not None else tokens
        if not report.per_token:  # a per-token tick pushed each token as it was decoded
            answer._push(tokens, None if out is None else out.logprobs)
        worker.stats["tokens"] += len(tokens)
        ending = None
        if out is None or out.preempted:
            ending = ("incomplete", "preempted")
        elif out.error is not None:
            ending = ("failed", f"the token constraint failed: {out.error}")
        elif cut is not None or out.complete:
            ending = ("completed", None)
        elif answer.remaining <= 0:
            ending = ("incomplete", "max_output_tokens")
        elif not tokens:
            ending = ("incomplete", "no tokens decoded")
        if ending is None:
            lane.answer = answer
        else:
            lane.answer = None
            answer._ending = ending
            ended.append((sid, answer))
    return ended
