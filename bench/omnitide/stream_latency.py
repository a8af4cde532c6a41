"""Per-chunk latency of full-context streaming as the cache grows: step-wise `Session` vs one `lax.scan`.

Full context (NoSlide) makes every chunk attend over everything before it, so per-chunk cost grows with the
session; this is the baseline that retention policies bound. Both paths run the same jitted step in one process,
side by side in interleaved rounds, so the ratio column is robust to machine noise.

Run: `python -m bench.omnitide.stream_latency [--chunks 48] [--chunk-len 64] [--out bench/out] [--smoke]`
"""

from __future__ import annotations

import time

import jax
import numpy as np

import omnijax
from bench import harness
from omnijax.chunks.chunk import stack_chunks, text_chunk
from omnijax.models.config import DecoderConfig
from omnijax.models.decoder import Decoder

BENCH_CONFIG = DecoderConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
                             num_kv_heads=2, head_dim=32, mrope_section=(4, 6, 6))


def main(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument("--chunks", type=int, default=48)
    parser.add_argument("--chunk-len", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = harness.parse(parser, argv, smoke=dict(chunks=3, chunk_len=16, page_size=16, repeats=1))
    out = harness.output_dir(args)

    model = Decoder(BENCH_CONFIG)
    rng = np.random.default_rng(0)
    chunks = [text_chunk(rng.integers(0, BENCH_CONFIG.vocab_size, args.chunk_len), unit=i) for i in range(args.chunks)]
    pages = args.chunks * args.chunk_len // args.page_size + 1
    stacked = stack_chunks(chunks)
    passes = []  # per-chunk step ms of every step-wise pass (the first one compiles)

    def step_wise():
        session, times = omnijax.Session(model, num_pages=pages, page_size=args.page_size), []
        for chunk in chunks:
            start = time.perf_counter()
            jax.block_until_ready(session.feed(chunk).logits)
            times.append(1e3 * (time.perf_counter() - start))
        passes.append(times)

    scan = lambda: omnijax.stream(model, stacked, num_pages=pages, page_size=args.page_size)  # noqa: E731
    ms = harness.interleaved({"session": step_wise, "scan": scan}, args.repeats)  # one warm-up pass each
    result = scan()
    step = np.median(np.asarray(passes[1:]), axis=0)
    scan_per_chunk = float(np.median(ms["scan"])) / args.chunks
    retained = np.asarray(result.stats.layout.retained_cells[:, 0])

    rows = [{"chunk": i, "retained_cells": int(retained[i]), "session_step_ms": float(step[i])}
            for i in range(args.chunks)]
    summary = {"config": BENCH_CONFIG.to_json(), "chunk_len": args.chunk_len, "page_size": args.page_size,
               "scan_ms_per_chunk": scan_per_chunk, "session_ms_per_chunk": float(step.mean()),
               "session_over_scan": float(step.mean() / scan_per_chunk),
               "last_over_first_step": float(step[-1] / step[0]), "rows": rows}
    harness.print_table(rows[:: max(1, args.chunks // 12)], [("chunk", "chunk", "d"),
                                                            ("retained", "retained_cells", "d"),
                                                            ("step ms", "session_step_ms", ".2f")])
    print(f"one lax.scan: {scan_per_chunk:.2f} ms/chunk; Session: {step.mean():.2f} ms/chunk "
          f"(ratio {summary['session_over_scan']:.2f}); last/first chunk step: {summary['last_over_first_step']:.2f}")
    harness.write_json(out, "stream_latency", summary, indent=2)

    fig, ax = harness.pyplot().subplots(figsize=(6, 3.5))
    ax.plot(retained, step, label="Session step (per chunk)")
    ax.axhline(scan_per_chunk, color="gray", linestyle="--", label="one lax.scan (mean per chunk)")
    ax.set_xlabel("retained KV cells after the chunk")
    ax.set_ylabel("ms")
    ax.set_title("Full-context streaming latency (NoSlide, CPU)")
    ax.legend()
    harness.save_png(fig, out, "stream_latency")


if __name__ == "__main__":
    main()
