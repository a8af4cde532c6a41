"""The Metronome load test through the real OpenAI Realtime protocol: the unbounded-KV cliff and AIMD admission,
seen by WebSocket clients of `omnijax serve` (issue 25 item 6).

Server: `omnijax.serve.app.BackgroundServer` over `build_context` in this process, serving the embedded tiny random
Qwen2.5-Omni of `omnijax.testing.checkpoints` (`build_demo_model`, loaded once and shared by both configurations),
float32, `impl="xla"`, CPU. Two configurations run one after the other on the same small KV pool, each with its own
server:
`sink_window` (`SinkWindow(--sink, --window)`, bounded per-session KV) and `unbounded` (`NoSlide`). The pool holds
`--pool-windows` times the window (+2 pages) of every session the largest bucket admits, so unbounded sessions exhaust
it part-way through the run and are preempted, while the window keeps serving. AIMD admission is on in both
(`--aimd-target` x B, 0 disables). Each configuration compiles its own engine tick per batch bucket (`warm_up`) before
its clock starts.

Clients: `--clients` plain `websockets` clients on loopback (no SDK: less client overhead) arrive one every
`--arrival-s` seconds and stream until `--seconds` after the first arrival. Each speaks the Realtime GA events:
after `session.created`, per frame of B = `--frame-ms` it sends `input_audio_buffer.append` (one frame of 24 kHz
PCM16, base64, speech-like audio from `loadgen.speech_like_pcm`), `input_audio_buffer.commit` and `response.create`
with `max_output_tokens` = tau, and waits for `response.done`. Frame latency is commit sent -> `response.done`
received. It then sleeps until its next frame time; a late client skips the frame times it missed (no catch-up
burst; counted as `skipped`). A client refused at the door gets an `error` event with code `overloaded` and a close.

Per client: admitted or refused (and why: the AIMD cap or the session cap), frames sent, answered (`response.done`
with status completed, or incomplete at `max_output_tokens`) and lost (any other status, e.g. incomplete
"preempted", an `error` event, or no answer `--grace-s` after the run end). Server side: the worker's tick latencies
(`worker.latencies`), the engine telemetry's per-tick records (pool occupancy, running and preempted sessions),
the AIMD cap history, and after the server stopped, whether every session was closed and every page returned.

Defaults: 10 clients, one per second, B = 1000 ms, 60 s, tau 4, page size 16, SinkWindow(16, 256), buckets (4, 8)
(so at most 8 sessions), AIMD target 0.3 x B, a pool of twice the windows of 8 sessions (352 pages): about 2.5 min on
2 CPU cores. The AIMD signal is the engine tick's latency; a Realtime frame takes about three ticks (the one in
flight, its audio chunk, its response prompt), so frame latency runs near 3x the tick's.

Run: `python -m bench.metronome.realtime_load [--clients 10] [--frame-ms 1000] [--seconds 60] [--pages N]
[--page-size 16] [--arrival-s 1] [--out bench/out/realtime_load] [--quick | --smoke]` (`--quick` and `--smoke`: 2
clients for 3 s of 500 ms frames, SinkWindow(4, 64), one bucket of 2, a pool of one window per session: about 15 s;
`--smoke` loads the demo checkpoint the smoke run's scripts share, `harness.smoke_demo_model`).
"""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import logging
import math
import sys
import time

import numpy as np

import omnijax
from bench import harness
from omnijax.models.frontend import bucket
from omnijax.retention import NoSlide, SinkWindow
from omnijax.serve.app import BackgroundServer, build_context, warm_up
from omnijax.serve.audio_frames import frame_tokens
from omnijax.serve.context import ServeOptions
from omnijax.serve.loadgen import speech_like_pcm
from omnijax.serve.native.protocol import frame_samples

CONFIGS = ("sink_window", "unbounded")
RATE = 24_000  # the Realtime session's default input rate
# --quick / --smoke: 2 clients for 3 s of 500 ms frames, one bucket of 2 and a pool of one SinkWindow(4, 64) window
# per session, which unbounded sessions exhaust within the run (preemption, lost frames) and the window does not
QUICK = dict(clients=2, seconds=3.0, arrival_s=0.5, frame_ms=500.0, buckets=[2], grace_s=1.0, pool_windows=1.0,
             sink=4, window=64)


