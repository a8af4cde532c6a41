"""Hostile-input reliability probe of `omnijax serve` (issue 35): hundreds of bad inputs, each with its expected
outcome declared, classified clear / ok / crash / hang / silent / loss / wrong.

Starts `omnijax serve --demo-model` in a subprocess on a free loopback port (with `--snapshot-dir`, `--api-key`,
`--snapshot-every 1turn`) and runs the cases of `bench/metronome/_hostile_*.py` one after another:

- auth: missing / wrong / malformed keys on every route, the browser subprotocol key;
- chat_fields: every chat-completions field with bad values (types, ranges, NaN, huge, empty), and fields the
  server's docstring neither accepts nor refuses (ignoring those is silent acceptance);
- chat_body: bodies that are not JSON, nested 100,000 deep, over the size cap, over the message / part caps;
- chat_media: WAV headers that lie (rates 0 / 1 / 4e9 / 384001, widths, channels, truncated data,
  WAVE_FORMAT_EXTENSIBLE), PNG / JPEG headers claiming 20000x20000 or 0x0, truncated and corrupt files, alpha, data
  URLs of the wrong type, http(s) URLs (a listener tells whether the server fetched them);
- realtime_events: every Realtime client event type with bad field values, unknown events, bad JSON, binary and
  oversized messages, audio buffer overflow, seeds outside 64 bits, wrong model names;
- realtime_media: images in `conversation.item.create`;
- native: hellos and frames of the native `/session` protocol;
- resume: unknown / malformed tokens, one token on two connections at once, snapshots tampered on disk (each then
  put back, and the untampered one must still resume exactly);
- traffic: idle sockets, a client that never reads, disconnects mid-response, a burst, session churn;
- sigkill: four sessions, `kill -9`, restart: the turns each resumed session keeps (at most one snapshot interval
  may be lost) and whether its next answer equals the uninterrupted conversation's.

Each case has a timeout (past it: hang). After every case `GET /v1/models` must answer within 2 s (else hang; a dead
server is a crash), and a dead or stuck server is restarted (counted). Prints a table per category and in total,
every case that is not clear / ok, and writes `hostile_probe.json` (one row per case: id, category, input, expected,
observed, class, seconds) and `hostile_probe.png` (stacked bars per category) under `--out`. `--smoke` runs a
sample of about 30 quick cases.
"""

from __future__ import annotations

import asyncio
import datetime
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench import harness
from bench.metronome import _hostile_media as media
from bench.metronome._hostile_cases import (
    CLASSES,
    Case,
    FetchListener,
    Probe,
    chat_body_cases,
    chat_field_cases,
    chat_media_cases,
    classify,
)
from bench.metronome._hostile_kill import sigkill_cases
from bench.metronome._hostile_protocol import auth_cases, native_cases
from bench.metronome._hostile_realtime import realtime_event_cases, realtime_media_cases, say
from bench.metronome._hostile_server import AUTH, Busy, Observed, ProbeServer, Realtime, problems, unclosed
from bench.metronome._hostile_sessions import NoSnapshot, leaked, resume_cases, traffic_cases

BAD = ("crash", "hang", "silent", "loss", "wrong")
COLORS = {"clear": "#4c9f70", "ok": "#9ccfa8", "crash": "#d62728", "hang": "#9467bd", "silent": "#ff7f0e",
          "loss": "#8c564b", "wrong": "#7f7f7f"}


def all_cases() -> list[Case]:
    cases = (auth_cases() + chat_field_cases() + chat_body_cases() + chat_media_cases() + realtime_event_cases()
             + realtime_media_cases() + native_cases() + resume_cases() + traffic_cases() + sigkill_cases())
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
    return cases


def smoke_sample(cases: list[Case], n: int = 30) -> list[Case]:
    """About `n` quick cases spread over the categories (every k-th of each)."""
    quick = [c for c in cases if not c.slow]
    step = max(1, len(quick) // n)
    return quick[::step][:n]


async def warm_up(p: Probe) -> None:
    """Compiles what the cases will use (the image and audio encoders, a response) before any case is timed."""
    from bench.metronome._hostile_cases import body

    for b in (body(), body(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": media.data_url(media.image())}},
            {"type": "input_audio", "input_audio": {"data": media.b64(media.wav()), "format": "wav"}}]}])):
        r = await p.client.post(p.base + "/v1/chat/completions", json=b, headers=AUTH, timeout=300)
        r.raise_for_status()
    async with Realtime.open(p.served.ws) as s:
        await s.send({"type": "input_audio_buffer.append", "audio": media.b64(media.tone(0.5, 24000))})
        await say(s, "Warm up.")


