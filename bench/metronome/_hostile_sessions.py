"""The session cases of `hostile_probe`: resume tokens (unknown, malformed, used twice at once, snapshots tampered
on disk) and traffic (idle sockets, a client that never reads, disconnects mid-response, five sessions closing at
once, bursts, churn; after each, the sessions the server still holds for the departed client are counted)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.metronome._hostile_cases import Case, Probe, body, case
from bench.metronome._hostile_realtime import QUESTIONS, say
from bench.metronome._hostile_server import AUTH, Observed, Realtime, native_open

R = "resume"
T = "traffic"
ECHOES = 320  # 1 MB echoes a client that never reads provokes: held whole, they pass the 128 MB bound


# ------------------------------------------------------------------------------------------------ shared state
async def reference(p: Probe) -> list[str]:
    """The uninterrupted conversation's answers to QUESTIONS (once per probe)."""
    if "reference" not in p.state:
        async with Realtime.open(p.served.ws) as s:
            p.state["reference"] = [(await say(s, q))[0] for q in QUESTIONS]
    return p.state["reference"]


def generations(p: Probe, token: str) -> list[Path]:
    folder = p.served.snapshot_dir / token
    return sorted(x for x in folder.iterdir() if x.is_dir() and x.name.isdigit()) if folder.is_dir() else []


def turns_kept(p: Probe, token: str) -> int | None:
    """User turns held by the newest snapshot of `token` on disk (None: no snapshot)."""
    gens = generations(p, token)
    if not gens:
        return None
    meta = json.loads((gens[-1] / "session.json").read_text())["meta"]
    return sum(m.get("role") == "user" for m in meta["conversation"]["messages"])


async def wait_for(condition: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.05)
    return value


async def snapshotted(p: Probe) -> str:
    """The token of a session that said QUESTIONS[:2] and left (its snapshot on disk), made once per probe."""
    await reference(p)
    if "no_snapshot" in p.state:
        raise NoSnapshot(f"not run: {p.state['no_snapshot']}")
    if "token" not in p.state:
        async with Realtime.open(p.served.ws) as s:
            for q in QUESTIONS[:2]:
                await say(s, q)
            token = s.token
        if not await wait_for(lambda: turns_kept(p, token) == 2):
            p.state["no_snapshot"] = "a session that said 2 turns and left had no snapshot of them 30 s later"
            raise NoSnapshot(p.state["no_snapshot"])
        await asyncio.sleep(1.0)  # the lease is let go after the final write
        p.state["token"] = token
    return p.state["token"]


class NoSnapshot(Exception):
    """The shared resumable session has no snapshot on disk: the resume cases built on it cannot run."""


async def resume_and_continue(p: Probe, token: str) -> Observed:
    """Resumes `token`, asks the question after the turns its snapshot keeps, and compares the answer with the
    uninterrupted conversation's: "ok" when equal, "loss" when not (or when the resume is refused)."""
    ref = await reference(p)
    kept = turns_kept(p, token)
    async with Realtime.open(p.served.ws, query=f"model=omnijax&resume={token}") as s:
        if s.created.get("type") != "session.created":
            return Observed("loss", f"resume refused: {s.created.get('error')}")
        if kept is None or kept >= len(QUESTIONS):
            return Observed("loss", f"the snapshot keeps {kept} turns")
        text, done = await say(s, QUESTIONS[kept])
    if text != ref[kept]:
        return Observed("loss", f"resumed after {kept} turns; answer {text!r} != uninterrupted {ref[kept]!r}")
    return Observed("ok", f"resumed after {kept} turns; next answer equals the uninterrupted one ({text!r})")


async def refused_resume(p: Probe, token: str) -> Observed:
    async with Realtime.open(p.served.ws, query=f"model=omnijax&resume={token}") as s:
        if s.created.get("type") == "session.created":
            return Observed("accepted", "session.created: resumed")
        err = s.created.get("error") or {}
        leaked = str(p.served.snapshot_dir) in str(err.get("message"))
        return Observed("refused", f"{err.get('code')}: {str(err.get('message'))[:160]}"
                        + (" [names the server's path]" if leaked else ""), err.get("code"))