class UnretrievedFutures(logging.Filter):
    """Counts, and keeps out of the output, asyncio's "Future exception was never retrieved" reports: the server's
    audio feeds of a preempted session fail futures nobody awaits (see bench/metronome/RESULTS.md, realtime_load.py)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if "exception was never retrieved" in record.getMessage():
            self.count += 1
            return False
        return True


# ------------------------------------------------------------------------------------------------------ client
async def _until_done(ws, deadline: float, frame: dict) -> None:
    """Reads server events until `response.done` (or the deadline, or the socket closing); fills `frame`."""
    loop = asyncio.get_running_loop()
    while True:
        left = deadline - loop.time()
        if left <= 0:
            frame["error"] = frame["error"] or "no response.done by the run end"
            return
        try:
            event = json.loads(await asyncio.wait_for(ws.recv(), left))
        except asyncio.TimeoutError:
            continue
        kind = event.get("type")
        if kind == "error":
            frame["error"] = (event.get("error") or {}).get("code", "error")
            deadline = min(deadline, loop.time() + frame["budget_s"])  # a refused response.create answers nothing
        elif kind == "response.done":
            frame["latency_ms"] = 1e3 * (loop.time() - frame["commit_at"])
            r = event["response"]
            frame["status"] = r.get("status")
            frame["reason"] = (r.get("status_details") or {}).get("reason")
            frame["tokens"] = (r.get("usage") or {}).get("output_tokens", 0)
            frame["kv_cells"] = (event.get("omnijax") or {}).get("kv_cells")
            return


async def run_client(url: str, i: int, pcm: np.ndarray, *, arrival_s: float, end_s: float, grace_s: float,
                     frame_ms: float, tau: int, t0: float) -> dict:
    """One Realtime client: connects at `arrival_s`, then one frame per B until `end_s` (run-relative seconds).

    Args:
        url: `ws://host:port/v1/realtime`.
        i: the client's number.
        pcm: its 24 kHz int16 speech-like audio (frames are taken in turn, wrapping around).
        arrival_s: when it connects, seconds after `t0`.
        end_s: no frame is sent at or after this time.
        grace_s: how long after `end_s` an answer still counts.
        frame_ms: frame budget B.
        tau: `max_output_tokens` of every response.
        t0: the run's start (`loop.time()`).

    Returns:
        The client's row, with its frames under "frames".
    """
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    loop = asyncio.get_running_loop()
    budget, samples = frame_ms / 1000.0, frame_samples(frame_ms, RATE)
    nframes = len(pcm) // samples
    row = {"client": i, "arrival_s": arrival_s, "admitted": False, "refused": False, "refusal": None, "error": None,
           "sent": 0, "answered": 0, "lost": 0, "skipped": 0, "frames": []}
    await asyncio.sleep(max(0.0, t0 + arrival_s - loop.time()))
    row["end_s"] = None
    try:
        async with connect(url, max_size=1 << 24, ping_interval=None, open_timeout=30, close_timeout=5) as ws:
            first = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if first.get("type") != "session.created":
                err = first.get("error") or {}
                row["refused"] = err.get("code") == "overloaded"
                row["refusal"] = err.get("message")
                row["error"] = None if row["refused"] else err.get("code", first.get("type"))
                row["end_s"] = loop.time() - t0
                return row
            row["admitted"] = True
            row["admitted_s"] = loop.time() - t0
            next_at, k = loop.time(), 0
            while next_at < t0 + end_s:
                await asyncio.sleep(max(0.0, next_at - loop.time()))
                chunk = pcm[(k % nframes) * samples:(k % nframes + 1) * samples]
                audio = base64.b64encode(chunk.astype("<i2").tobytes()).decode()
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
                frame = {"client": i, "seq": k, "t": loop.time() - t0, "commit_at": loop.time(), "budget_s": budget,
                         "latency_ms": None, "status": None, "reason": None, "tokens": 0, "kv_cells": None,
                         "error": None}
                await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
                await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": tau}}))
                row["sent"] += 1
                try:
                    await _until_done(ws, t0 + end_s + grace_s, frame)
                finally:
                    ok = frame["error"] is None and (frame["status"] == "completed" or (
                        frame["status"] == "incomplete" and frame["reason"] == "max_output_tokens"))
                    frame["lost"] = not ok
                    row["answered" if ok else "lost"] += 1
                    row["frames"].append({k: v for k, v in frame.items() if k not in ("commit_at", "budget_s")})
                k += 1
                next_at += budget
                if loop.time() > next_at:  # late: skip the frame times already past, no catch-up burst
                    missed = math.ceil((loop.time() - next_at) / budget)
                    row["skipped"] += missed
                    next_at += missed * budget
    except (OSError, ConnectionClosed, asyncio.TimeoutError) as e:
        row["error"] = row["error"] or f"connection: {type(e).__name__}: {e}"
    row["end_s"] = loop.time() - t0
    return row


def client_audio(args) -> list[np.ndarray]:
    """Each client's 24 kHz speech-like PCM, long enough for its whole stay."""
    budget = args.frame_ms / 1000.0
    return [speech_like_pcm(max(budget, args.seconds - i * args.arrival_s) + 2 * budget, seed=100 + i,
                            sample_rate=RATE) for i in range(args.clients)]