async def attempt(p: Probe, case: Case) -> Observed:
    """One run of `case` within its timeout; what it saw (exceptions turned into outcomes)."""
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    try:
        return await asyncio.wait_for(case.run(p), case.timeout_s)
    except Busy as e:
        return Observed("refused", f"overloaded: {e}", "overloaded")
    except NoSnapshot as e:  # the first case to find it is a loss; the cases built on the snapshot say they did not run
        return Observed("wrong" if str(e).startswith("not run") else "loss", str(e))
    except asyncio.TimeoutError:
        return Observed("hang", f"no outcome within {case.timeout_s:g} s")
    except ConnectionClosed as e:
        return Observed("dropped", f"socket closed {e.rcvd.code if e.rcvd else 1006} with no error event")
    except InvalidStatus as e:
        code = e.response.status_code
        return Observed("dropped" if code >= 500 else "wrong", f"handshake refused with HTTP {code}")
    except httpx.TimeoutException as e:  # the server never answered this client
        return Observed("hang", f"{type(e).__name__}: no HTTP answer within the client's timeout")
    except (httpx.HTTPError, OSError) as e:
        return Observed("dropped", f"{type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 - a fault of the probe itself: reported as wrong, never hidden
        return Observed("wrong", f"probe error {type(e).__name__}: {e}")


async def run_case(p: Probe, case: Case) -> dict:
    """Runs `case` (again while the server refuses it as overloaded), classifies it, then checks the server's
    health: a dead server is a crash, `/v1/models` slower than 2 s a hang; either is restarted."""
    mark, began = len(p.served.lines), time.perf_counter()
    retries = 0
    while True:
        seen = await attempt(p, case)
        busy = seen.code in ("overloaded", "close_1013") and seen.code not in case.codes
        if not busy or retries >= 30:
            break
        retries += 1  # refused as overloaded (admission, not the input): the case is tried again
        await asyncio.sleep(1.0)
    seconds = time.perf_counter() - began
    cls = classify(case, seen)
    health = p.served.healthy()
    restarted = False
    if health is None:
        if not p.served.alive():
            cls, seen.detail = "crash", f"the server died (exit {p.served.proc.returncode}); {seen.detail}"
        else:
            stalled = time.perf_counter()
            while p.served.healthy() is None and time.perf_counter() - stalled < 30:
                await asyncio.sleep(0.5)
            cls, seen.detail = "hang", f"/v1/models took over 2 s after the case; {seen.detail}"
        if p.served.healthy() is None:
            p.served.kill()
            await asyncio.to_thread(p.served.start)
            restarted = True
    held = None
    if case.leak_check and not restarted:
        held = await leaked(p)
        before = p.state.get("held", 0)
        if held is not None:
            p.state["held"] = held
        if held and held > before:  # counted against the case that left them (the earlier ones stay counted)
            seen.detail += (f"; the server still holds {held - before} more session(s) of this client 15 s after "
                            f"they all left ({held} in all)")
            cls = "hang" if cls in ("ok", "clear") else cls
    return {"id": case.id, "category": case.category, "input": case.summary, "expected": case.expect,
            "observed": seen.detail, "class": cls, "seconds": round(seconds, 3),
            "health_s": None if health is None else round(health, 3), "restarted": restarted, "retries": retries,
            "sessions_held_after": held, "log_span": [mark, len(p.served.lines)],
            "server_log": problems(p.served.log_since(mark))[:3]}


async def attribute_leaks(p: Probe, rows: list[dict], patience_s: float = 20.0) -> int:
    """Sessions the running server logged as connected and never as closed (after `patience_s` for the last
    closes), each put on the case whose log span holds its connect line: a case that left one behind is a hang (its
    handler never ended; it holds a per-client slot and SIGTERM waits for it). Returns how many were found."""
    start = p.served.instance_start
    deadline = time.monotonic() + patience_s
    while (left := unclosed(p.served.lines, start)) and time.monotonic() < deadline:
        await asyncio.sleep(1.0)
    for sid, index in left.items():
        row = next((r for r in rows if r["log_span"][0] <= index < r["log_span"][1]), None)
        if row is None or sid in row.get("never_closed", []):
            continue
        row.setdefault("never_closed", []).append(sid)
        if row["class"] in ("ok", "clear"):
            row["class"] = "hang"
        row["observed"] += f"; session {sid} never closed (its handler still runs {patience_s:g}+ s later)"
    return len(left)


def summarize(rows: list[dict]) -> list[dict]:
    cats = list(dict.fromkeys(r["category"] for r in rows))
    table = []
    for cat in cats + ["total"]:
        sel = [r for r in rows if cat in ("total", r["category"])]
        table.append({"category": cat, "tried": len(sel), **{c: sum(r["class"] == c for r in sel) for c in CLASSES}})
    return table


def plot(table: list[dict], out: Path) -> None:
    plt = harness.pyplot()
    rows = [t for t in table if t["category"] != "total"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    bottom = [0] * len(rows)
    for cls in CLASSES:
        values = [t[cls] for t in rows]
        ax.bar([t["category"] for t in rows], values, bottom=bottom, color=COLORS[cls], label=cls)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("cases")
    ax.set_ylim(0, 1.2 * max(t["tried"] for t in rows))  # room for the legend
    total = table[-1]
    ax.set_title(f"omnijax serve hostile-input probe: {total['tried']} cases, " + ", ".join(
        f"{total[c]} {c}" for c in CLASSES))
    ax.legend(ncol=len(CLASSES), fontsize=8, loc="upper right")
    plt.setp(ax.get_xticklabels(), rotation=25, ha="right")
    harness.save_png(fig, out, "hostile_probe")


async def probe(args, cases: list[Case], out: Path) -> dict:
    snapshots = Path(tempfile.mkdtemp(prefix="hostile-probe-"))
    served = ProbeServer(snapshots / "sessions", warmup_sessions=args.warmup_sessions)
    await asyncio.to_thread(served.start)
    print(f"server: {' '.join(served.command[1:])}\nstarted in {served.start_s[0]:.0f} s at {served.base}", flush=True)
    rows: list[dict] = []
    leaks = 0
    try:
        async with httpx.AsyncClient(timeout=120) as client:
            p = Probe(served, client, FetchListener())
            began = time.perf_counter()
            await warm_up(p)
            print(f"warm-up {time.perf_counter() - began:.0f} s; {len(cases)} cases", flush=True)
            for i, case in enumerate(cases):
                if case.id == "sigkill/kill_and_restart" or case.id == "sigkill/sigterm_idle_server":
                    leaks += await attribute_leaks(p, rows)  # before this server instance ends
                row = await run_case(p, case)
                rows.append(row)
                flag = "" if row["class"] in ("clear", "ok") else "   <--"
                print(f"[{i + 1:3d}/{len(cases)}] {row['class']:6s} {row['seconds']:6.1f}s {case.id}: "
                      f"{row['observed'][:110]}{flag}", flush=True)
        leaks += await attribute_leaks(p, rows)
        shutdown_s = None
        if served.alive():
            stopping = time.perf_counter()
            served.stop(120)
            shutdown_s = time.perf_counter() - stopping
    finally:
        served.kill()
        (out / "hostile_probe_server.log").write_text("\n".join(served.lines) + "\n")
        shutil.rmtree(snapshots, ignore_errors=True)
    return {"rows": rows, "server_starts": served.starts, "server_start_s": [round(s, 1) for s in served.start_s],
            "shutdown_s": None if shutdown_s is None else round(shutdown_s, 2),
            "sessions_never_closed": leaks, "sigkill": p.state.get("sigkill_lost"),
            "server_command": served.command[1:]}


def checkout() -> dict:
    """The commit the server ran and the library files that differed from it (others edit the same tree)."""
    def git(*a: str) -> str:
        done = subprocess.run(["git", *a], capture_output=True, text=True, cwd=harness.ROOT)
        return done.stdout.strip()
    return {"commit": git("rev-parse", "--short", "HEAD"), "modified": git("status", "--short", "omnijax").splitlines()}


def main(argv=None) -> None:
    p = harness.parser(__doc__)
    p.add_argument("--only", nargs="+", default=None, help="categories (or case id prefixes) to run")
    p.add_argument("--warmup-sessions", type=int, default=8, help="the server's --warmup-sessions")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    # --smoke: the server warms one engine bucket (a second, warmed, cost ~50 CPU s of the smoke run's ~160)
    args = harness.parse(p, argv, smoke={"warmup_sessions": 1})
    cases = all_cases()
    if args.only:
        cases = [c for c in cases if any(c.category == o or c.id.startswith(o) for o in args.only)]
        if not cases:
            p.error(f"--only {' '.join(args.only)} matches no case (case ids look like 'chat_fields/stop_list'; "
                    "--list shows them)")
    if args.smoke:
        cases = smoke_sample(cases)
    if args.list:
        for c in cases:
            print(f"{c.id:50s} {c.expected:7s} {c.summary}")
        print(f"{len(cases)} cases")
        return
    out = harness.output_dir(args)
    result = asyncio.run(probe(args, cases, out))
    rows = result["rows"]
    table = summarize(rows)
    print()
    harness.print_table(table, [("category", "category", "s"), ("tried", "tried", "d")]
                        + [(c, c, "d") for c in CLASSES])
    bad = [r for r in rows if r["class"] in BAD]
    if bad:
        print(f"\n{len(bad)} cases not clear / ok:")
        for r in bad:
            print(f"  {r['class']:6s} {r['id']}: {r['input']}\n         expected {r['expected']}; observed "
                  f"{r['observed'][:300]}")
    print(f"\nsessions never closed: {result['sessions_never_closed']}; server starts: {result['server_starts']} "
          f"(restarts after a crash or hang: "
          f"{sum(r['restarted'] for r in rows)}); SIGTERM exit {result['shutdown_s']} s; SIGKILL turns "
          f"(done, kept, lost): {result['sigkill']}")
    command = "python -m bench.metronome.hostile_probe " + " ".join(sys.argv[1:] if argv is None else argv)
    result["checkout"] = checkout()
    harness.write_json(out, "hostile_probe", {"command": command, "date": datetime.date.today().isoformat(),
                                              "summary": table, **result})
    plot(table, out)


if __name__ == "__main__":
    main()
