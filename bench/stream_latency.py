"""Per-chunk latency of full-context streaming as the cache grows: step-wise `Session` vs one `lax.scan`.

Full context (NoSlide) makes every chunk attend over everything before it, so per-chunk cost grows with the
session; this is the baseline that retention policies bound. Both paths run the same jitted step in one process,
side by side, so the ratio column is robust to machine noise.

Run: `python bench/stream_latency.py [--chunks 48] [--chunk-len 64] [--out bench/out]`
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

import omnijax
from omnijax.chunks import stack_chunks, text_chunk
from omnijax.config import DecoderConfig
from omnijax.models.decoder import Decoder

BENCH_CONFIG = DecoderConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
                             num_kv_heads=2, head_dim=32, mrope_section=(4, 6, 6))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=48)
    parser.add_argument("--chunk-len", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    model = Decoder(BENCH_CONFIG)
    rng = np.random.default_rng(0)
    chunks = [text_chunk(rng.integers(0, BENCH_CONFIG.vocab_size, args.chunk_len), unit=i) for i in range(args.chunks)]
    pages = args.chunks * args.chunk_len // args.page_size + 1

    step_ms = np.full((args.repeats, args.chunks), np.nan)
    for r in range(args.repeats + 1):  # the first pass compiles and is discarded
        session = omnijax.Session(model, num_pages=pages, page_size=args.page_size)
        for i, chunk in enumerate(chunks):
            start = time.perf_counter()
            jax.block_until_ready(session.feed(chunk).logits)
            if r:
                step_ms[r - 1, i] = 1e3 * (time.perf_counter() - start)
    stacked = stack_chunks(chunks)
    scan_ms = []
    for r in range(args.repeats + 1):
        start = time.perf_counter()
        result = omnijax.stream(model, stacked, num_pages=pages, page_size=args.page_size)
        jax.block_until_ready(result.logits)
        if r:
            scan_ms.append(1e3 * (time.perf_counter() - start) / args.chunks)
    step = np.median(step_ms, axis=0)
    scan_per_chunk = float(np.median(scan_ms))
    retained = np.asarray(result.stats.layout.retained_cells[:, 0])

    rows = [{"chunk": i, "retained_cells": int(retained[i]), "session_step_ms": float(step[i])}
            for i in range(args.chunks)]
    summary = {"config": BENCH_CONFIG.to_json(), "chunk_len": args.chunk_len, "page_size": args.page_size,
               "scan_ms_per_chunk": scan_per_chunk, "session_ms_per_chunk": float(step.mean()),
               "session_over_scan": float(step.mean() / scan_per_chunk),
               "last_over_first_step": float(step[-1] / step[0]), "rows": rows}
    print(f"{'chunk':>5} {'retained':>8} {'step ms':>8}")
    for row in rows[:: max(1, args.chunks // 12)]:
        print(f"{row['chunk']:>5} {row['retained_cells']:>8} {row['session_step_ms']:>8.2f}")
    print(f"one lax.scan: {scan_per_chunk:.2f} ms/chunk; Session: {step.mean():.2f} ms/chunk "
          f"(ratio {summary['session_over_scan']:.2f}); last/first chunk step: {summary['last_over_first_step']:.2f}")
    (out / "stream_latency.json").write_text(json.dumps(summary, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(retained, step, label="Session step (per chunk)")
    ax.axhline(scan_per_chunk, color="gray", linestyle="--", label="one lax.scan (mean per chunk)")
    ax.set_xlabel("retained KV cells after the chunk")
    ax.set_ylabel("ms")
    ax.set_title("Full-context streaming latency (NoSlide, CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "stream_latency.png", dpi=120)
    print(f"wrote {out / 'stream_latency.json'} and {out / 'stream_latency.png'}")


if __name__ == "__main__":
    main()