async def load(url: str, args, audio: list[np.ndarray]) -> list[dict]:
    """All clients of one configuration, arrivals staggered by `--arrival-s`."""
    t0 = asyncio.get_running_loop().time()
    return list(await asyncio.gather(*(
        run_client(url, i, audio[i], arrival_s=i * args.arrival_s, end_s=args.seconds, grace_s=args.grace_s,
                   frame_ms=args.frame_ms, tau=args.tau, t0=t0) for i in range(args.clients))))


# ------------------------------------------------------------------------------------------------------ server
def run_config(model, name: str, args, chunk_tokens: int) -> dict:
    """One configuration: its own server over the shared model, warmed up, then the clients. Returns its rows."""
    policy = SinkWindow(sink=args.sink, window=args.window) if name == "sink_window" else NoSlide()
    stream = omnijax.StreamConfig(policy=policy, num_pages=args.pages, page_size=args.page_size,
                                  max_answer_tokens=args.tau, impl="xla")
    options = ServeOptions(port=0, frame_ms=args.frame_ms, max_output_tokens=max(args.tau, 16),
                           max_sessions_per_client=args.clients + 1)
    context = build_context(model, options=options, stream=stream, chunk_tokens=chunk_tokens, buckets=args.buckets,
                            aimd_target=args.aimd_target)
    worker, engine = context.worker, context.worker.engine
    compile_s = warm_up(context, max(args.buckets))
    unretrieved = UnretrievedFutures()
    logging.getLogger("asyncio").addFilter(unretrieved)
    print(f"  {name}: {policy}, warm-up {compile_s:.1f} s", flush=True)
    audio = client_audio(args)
    with BackgroundServer(context) as server:
        url = f"ws://127.0.0.1:{server.port}/v1/realtime"
        tel0 = engine.telemetry.now()  # run start on the telemetry's clock (its records run from the warm-up)
        wall = time.perf_counter()
        clients = asyncio.run(load(url, args, audio))
        wall = time.perf_counter() - wall
        deadline = time.monotonic() + 15
        while worker.lanes and time.monotonic() < deadline:  # closing follows each disconnect
            time.sleep(0.05)
        lanes_after_close = sorted(worker.lanes)
    gc.collect()  # the server's loop is gone: its failed futures are collected (and reported) now
    logging.getLogger("asyncio").removeFilter(unretrieved)
    records = [dict(r.to_dict(), t=r.time_s - tel0) for r in engine.telemetry.records if r.time_s >= tel0]
    stop = min([c["end_s"] for c in clients if c["admitted"] and c["end_s"] is not None] or [args.seconds])
    in_run = [r for r in records if r["t"] < stop]  # before the first client leaves
    frames = sorted((f for c in clients for f in c.pop("frames")), key=lambda f: f["t"])
    ticks = np.asarray(worker.latencies, float) * 1e3
    lat = np.asarray([f["latency_ms"] for f in frames if not f["lost"]], float)
    pct = lambda x, q: float(np.percentile(x, q)) if x.size else None  # noqa: E731
    aimd = worker.admission
    first_lost = next((f["t"] for f in frames if f["lost"]), None)
    row = {"config": name, "policy": str(policy), "pages": args.pages, "clients": len(clients),
           "admitted": sum(c["admitted"] for c in clients), "refused": sum(c["refused"] for c in clients),
           "refused_aimd": sum(bool(c["refused"] and "AIMD" in (c["refusal"] or "")) for c in clients),
           "client_errors": sum(c["error"] is not None for c in clients),
           "sent": sum(c["sent"] for c in clients), "answered": sum(c["answered"] for c in clients),
           "lost": sum(c["lost"] for c in clients), "skipped": sum(c["skipped"] for c in clients),
           "empty_answers": sum(1 for f in frames if f["status"] is not None and f["tokens"] == 0),
           "first_lost_s": first_lost, "latency_p50_ms": pct(lat, 50), "latency_p99_ms": pct(lat, 99),
           "tick_p50_ms": pct(ticks, 50), "tick_p99_ms": pct(ticks, 99), "ticks": worker.stats["ticks"],
           "tick_errors": worker.stats["tick_errors"],
           "occupancy_end": in_run[-1]["occupancy"] if in_run else None,
           "peak_occupancy": max((r["occupancy"] for r in records), default=0.0),
           "preempted": engine.telemetry.counters["sessions_preempted"],
           "dropped_tokens": engine.telemetry.counters["dropped_tokens"],
           "aimd_cap_end": None if aimd is None else aimd.cap,
           "aimd_cap_min": None if aimd is None else min([h["cap"] for h in aimd.history] or [aimd.cap]),
           "unretrieved_futures": unretrieved.count, "lanes_after_close": lanes_after_close,
           "occupancy_after_close": engine.occupancy,
           "compile_s": compile_s, "run_wall_s": wall}
    reasons = {}
    for f in frames:
        if f["lost"]:
            key = f["error"] or f"{f['status']}:{f['reason']}"
            reasons[key] = reasons.get(key, 0) + 1
    row["lost_reasons"] = reasons
    history = [] if aimd is None else aimd.history
    return {"summary": row, "clients": clients, "frames": frames, "ticks": records, "aimd": history}


