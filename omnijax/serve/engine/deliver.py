"""What an engine worker's tick hands back to its sessions (`deliver`, `EngineWorker._deliver`): each served chunk's
result to its feed, frame or answer, and which answers ended and why; and the questions the engine is still scoring
for their recall (`keep_recalling`, `watch_scoring`, `end_recalling`: issue 40)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

__all__ = ["deliver", "end_recalling", "keep_recalling", "kv_cells", "watch_scoring"]


def keep_recalling(worker: Any, plan: dict, report: Any, failed: dict) -> dict:
    """The plan's entries served by this tick. A question the engine is still scoring (`TickReport.recalling`) is
    kept in `worker._recalling` (it was submitted; the next plans carry it unsubmitted, and its session gets nothing
    else) until a tick serves it."""
    waiting = () if report is None else report.recalling
    for sid in plan:
        if sid in waiting and sid in worker.lanes and sid not in failed:
            worker._recalling[sid] = plan[sid]
        else:
            worker._recalling.pop(sid, None)
    return {sid: entry for sid, entry in plan.items() if sid not in worker._recalling}


def watch_scoring(worker: Any) -> bool:
    """Whether one of the engine's scoring jobs has ended (its question lands at the next tick); each of the others
    wakes the worker's loop when it ends."""
    futures = [] if worker.engine.recall is None else worker.engine.recall.futures()
    loop = asyncio.get_running_loop()
    for future in futures:
        if id(future) not in worker._watched:
            worker._watched.add(id(future))
            future.add_done_callback(lambda f: (worker._watched.discard(id(f)), loop.call_soon_threadsafe(
                worker._work.set)))
    return any(future.done() for future in futures)


def end_recalling(worker: Any, sid: str, reason: str) -> None:
    """Fails the question a closed session was waiting to have scored (its feed, frame and answer)."""
    entry = worker._recalling.pop(sid, None)
    if entry is None:
        return
    _, _, item, answer = entry
    for future in () if item is None else (item.fed, item.frame):
        if future is not None and not future.done():
            future.set_exception(RuntimeError(reason))
    if answer is not None:
        answer._finish("failed", reason)


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
            elif out is not None and not out.written:  # a question whose recall failed: not written
                item.fed.set_exception(RuntimeError(out.error))
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
        if out is not None and out.answer_rows is not None:  # the rows of the tokens kept (a per-token tick too)
            answer._push_rows(out.answer_rows[:len(tokens)])
        worker.stats["tokens"] += len(tokens)
        ending = None
        if out is None or out.preempted:
            ending = ("incomplete", "preempted")
        elif out.error is not None:
            ending = ("failed", out.error)
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


def kv_cells(engine: Any, sids: list[str]) -> dict[str, int]:
    """In the engine thread: the KV cells each open session of `engine` holds."""
    kv = engine.state.kv
    table = np.asarray(kv.page_table)
    valid = np.asarray(kv.valid)
    cells = {}
    for sid in sids:
        try:
            row = engine.slot(sid)
        except KeyError:
            continue
        pages = table[row][table[row] >= 0] if row < table.shape[0] else []
        cells[sid] = int(valid[pages].sum()) if len(pages) else 0
    return cells
