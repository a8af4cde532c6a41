"""Per-token streaming of chat completions (issue 37 item 4): time to first token and the gaps between tokens of a
chat completion streamed to the official openai SDK, with the engine's ticks host-driven (`EngineConfig.per_token`:
one jitted step per token, each token handed to the SSE stream as it is decoded) against fused (one program decodes
up to tau tokens per tick, sent as one block), and what the host-driven tick costs: the tokens per second of
concurrent streamed chats, with a native session's frames beside them (their server latency and round trip).

Set-up: the demo checkpoint (`omnijax serve --demo-model`: the tiny random Qwen2.5-Omni) served in-process
(`BackgroundServer`), SinkWindow(16, 1024) over a 256 x 64 pool, tau `--tau` (8, the serve default), T 8, buckets 1, 2,
4, 8, RowSampling (greedy requests), no AIMD, frames of 250 ms. One server; the engine's `per_token` setting is
switched between rounds (the server idle), the two modes alternating and the order rotated from round to round, so a
drift of the shared machine's speed hits both alike. Each round of a mode: `--singles` streamed chats alone, one
after another (`--tokens` tokens; TTFT = request sent to its first content chunk, which needs the prompt's prefill
ticks first; gaps = between consecutive content chunks: one token apart per token, tau apart per tick), then `--chats`
streamed chats at once beside a native session streaming frames (tokens/s = their completion tokens over the wall
time from the first request to the last answer's end; the native frames' `latency_ms`, tick start to reply, and
round trip). The demo model may end an answer early with its end token: tokens are counted as decoded. Last, the
engine alone (no HTTP, the server idle): ms per tick of `--chats` sessions each asking tau tokens, fused against
host-driven, in interleaved rounds (`harness.interleaved`), and when the host-driven tick hands over its first token
(the engine's share of time to first token: the fused tick hands over all its tokens at its end).

Run: `python -m bench.metronome.token_streaming [--rounds 6] [--singles 5] [--tokens 32] [--chats 4] [--tau 8]
[--out bench/out] [--smoke]` (`--smoke` loads the demo checkpoint the smoke run's scripts share,
`harness.smoke_demo_model`)
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import shutil
import tempfile
import time

import numpy as np

from bench import harness

ASK = [{"role": "user", "content": "Tell me a long story about the sea and its ships."}]
FRAME_MS = 250.0
MODES = ("per_token", "per_tick")


def build_server(tau: int, sessions: int = 8, checkpoint: str | None = None):
    """The demo checkpoint served in-process (see the module docstring), warmed up for `sessions` sessions;
    `checkpoint`: an already built demo checkpoint (a smoke run's shared one) instead of building one."""
    import omnijax
    from omnijax.decoding import RowSampling
    from omnijax.retention import SinkWindow
    from omnijax.serve.app import BackgroundServer, build_context, build_demo_model, warm_up
    from omnijax.serve.context import ServeOptions

    if checkpoint is None:
        folder = tempfile.mkdtemp(prefix="omnijax-bench-demo-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)  # the checkpoint (~90 MB) goes with the process
        checkpoint = build_demo_model(folder)
    model = omnijax.load(checkpoint)
    stream = omnijax.StreamConfig(policy=SinkWindow(16, 1024), num_pages=256, page_size=64, max_answer_tokens=tau,
                                  decoding=RowSampling(seed=0))
    context = build_context(model, options=ServeOptions(port=0, frame_ms=FRAME_MS, max_output_tokens=4096),
                            stream=stream, chunk_tokens=8, buckets=(1, 2, 4, 8), aimd_target=0, per_token=True)
    warm_up(context, sessions)
    return BackgroundServer(context)


def set_mode(server, mode: str) -> None:
    server.wait_idle()
    engine = server.context.worker.engine
    engine.config = dataclasses.replace(engine.config, per_token=mode == "per_token")


async def stream_one(client, tokens: int) -> dict:
    """One streamed chat: arrival times of its content chunks (seconds since the request), its token count."""
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(model="omnijax", messages=ASK, stream=True, max_tokens=tokens,
                                                  temperature=0, stream_options={"include_usage": True})
    arrivals, used = [], 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter() - t0)
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
    return {"arrivals": arrivals, "tokens": used, "wall_s": time.perf_counter() - t0}


async def concurrent(server, client, chats: int, tokens: int, native_s: float = 2.0) -> dict:
    """`chats` streamed chats at once beside a native session sending frames until they end (in runs of
    `native_s` seconds)."""
    from omnijax.serve import loadgen

    loop, rows = asyncio.get_running_loop(), []
    stop = asyncio.Event()

    async def native():  # frames for as long as the chats run (at least native_s), then bye
        while True:
            await loadgen.run_client(server.native_url, client=0, frame_ms=FRAME_MS, duration_s=native_s,
                                     t0=loop.time(), phase_s=0.0, seed=1, frames=rows)
            if stop.is_set():
                return

    task = asyncio.create_task(native())
    await asyncio.sleep(0.5)
    t0 = time.perf_counter()
    answers = await asyncio.gather(*(stream_one(client, tokens) for _ in range(chats)))
    wall = time.perf_counter() - t0
    stop.set()
    await task
    used = sum(a["tokens"] for a in answers)
    return {"tokens": used, "wall_s": wall, "tokens_per_s": used / wall,
            "frame_latency_ms": [r["latency_ms"] for r in rows], "frame_rtt_ms": [r["rtt_ms"] for r in rows],
            "frames_late": sum(r["late"] for r in rows), "frames": len(rows)}


def engine_ticks(server, rounds: int, rows: int) -> dict:
    """The engine alone (no HTTP): ms per tick of `rows` sessions each asking tau answer tokens (a prompt chunk of
    8 tokens), fused against host-driven, in interleaved rounds; the two decode the same tokens (checked)."""
    engine = server.context.worker.engine
    tau, T = engine.config.max_answer_tokens, engine.config.chunk_tokens
    rng = np.random.default_rng(0)
    from omnijax.chunks.chunk import text_chunk

    server.wait_idle()
    sids = [f"bench-{i}" for i in range(rows)]
    outputs, first_ms = {}, []

    def tick(per_token: bool):
        def go():
            for i, sid in enumerate(sids):
                engine.submit(sid, text_chunk(rng.integers(0, 200, T), unit=i), tau)
            seen = []

            def on_token(sid, token, entry):  # the moment the tick's first token is handed over
                if not seen:
                    seen.append(time.perf_counter())
                return False

            start = time.perf_counter()
            report = engine.tick(per_token=per_token, on_token=on_token)
            outputs[per_token] = sum(len(o.tokens) for o in report.outputs.values())
            if per_token:
                first_ms.append(1e3 * (seen[0] - start))
        return go

    # the worker's loop is idle (no session open): the engine is driven from this thread between its ticks
    for sid in sids:
        engine.open(sid)
    try:
        ms = harness.interleaved({"per_tick": tick(False), "per_token": tick(True)}, rounds)
    finally:
        for sid in sids:
            engine.close(sid)
    return {"rows": rows, "tau": tau, "per_tick_ms": list(ms["per_tick"]), "per_token_ms": list(ms["per_token"]),
            "first_token_ms": first_ms[-rounds:],
            "ratio": harness.same_round_ratio(ms["per_token"], ms["per_tick"]),
            "tokens_per_tick": {"per_tick": outputs[False], "per_token": outputs[True]}}


def run(args) -> dict:
    import openai

    samples = {m: {"ttft_ms": [], "gap_ms": [], "tokens_per_s": [], "frame_latency_ms": [], "frame_rtt_ms": [],
                   "frames": 0, "frames_late": 0, "tick_ms": []} for m in MODES}
    shared = harness.smoke_demo_model(args.out) if args.smoke else None  # a check: the smoke run's shared model
    with build_server(args.tau, args.chats + 1, shared) as server:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0)

        async def rounds():
            for r in range(args.rounds + 1):  # round 0 compiles the host-driven programs and is not recorded
                for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                    set_mode(server, mode)
                    worker = server.context.worker
                    mark = len(worker.compute_s)
                    singles = [await stream_one(client, args.tokens) for _ in range(args.singles)]
                    both = await concurrent(server, client, args.chats, args.tokens, args.native_s)
                    if r == 0:
                        continue
                    s = samples[mode]
                    for one in singles:
                        s["ttft_ms"].append(1e3 * one["arrivals"][0])
                        s["gap_ms"] += list(1e3 * np.diff(one["arrivals"]))
                    s["tokens_per_s"].append(both["tokens_per_s"])
                    s["frame_latency_ms"] += both["frame_latency_ms"]
                    s["frame_rtt_ms"] += both["frame_rtt_ms"]
                    s["frames"] += both["frames"]
                    s["frames_late"] += both["frames_late"]
                    s["tick_ms"] += [1e3 * x for x in list(worker.compute_s)[mark:]]

        asyncio.run(rounds())
        ticks = engine_ticks(server, 4 * args.rounds, args.chats)
    summary = {}
    for mode, s in samples.items():
        pct = lambda xs, q: float(np.percentile(xs, q)) if len(xs) else float("nan")  # noqa: E731
        summary[mode] = {"ttft_p50_ms": pct(s["ttft_ms"], 50), "ttft_p99_ms": pct(s["ttft_ms"], 99),
                         "gap_p50_ms": pct(s["gap_ms"], 50), "gap_p99_ms": pct(s["gap_ms"], 99),
                         "tokens_per_s": float(np.median(s["tokens_per_s"])) if s["tokens_per_s"] else float("nan"),
                         "tick_p50_ms": pct(s["tick_ms"], 50),
                         "frame_latency_p50_ms": pct(s["frame_latency_ms"], 50),
                         "frame_latency_p99_ms": pct(s["frame_latency_ms"], 99),
                         "frame_rtt_p50_ms": pct(s["frame_rtt_ms"], 50), "frames": s["frames"],
                         "frames_late": s["frames_late"]}
    summary["engine"] = {"per_tick_p50_ms": float(np.median(ticks["per_tick_ms"])),
                         "per_token_p50_ms": float(np.median(ticks["per_token_ms"])), "ratio": ticks["ratio"],
                         "first_token_p50_ms": float(np.median(ticks["first_token_ms"])),
                         "rows": ticks["rows"], "tau": ticks["tau"]}
    return {"settings": vars(args), "summary": summary, "samples": samples, "engine_ticks": ticks}