# ------------------------------------------------------------------------------------------------------ output
COLUMNS = [("config", "config", ""), ("adm", "admitted", "d"), ("refused", "refused", "d"),
           ("(aimd)", "refused_aimd", "d"), ("sent", "sent", "d"), ("answered", "answered", "d"),
           ("lost", "lost", "d"), ("skipped", "skipped", "d"), ("p50 ms", "latency_p50_ms", ".1f"),
           ("p99 ms", "latency_p99_ms", ".1f"), ("tick p50", "tick_p50_ms", ".1f"), ("tick p99", "tick_p99_ms", ".1f"),
           ("occ end", "occupancy_end", ".2f"), ("peak occ", "peak_occupancy", ".2f"),
           ("preempted", "preempted", "d"), ("1st lost s", "first_lost_s", ".1f")]


def plot(results: list[dict], args, out) -> None:
    """Per-frame latency over time (lost frames marked), pool occupancy and open / preempted sessions per tick."""
    plt = harness.pyplot()
    colors = {"sink_window": "tab:blue", "unbounded": "tab:red"}
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    top = max([f["latency_ms"] or 0 for r in results for f in r["frames"]] + [1.0]) * 1.3
    for n, r in enumerate(results):
        name, c = r["summary"]["config"], colors[r["summary"]["config"]]
        ok = [f for f in r["frames"] if not f["lost"]]
        lost = [f for f in r["frames"] if f["lost"]]
        axes[0].plot([f["t"] for f in ok], [f["latency_ms"] for f in ok], ".", ms=3, color=c,
                     label=f"{name}: answered ({len(ok)})")
        axes[0].plot([f["t"] for f in lost], [f["latency_ms"] or top for f in lost], "x", ms=4, color=c, mew=0.8,
                     label=f"{name}: lost ({len(lost)})")
        ticks = r["ticks"]
        axes[1].plot([x["t"] for x in ticks], [x["occupancy"] for x in ticks], color=c, lw=1, label=name)
        axes[2].plot([x["t"] for x in ticks], [x["running"] for x in ticks], color=c, lw=1,
                     label=f"{name}: running")
        axes[2].plot([x["t"] for x in ticks], [x["waiting"] for x in ticks], color=c, lw=1, ls="--",
                     label=f"{name}: preempted (parked)")
        refused = [cl["arrival_s"] for cl in r["clients"] if cl["refused"]]
        axes[2].plot(refused, [0.2 + 0.3 * n] * len(refused), "v", color=c, ms=6, label=f"{name}: refused arrivals")
    budget = args.frame_ms
    axes[0].axhline(budget, color="gray", ls=":", lw=0.8, label=f"B = {budget:g} ms")
    axes[0].set(yscale="log", xlabel="run time (s)", ylabel="commit -> response.done (ms)",
                title=f"Per-frame latency, {args.clients} Realtime clients (x: lost; no answer: at the top)")
    axes[1].axhline(1.0, color="k", lw=0.6)
    axes[1].set(xlabel="run time (s)", ylabel="KV pool occupancy", ylim=(0, 1.05),
                title=f"Pool: {args.pages} pages x {args.page_size} (engine telemetry per tick)")
    axes[2].set(xlabel="run time (s)", ylabel="sessions", title="Sessions per tick; refused arrivals")
    for ax in axes:
        ax.legend(fontsize=7)
    harness.save_png(fig, out, "realtime_load", dpi=110)