# ------------------------------------------------------------------------------------------------ resume
def _tamper(edit: Callable[[dict], None] | None = None, *, files: Callable[[Path], Callable[[], None]] | None = None):
    """A resume of the shared token after `edit` changed its newest manifest (or `files` changed the folder and
    returned how to undo it); the original is put back afterwards."""
    async def run(p: Probe) -> Observed:
        token = await snapshotted(p)
        gen = generations(p, token)[-1]
        manifest = gen / "session.json"
        original = manifest.read_bytes()
        undo = None
        try:
            if edit is not None:
                data = json.loads(original)
                edit(data)
                manifest.write_text(json.dumps(data, allow_nan=True))
            else:
                undo = files(gen)
            return await refused_resume(p, token)
        finally:
            if undo is not None:
                undo()
            manifest.write_bytes(original)
    return run


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        *parents, last = path.split(".")
        node = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value
    return edit


_DELETE = object()


def _moved(name: str) -> Callable[[Path], Callable[[], None]]:
    def change(gen: Path) -> Callable[[], None]:
        (gen / name).rename(gen / (name + ".away"))
        return lambda: (gen / (name + ".away")).rename(gen / name)
    return change


def _truncated_arrays(gen: Path) -> Callable[[], None]:
    files = sorted((f for f in (gen / "arrays").rglob("*") if f.is_file()), key=lambda f: -f.stat().st_size)
    target = files[0]
    backup = target.read_bytes()
    target.write_bytes(backup[: len(backup) // 3])
    return lambda: target.write_bytes(backup)


def resume_cases() -> list[Case]:
    out: list[Case] = []

    def token_case(name: str, token: str, summary: str):
        async def run(p: Probe) -> Observed:
            return await refused_resume(p, token)
        case(out, R, name, summary, run, "refuse", "resume_failed", "closed")

    token_case("unknown_token", "0123456789abcdef" * 2, "?resume= a well-formed token with no snapshot")
    token_case("short_token", "abc", "?resume=abc")
    token_case("traversal_token", "..%2F..%2Fetc", "?resume=../../etc")
    token_case("uppercase_token", "0123456789ABCDEF" * 2, "?resume= 32 upper-case hex digits")
    token_case("long_token", "a" * 4000, "?resume= 4,000 characters")
    token_case("empty_token", "", "?resume= (empty)")
    token_case("unicode_token", "%E2%98%83" * 11, "?resume= snowmen")

    async def twice(p: Probe) -> Observed:
        token = await snapshotted(p)
        url = f"model=omnijax&resume={token}"

        async def one():
            async with Realtime.open(p.served.ws, query=url) as s:
                first = s.created
                await asyncio.sleep(1.5)  # both are open at once
                return first
        firsts = await asyncio.gather(one(), one())
        kinds = [f.get("type") for f in firsts]
        await asyncio.sleep(1.5)
        if kinds.count("session.created") == 2:
            return Observed("silent", "both connections resumed the same token (a fork)")
        if kinds.count("session.created") == 0:
            return Observed("loss", f"neither resumed: {[f.get('error') for f in firsts]}")
        err = next(f for f in firsts if f.get("type") == "error")["error"]
        return Observed("clear", f"one resumed, the other: {err.get('code')}: {str(err.get('message'))[:100]}")
    case(out, R, "token_twice_at_once", "the same token on two connections at once", twice, "verdict",
         expect="one resumes, the other gets resume_failed", timeout_s=60)
    tampers = [("next_unit_2_40", "meta.conversation.next_unit", 2 ** 40),
               ("next_unit_negative", "meta.conversation.next_unit", -1),
               ("next_unit_string", "meta.conversation.next_unit", "x"),
               ("tokens_fed_negative", "meta.conversation.tokens_fed", -5),
               ("tokens_since_2_70", "meta.tokens_since_response", 2 ** 70),
               ("rendered_int", "meta.conversation.rendered", 5),
               ("messages_string", "meta.conversation.messages", "x"),
               ("message_content_int", "meta.conversation.messages.0.content", 5),
               ("temperature_hot", "meta.settings.temperature", "hot"),
               ("seed_2_64", "meta.settings.seed", 2 ** 64),
               ("max_tokens_0", "meta.settings.max_output_tokens", 0),
               ("rate_8000", "meta.settings.input_audio_rate", 8000),
               ("duplex_true", "meta.settings.duplex", True),
               ("vad_threshold_nan", "meta.settings.turn_detection", {"threshold": float("nan")}),
               ("model_other", "meta.model", "other-model"),
               ("session_id_int", "meta.session_id", 5),
               ("extra_key", "meta.evil", 1),
               ("conversation_missing", "meta.conversation", _DELETE),
               ("meta_list", "meta", []),
               ("format_other", "format", "not-omnijax"),
               ("format_version_99", "format_version", 99),
               ("spec_changed", "spec", {"layers": 1})]
    for name, path, value in tampers:
        shown = "(deleted)" if value is _DELETE else json.dumps(value, allow_nan=True)[:40]
        case(out, R, f"tampered_{name}", f"snapshot on disk: {path} = {shown}", _tamper(_set(path, value)), "refuse",
             "resume_failed")

    def array_shape(data: dict) -> None:
        name = next(iter(data["arrays"]))
        data["arrays"][name]["shape"] = [2 ** 20, 2 ** 20, 2 ** 10]
    case(out, R, "tampered_array_shape", "snapshot manifest: an array's shape claims 2**50 elements",
         _tamper(array_shape), "refuse", "resume_failed")
    case(out, R, "tampered_manifest_not_json", "snapshot manifest replaced by '{\"format\": '",
         _tamper(files=lambda g: ((g / "session.json").write_text('{"format": '), lambda: None)[1]), "refuse",
         "resume_failed")
    case(out, R, "tampered_manifest_missing", "snapshot manifest removed", _tamper(files=_moved("session.json")),
         "refuse", "resume_failed")
    case(out, R, "tampered_arrays_missing", "snapshot arrays/ folder removed", _tamper(files=_moved("arrays")),
         "refuse", "resume_failed")
    case(out, R, "tampered_arrays_truncated", "the largest array file cut to a third", _tamper(files=_truncated_arrays),
         "refuse", "resume_failed")

    async def control(p: Probe) -> Observed:
        return await resume_and_continue(p, await snapshotted(p))
    case(out, R, "resume_after_tampering", "the untampered snapshot still resumes exactly (nothing was poisoned)",
         control, "verdict", expect="resumes; next answer equals the uninterrupted one", timeout_s=90)
    return out


# ------------------------------------------------------------------------------------------------ traffic
PER_CLIENT = 16  # the server's --max-sessions-per-client (its default)


async def sessions_held(p: Probe) -> int | None:
    """How many sessions the server still counts against this client (which has none open): the per-client cap
    minus the native sessions it admits now (native sessions write no snapshot when they close; None: refused for
    another reason, e.g. the AIMD cap)."""
    opened = []
    try:
        for i in range(PER_CLIENT):
            ws = await native_open(p.served.ws)
            opened.append(ws)
            await ws.send(json.dumps({"type": "hello", "sample_rate": 16000}))
            reply = json.loads(await ws.recv())
            if reply.get("type") != "ready":
                return PER_CLIENT - i if "already holds" in str(reply.get("message")) else None
        return 0
    finally:
        for ws in opened:
            await ws.close()


async def leaked(p: Probe, patience_s: float = 15.0) -> int | None:
    """`sessions_held` once it reaches 0, or after `patience_s` (closing Realtime sessions write their last
    snapshot first)."""
    deadline = time.monotonic() + patience_s
    while True:
        held = await sessions_held(p)
        if not held or time.monotonic() > deadline:
            return held
        await asyncio.sleep(1.0)


async def _chat(p: Probe, timeout: float = 60.0, **changes) -> httpx.Response:
    return await p.client.post(p.base + "/v1/chat/completions", json=body(**changes), headers=AUTH, timeout=timeout)


def traffic_cases() -> list[Case]:
    out: list[Case] = []

    async def idle_realtime(p: Probe) -> Observed:
        async with Realtime.open(p.served.ws) as a, Realtime.open(p.served.ws) as b, \
                Realtime.open(p.served.ws) as c, Realtime.open(p.served.ws) as d, Realtime.open(p.served.ws) as e:
            assert all(s.created["type"] == "session.created" for s in (a, b, c, d, e))
            await asyncio.sleep(1.0)
            began = time.perf_counter()
            r = await _chat(p)
            took = time.perf_counter() - began
        if r.status_code == 200:
            return Observed("ok", f"chat completion 200 in {took:.1f} s with 5 idle Realtime sockets open")
        return Observed("wrong", f"chat completion HTTP {r.status_code} ({r.text[:120]}) with 5 idle sockets")
    case(out, T, "idle_realtime_sockets", "a chat completion while 5 idle Realtime sockets are open", idle_realtime,
         "verdict", expect="served (200)", timeout_s=120, slow=True)

    async def idle_native(p: Probe) -> Observed:
        sockets = [await native_open(p.served.ws) for _ in range(5)]
        try:
            for ws in sockets:
                await ws.send(json.dumps({"type": "hello", "sample_rate": 16000}))
                reply = json.loads(await ws.recv())
                if reply.get("type") != "ready":
                    return Observed("refused", f"native hello answered {reply}", reply.get("code"))
            await asyncio.sleep(1.0)
            r = await _chat(p)
        finally:
            for ws in sockets:
                await ws.close()
        return Observed("ok" if r.status_code == 200 else "wrong", f"chat completion HTTP {r.status_code} with 5 "
                        f"idle native sockets open")
    case(out, T, "idle_native_sockets", "a chat completion while 5 idle native sockets are open", idle_native,
         "verdict", expect="served (200)", timeout_s=120, slow=True)

    async def per_client_cap(p: Probe) -> Observed:
        from websockets.exceptions import ConnectionClosed

        opened: list = []
        try:
            for i in range(17):
                cm = Realtime.open(p.served.ws)
                s = await cm.__aenter__()
                opened.append(cm)
                if s.created.get("type") == "error":
                    err = s.created["error"]
                    return Observed("refused", f"connection {i + 1}: {err.get('code')}: {err.get('message')}",
                                    err.get("code"))
            return Observed("accepted", "17 Realtime sessions from one address all admitted (cap 16)")
        except ConnectionClosed as e:
            return Observed("refused", f"connection {len(opened) + 1} closed {e.rcvd.code if e.rcvd else 1006}",
                            "closed")
        finally:
            for cm in opened:
                await cm.__aexit__(None, None, None)
    case(out, T, "per_client_cap", "17 Realtime sessions from one address (--max-sessions-per-client 16)",
         per_client_cap, "refuse", "overloaded", timeout_s=120, slow=True)

    async def never_reads(p: Probe) -> Observed:
        """A client that never reads while each of its events makes a ~1 MB error event (its bad value echoed)."""
        from websockets.exceptions import ConnectionClosed

        mark = len(p.served.lines)
        before = p.served.rss_mb() or 0.0
        peak = before
        event = json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "r" * 2 ** 20,
                                                                         "content": [{"type": "input_text",
                                                                                      "text": "x"}]}})
        dropped = False
        async with Realtime.open(p.served.ws, max_queue=1) as s:
            try:
                for _ in range(ECHOES):
                    await asyncio.wait_for(s.ws.send(event), 10)
                    peak = max(peak, p.served.rss_mb() or 0)
            except (ConnectionClosed, asyncio.TimeoutError):
                dropped = True
            await asyncio.sleep(3.0)
            peak = max(peak, p.served.rss_mb() or 0)
            after = (p.served.rss_mb() or 0) - before  # what it still holds once the last event was answered
        dropped = dropped or any("slow_consumer" in x or "slow consumer" in x for x in p.served.log_since(mark))
        held = after
        if held > 128 and not dropped:
            return Observed("silent", f"the server held +{held:.0f} MB (peak +{peak - before:.0f}) for a client that "
                            f"never reads "
                            f"({ECHOES} events with 1 MB echoes; dropped: {dropped})")
        return Observed("ok", f"+{held:.0f} MB held after, +{peak - before:.0f} MB peak; dropped as a slow consumer: "
                        f"{dropped}")
    case(out, T, "never_reads_big_echoes", f"a Realtime client that never reads, sending {ECHOES} events whose error "
         "events echo 1 MB each", never_reads, "verdict", expect="dropped before holding > 128 MB", timeout_s=240,
         slow=True)

    async def stream_disconnect(p: Probe) -> Observed:
        async with p.client.stream("POST", p.base + "/v1/chat/completions", headers=AUTH,
                                   json=body(stream=True, max_tokens=64), timeout=30) as r:
            async for _ in r.aiter_lines():
                break  # the first chunk, then gone
        r2 = await _chat(p)
        return Observed("ok" if r2.status_code == 200 else "crash", f"next request HTTP {r2.status_code}")
    case(out, T, "stream_disconnect", "a streamed chat completion dropped after its first chunk", stream_disconnect,
         "verdict", expect="server unaffected, next request served", timeout_s=90)

    async def abandoned(p: Probe) -> Observed:
        mark = len(p.served.lines)
        try:
            await _chat(p, timeout=3.0, messages=[{"role": "user", "content": "word " * 40_000}], max_tokens=64)
            return Observed("ok", "the long request finished within 3 s")
        except httpx.TimeoutException:
            pass
        seen = await wait_for(lambda: any("cancelled" in x for x in p.served.log_since(mark)), 20)
        began = time.perf_counter()
        statuses = []
        while time.perf_counter() - began < 60:
            r = await _chat(p)
            statuses.append(r.status_code)
            if r.status_code == 200:
                break
        took = time.perf_counter() - began
        if not seen:
            return Observed("hang", f"no cancellation logged 20 s after the client left; next requests {statuses} "
                            f"in {took:.1f} s")
        return Observed("ok" if statuses[-1] == 200 else "hang", f"the abandoned request was cancelled; next "
                        f"requests {statuses} in {took:.1f} s")
    case(out, T, "abandoned_long_prompt", "a 200 KB prompt whose client gives up after 3 s", abandoned, "verdict",
         expect="its computation is cancelled", timeout_s=120, slow=True)

    async def realtime_disconnect(p: Probe) -> Observed:
        async with Realtime.open(p.served.ws) as s:
            token = s.token
            await s.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Tell me a long story."}]}})
            await s.send({"type": "response.create", "response": {"max_output_tokens": 64}})
            await s.until({"response.output_text.delta", "response.created"})
        await wait_for(lambda: turns_kept(p, token) is not None, 30)
        await asyncio.sleep(1.0)
        async with Realtime.open(p.served.ws, query=f"model=omnijax&resume={token}") as s:
            ok = s.created.get("type") == "session.created"
        return Observed("ok" if ok else "loss", "resumed after a disconnect mid-response" if ok else
                        f"resume failed: {s.created}")
    case(out, T, "realtime_disconnect_mid_response", "a Realtime client leaves while its response decodes, then "
         "resumes", realtime_disconnect, "verdict", expect="server unaffected; the session resumes", timeout_s=90)

    async def close_together(p: Probe) -> Observed:
        """Five sessions with a turn each close at the same moment (five final snapshots written at once)."""
        ref = await reference(p)
        cms = [Realtime.open(p.served.ws) for _ in range(5)]
        sessions = [await cm.__aenter__() for cm in cms]
        mark = len(p.served.lines)
        await asyncio.gather(*[say(s, QUESTIONS[0]) for s in sessions])
        tokens = [s.token for s in sessions]
        # --snapshot-every 1turn: each turn is written while the connection is still open
        durable = await wait_for(lambda: all(turns_kept(p, t) == 1 for t in tokens), 20)
        failed = [x for x in p.served.log_since(mark) if "snapshot" in x and "failed" in x]
        await asyncio.gather(*[cm.__aexit__(None, None, None) for cm in cms])
        if not durable or failed:
            missing = sum(turns_kept(p, t) != 1 for t in tokens)
            return Observed("loss", f"after 5 simultaneous turns, {len(failed)} periodic snapshot write(s) failed "
                            f"({missing} of 5 sessions had no snapshot of their turn 20 s later; a SIGKILL then "
                            f"loses it): {failed[0][:220] if failed else ''}")
        await wait_for(lambda: all(turns_kept(p, t) == 1 for t in tokens), 30)
        await asyncio.sleep(1.0)
        lost = []
        for t in tokens:
            seen = await resume_and_continue(p, t)
            if seen.outcome != "ok":
                lost.append(seen.detail)
        log = [x for x in p.served.log_since(0) if "snapshot" in x and ("fail" in x or "rror" in x)]
        if lost:
            return Observed("loss", f"{len(lost)} of 5 sessions not resumed exactly: {lost[0]}"
                            + (f"; log: {log[-1][:160]}" if log else ""))
        return Observed("ok", f"all 5 resumed exactly; the next answer {ref[1]!r}")
    case(out, T, "close_five_at_once", "5 Realtime sessions with one turn each close at once, then resume",
         close_together, "verdict", expect="each resumes exactly", timeout_s=180, slow=True)

    async def burst(p: Probe) -> Observed:
        rs = await asyncio.gather(*[_chat(p, timeout=90) for _ in range(24)], return_exceptions=True)
        codes = [getattr(r, "status_code", type(r).__name__) for r in rs]
        bad = [c for c in codes if c not in (200, 429)]
        no_retry = [r for r in rs if getattr(r, "status_code", 0) == 429 and "retry-after" not in r.headers]
        if bad:
            return Observed("crash", f"statuses {codes}")
        return Observed("wrong" if no_retry else "ok", f"{codes.count(200)} answered, {codes.count(429)} 429"
                        + (" without Retry-After" if no_retry else ""))
    case(out, T, "burst_24_chats", "24 chat completions at once", burst, "verdict",
         expect="each 200, or 429 with Retry-After", timeout_s=180, slow=True)

    async def churn(p: Probe) -> Observed:
        async with Realtime.open(p.served.ws) as a, Realtime.open(p.served.ws) as b:
            for s in (a, b):
                await s.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                                           "content": [{"type": "input_text",
                                                                                        "text": "hi"}]}})
                await s.until({"conversation.item.done"})
            async with Realtime.open(p.served.ws) as c:
                await a.ws.close()
                texts = []
                for s in (c, b):
                    text, done = await say(s, "Go on.")
                    if done["type"] == "error" or done["response"]["status"] == "failed":
                        return Observed("crash", f"response failed: {json.dumps(done)[:200]}")
                    texts.append(text)
        return Observed("ok", "after A left, C's and B's responses completed")
    case(out, T, "session_churn", "A and B add items, C connects, A leaves, C and B respond (issue 35 #1)", churn,
         "verdict", expect="both responses complete", timeout_s=90)
    for c in out:
        c.leak_check = True
    return out
