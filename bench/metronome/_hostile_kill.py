"""The kill cases of `hostile_probe`: four Realtime sessions (1, 2, 3 turns, one mid-response) are SIGKILLed with
the server and resumed on a restarted one (the turns each keeps, against `--snapshot-every 1turn`'s bound of one
turn, and whether its next answer equals the uninterrupted conversation's); then SIGTERM with no client connected."""

from __future__ import annotations

import asyncio
import time

from bench.metronome._hostile_cases import Case, Probe, case
from bench.metronome._hostile_realtime import QUESTIONS, say
from bench.metronome._hostile_server import Observed, Realtime
from bench.metronome._hostile_sessions import reference, resume_and_continue, turns_kept

K = "sigkill"


def sigkill_cases() -> list[Case]:
    out: list[Case] = []

    async def kill_and_restart(p: Probe) -> Observed:
        await reference(p)
        tokens: dict[str, str] = {}
        opened = []
        try:
            for turns in (1, 2, 3):
                cm = Realtime.open(p.served.ws)
                s = await cm.__aenter__()
                opened.append(cm)
                for q in QUESTIONS[:turns]:
                    await say(s, q)
                tokens[f"{turns}turns"] = s.token
            cm = Realtime.open(p.served.ws)
            s = await cm.__aenter__()
            opened.append(cm)
            await say(s, QUESTIONS[0])
            await s.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": QUESTIONS[1]}]}})
            await s.send({"type": "response.create", "response": {"max_output_tokens": 64}})
            await s.until({"response.output_text.delta"})
            tokens["mid_response"] = s.token
            status = p.served.kill()  # SIGKILL: no shutdown, no final snapshot
        finally:
            for cm in opened:
                try:
                    await cm.__aexit__(None, None, None)
                except Exception:  # noqa: BLE001 - the server is gone
                    pass
        p.state["sigkill"] = {"tokens": tokens, "done": {"1turns": 1, "2turns": 2, "3turns": 3, "mid_response": 1}}
        mark = len(p.served.lines)
        await asyncio.to_thread(p.served.start)
        cleaned = [x for x in p.served.log_since(mark) if "temp folder" in x]
        return Observed("ok", f"killed (exit {status}), restarted in {p.served.start_s[-1]:.0f} s"
                        + (f"; {cleaned[0].split('INFO:')[-1][:80]}" if cleaned else ""))
    case(out, K, "kill_and_restart", "4 Realtime sessions (1, 2, 3 turns, one mid-response), SIGKILL, restart",
         kill_and_restart, "verdict", expect="restarts", timeout_s=600, slow=True)

    for name in ("1turns", "2turns", "3turns", "mid_response"):
        async def resumed(p: Probe, name=name) -> Observed:
            info = p.state.get("sigkill")
            if info is None:
                return Observed("loss", "the kill scenario did not run")
            token, done = info["tokens"][name], info["done"][name]
            kept = turns_kept(p, token)
            lost = done - (kept or 0)
            seen = await resume_and_continue(p, token) if kept else Observed("loss", "no snapshot survived")
            p.state.setdefault("sigkill_lost", {})[name] = (done, kept, lost)
            if seen.outcome == "ok" and lost > 1:
                return Observed("loss", f"{lost} of {done} turns lost (more than one snapshot interval): {seen.detail}")
            return Observed(seen.outcome, f"{done} turns done, {kept} kept, {lost} lost; {seen.detail}")
        case(out, K, f"resume_{name}", f"resume the {name.replace('turns', '-turn')} session after SIGKILL", resumed,
             "verdict", expect="at most 1 turn lost (--snapshot-every 1turn); resumes exactly", timeout_s=120,
             slow=True)

    async def sigterm(p: Probe) -> Observed:
        await asyncio.sleep(3.0)  # every client of the earlier cases has left
        mark = len(p.served.lines)
        stopping = time.perf_counter()
        await asyncio.to_thread(p.served.stop, 120)
        seconds = time.perf_counter() - stopping
        status = p.served.proc.returncode if p.served.proc else None
        stuck = [x for x in p.served.log_since(mark) if "Cancel" in x or "shutting down" in x]
        await asyncio.to_thread(p.served.start)
        detail = f"exit {status} {seconds:.1f} s after SIGTERM; {'; '.join(x[-90:] for x in stuck)}"
        return Observed("ok" if seconds < 10 and status in (0, -15) else "hang", detail)
    case(out, K, "sigterm_idle_server", "SIGTERM with no client connected (--shutdown-timeout 30 s)", sigterm,
         "verdict", expect="exits at once (< 10 s)", timeout_s=180, slow=True)
    return out