def main(argv=None):
    parser = harness.parser(__doc__, out="bench/out/realtime_load")
    parser.add_argument("--quick", action="store_true", help="a smoke run of seconds (same as --smoke)")
    parser.add_argument("--clients", type=int, default=10, help="Realtime clients per configuration")
    parser.add_argument("--frame-ms", type=float, default=1000.0, help="frame budget B")
    parser.add_argument("--seconds", type=float, default=60.0, help="streaming time, from the first arrival")
    parser.add_argument("--arrival-s", type=float, default=1.0, help="seconds between arrivals")
    parser.add_argument("--grace-s", type=float, default=3.0, help="an answer later than this after the end is lost")
    parser.add_argument("--pages", type=int, default=None,
                        help="KV pool pages (default: --pool-windows x every admissible session's window)")
    parser.add_argument("--pool-windows", type=float, default=2.0,
                        help="default pool: this many windows (+2 pages) per session of the largest bucket")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--sink", type=int, default=16)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--tau", type=int, default=4, help="answer tokens per tick and max_output_tokens per frame")
    parser.add_argument("--buckets", type=int, nargs="+", default=[4, 8],
                        help="engine batch buckets (the largest is the session cap)")
    parser.add_argument("--aimd-target", type=float, default=0.3, help="AIMD target as a fraction of B (0: off)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    argv = [("--smoke" if a == "--quick" else a) for a in (sys.argv[1:] if argv is None else argv)]
    args = harness.parse(parser, argv, smoke=QUICK)
    out = harness.output_dir(args)
    start = time.perf_counter()
    model = harness.demo_model(out, args.smoke)  # a smoke run's: the checkpoint its scripts share
    chunk_tokens = max(32, bucket(frame_tokens(frame_samples(args.frame_ms), model)))
    per_session = math.ceil((args.sink + args.window + chunk_tokens + args.tau) / args.page_size) + 2
    if args.pages is None:
        args.pages = math.ceil(args.pool_windows * max(args.buckets) * per_session)
    print(f"B = {args.frame_ms:g} ms ({chunk_tokens}-token chunks), tau {args.tau}, {args.clients} clients every "
          f"{args.arrival_s:g} s for {args.seconds:g} s, pool {args.pages} x {args.page_size} (a window needs "
          f"~{per_session} pages), buckets {args.buckets}, AIMD target {args.aimd_target:g} x B; model ready in "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    results = [run_config(model, name, args, chunk_tokens) for name in args.configs]
    rows = [r["summary"] for r in results]
    print()
    harness.print_table(rows, COLUMNS)
    for row in rows:
        print(f"  {row['config']}: lost {row['lost_reasons'] or 'none'}; empty answers {row['empty_answers']}; "
              f"AIMD cap end {row['aimd_cap_end']} (min {row['aimd_cap_min']}); after close: sessions "
              f"{row['lanes_after_close'] or 'none'}, occupancy {row['occupancy_after_close']:.3f}; client errors "
              f"{row['client_errors']}, tick errors {row['tick_errors']}, unretrieved future exceptions "
              f"{row['unretrieved_futures']}")
    runtime = time.perf_counter() - start
    print(f"total runtime {runtime:.0f} s")
    harness.write_json(out, "realtime_load", {"config": {**vars(args), "chunk_tokens": chunk_tokens},
                                              "runtime_s": runtime, "rows": rows, "runs": results}, indent=None)
    plot(results, args, out)


if __name__ == "__main__":
    main()