def plot(result: dict, out) -> None:
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    s = result["samples"]
    for mode, colour in zip(MODES, ("tab:blue", "tab:orange")):
        gaps = np.sort(s[mode]["gap_ms"])
        axes[0].plot(gaps, np.linspace(0, 1, len(gaps)), label=mode, color=colour)
    axes[0].set(xlabel="gap between streamed chunks (ms)", ylabel="fraction", title="inter-token gaps, one chat")
    axes[0].legend()
    axes[1].boxplot([s[m]["ttft_ms"] for m in MODES], tick_labels=list(MODES))
    axes[1].set(ylabel="ms", title="time to first token, one chat")
    summary = result["summary"]
    axes[2].bar(MODES, [summary[m]["tokens_per_s"] for m in MODES], color=("tab:blue", "tab:orange"))
    axes[2].set(ylabel="tokens / s", title=f"{result['settings']['chats']} concurrent chats + a native session")
    fig.tight_layout()
    harness.save_png(fig, out, "token_streaming")


def main(argv=None) -> None:
    p = harness.parser(__doc__)
    p.add_argument("--rounds", type=int, default=6, help="measured rounds per mode")
    p.add_argument("--tokens", type=int, default=32, help="max_tokens of each chat")
    p.add_argument("--chats", type=int, default=4, help="concurrent chats beside the native session")
    p.add_argument("--tau", type=int, default=8, help="answer tokens per tick (serve's --answer-tokens)")
    p.add_argument("--singles", type=int, default=5, help="chats streamed alone per round and mode")
    p.add_argument("--native-s", type=float, default=2.0, help="shortest native session beside the chats (s)")
    args = harness.parse(p, argv, smoke={"rounds": 1, "tokens": 8, "chats": 1, "singles": 1, "native_s": 0.75})
    out = harness.output_dir(args)
    result = run(args)
    harness.write_json(out, "token_streaming", result)
    plot(result, out)
    rows = [{"mode": m, **result["summary"][m]} for m in MODES]
    e = result["summary"]["engine"]
    print(f"engine alone, {e['rows']} rows x tau {e['tau']}: per tick {e['per_tick_p50_ms']:.1f} ms, per token "
          f"{e['per_token_p50_ms']:.1f} ms (same-round ratio {e['ratio']:.2f}), its first token handed over after "
          f"{e['first_token_p50_ms']:.1f} ms")
    harness.print_table(rows, [("mode", "mode", "s"), ("ttft p50", "ttft_p50_ms", ".0f"),
                               ("ttft p99", "ttft_p99_ms", ".0f"), ("gap p50", "gap_p50_ms", ".1f"),
                               ("gap p99", "gap_p99_ms", ".1f"), ("tok/s", "tokens_per_s", ".1f"),
                               ("tick p50", "tick_p50_ms", ".1f"), ("frame p50", "frame_latency_p50_ms", ".0f"),
                               ("frame p99", "frame_latency_p99_ms", ".0f"), ("late", "frames_late", "d")])


if __name__ == "__main__":
    main()
