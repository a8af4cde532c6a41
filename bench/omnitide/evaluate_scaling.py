"""`omnijax.evaluate` throughput against device count: session chunks per second on 1, 2, 4 and 8 devices.

Each device count runs in its own subprocess (`--worker N`), because the simulated CPU device count
(`XLA_FLAGS=--xla_force_host_platform_device_count=N`) is fixed when JAX starts. The mesh is `N x 1` (sessions
over the data axis, weights replicated) and one program call evaluates every session (`batch_size = --sessions`),
i.e. `--sessions / N` sessions per device.

Sessions (`omnijax.testing.synthetic.qwen_av_session`): a 24-token system prompt, then `--units` Qwen2.5-Omni 2 s
audiovisual units of 124 tokens (70 video + 50 audio + 4 markers) with a 12-token user question after every 4th
unit; ids folded into the model's vocabulary; the log-probabilities of four ids are returned for every chunk (as
the harness scores option letters). Model: `TINY_OMNI` widened to hidden 128 (2 layers, 4 query / 2 KV
heads, head dim 32, mrope), random init, float32, `impl="reference"`, page size 64. Configurations: `full`
(NoSlide, a pool for the whole session) and `omnipick` (OmniPick 1000/700 with `tile_skip` paging, a pool of 1000
cells + one unit).

Timing: per configuration one compile (reported separately), one warm-up call, then the median of `--repeats`
calls, each including the gather of every per-chunk statistic to the host. Throughput = sessions x chunks / time.

Simulated CPU devices share this machine's cores, so no scaling is expected here: the figure checks that the
sharded program runs and what partitioning costs. On a GPU cluster (one device per GPU) the same script measures
the scaling that matters.

Run: `python -m bench.omnitide.evaluate_scaling [--devices 1 2 4 8] [--sessions 16] [--units 24] [--repeats 3]
[--out bench/out] [--smoke]`
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench import harness

# Log-probabilities of four ids at every chunk's last position, as the StreamingBench harness scores option letters.
# Without some model output (scores, logits or answers) XLA would prune the model and time only the layout statistics.
SCORE_IDS = [65, 66, 67, 68]


def worker(args) -> None:
    """Runs in a fresh interpreter with `args.worker` simulated devices; prints one JSON line per configuration."""
    import jax
    import numpy as np
    from flax import nnx

    from omnijax.eval import mesh as distributed
    from omnijax.eval.runner import EvalConfig, evaluate, pad_sessions, session_pages_needed
    from omnijax.models.config import TINY_OMNI
    from omnijax.models.decoder import Decoder
    from omnijax.retention import NoSlide, OmniPick
    from omnijax.testing import synthetic

    assert jax.device_count() == args.worker, (jax.device_count(), args.worker)
    config = TINY_OMNI.replace(hidden_size=128, intermediate_size=256, head_dim=32, mrope_section=(4, 6, 6))
    model = Decoder(config, rngs=nnx.Rngs(0))
    sessions = [synthetic.qwen_av_session(args.units, vocab_size=config.vocab_size, question_every=4, seed=s)
                for s in range(args.sessions)]
    chunks, own = pad_sessions(sessions)
    configs = [EvalConfig("full", policy=NoSlide(), page_size=64, num_pages=session_pages_needed(chunks, 0, 64)),
               EvalConfig("omnipick", policy=OmniPick(high_watermark=1000, low_watermark=700), paging="tile_skip",
                          page_size=64, num_pages=-(-(1000 + 124) // 64) + 1)]
    mesh = distributed.make_mesh(args.worker, 1)
    for cfg in configs:
        run = lambda: evaluate(model, sessions, [cfg], mesh=mesh, batch_size=args.sessions,  # noqa: E731
                               score_ids=SCORE_IDS, progress=False)[cfg.name]
        first = run()
        times = []
        for _ in range(args.repeats):  # each call compiles again (a cache hit in-process is not guaranteed) but
            # `wall_s` times only the program calls and the gather
            result = run()
            times.append(result.wall_s)
        stats = result.sessions[0].stats
        print("ROW " + json.dumps({
            "devices": args.worker, "config": cfg.name, "sessions": args.sessions, "chunks": int(own.max()),
            "tokens_per_session": int(np.asarray(sessions[0].valid).sum()), "compile_s": first.compile_s,
            "wall_s": statistics.median(times), "wall_all_s": times,
            "chunks_per_s": args.sessions * int(own.max()) / statistics.median(times),
            "num_pages": result.num_pages, "max_retained": int(stats["retained_cells"].max()),
            "evicted": int(stats["evicted"].sum()),
            "exhausted": int(sum(bool(s.stats["exhausted"].any()) for s in result.sessions))}), flush=True)


def plot(rows, out: Path) -> None:
    fig, ax = harness.pyplot().subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["config"] for r in rows):
        rs = sorted((r for r in rows if r["config"] == name), key=lambda r: r["devices"])
        devices = [r["devices"] for r in rs]
        line, = ax.plot(devices, [r["chunks_per_s"] for r in rs], "o-", label=name)
        ax.plot(devices, [rs[0]["chunks_per_s"] * d / rs[0]["devices"] for d in devices], ":",
                color=line.get_color(), label=f"{name}: linear from 1 device")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("devices (simulated CPU devices sharing 2 cores)")
    ax.set_ylabel("session chunks / s")
    ax.set_title("omnijax.evaluate: sessions over the data axis")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    harness.save_png(fig, out, "evaluate_scaling")


def main(argv=None) -> int:
    parser = harness.parser(__doc__, out=str(harness.ROOT / "bench" / "out"))
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--units", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = harness.parse(parser, argv, smoke=dict(devices=[2], sessions=2, units=3, repeats=1))
    if args.worker:
        worker(args)
        return 0
    if any(args.sessions % n for n in args.devices):
        parser.error("--sessions must be a multiple of every device count")
    rows = []
    for n in args.devices:
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")
        cmd = harness.module_command(__spec__.name, "--worker", n, "--sessions", args.sessions, "--units", args.units,
                                     "--repeats", args.repeats)
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=harness.ROOT)
        if run.returncode:
            print(run.stderr[-3000:], file=sys.stderr)
            return 1
        rows += [json.loads(line[4:]) for line in run.stdout.splitlines() if line.startswith("ROW ")]
    print(f"{'devices':>7} {'config':>9} {'sessions x chunks':>17} {'compile s':>9} {'wall s':>7} {'chunks/s':>9} "
          f"{'vs 1 dev':>8}")
    for r in rows:
        base = next(b for b in rows if b["config"] == r["config"] and b["devices"] == min(args.devices))
        print(f"{r['devices']:>7} {r['config']:>9} {r['sessions']:>8} x {r['chunks']:<6} {r['compile_s']:>9.1f} "
              f"{r['wall_s']:>7.2f} {r['chunks_per_s']:>9.1f} {r['chunks_per_s'] / base['chunks_per_s']:>8.2f}")
    out = harness.output_dir(args)
    harness.write_json(out, "evaluate_scaling", rows)
    plot(rows, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
