"""Per-chunk and per-decoded-token latency, and peak memory, against the size of the KV pool at fixed content.

A bounded session holds the same few thousand cells however large its pool is (a serving engine's pool holds many
sessions), so a step should cost what the chunk and the live pages cost, not what the pool holds. For every pool
size the same session (a prompt of 4 units, then timed chunks) is streamed with `Session.feed`; each checkout
given runs in its own process, one process per (checkout, pool), interleaved, so a library and an older one
(`--compare DIR`, e.g. a `git worktree`) are measured side by side in one run.

Timed: a 124-token chunk without an answer (`chunk ms`) and a 1-token chunk answered with 8 greedy tokens, minus
a 1-token chunk without one, over 8 (`ms / answer token`). Model: 7B attention shapes (28 query heads, 4 kv heads,
head dim 128) on a narrow 4-layer float32 decoder, page size 64, impl="xla"; one page of all layers' K and V is
1 MiB. Peak memory is the process's maximum resident set (of the `Session` part). Then the serving engine on the same
pool: 4 sessions, one 64-token frame each per tick with 2 answer tokens (`tick ms`, median).

`--kv-dtype int8` streams with an int8 KV pool (`StreamConfig.kv_dtype`) in both parts (an older checkout given to
`--compare` must know the setting).

`--capacity` measures nothing and runs no model: it prints KV bytes per cell and the sessions a pool of `--pool-gb`
(default 141 GB, decimal: an H200's whole memory as pool, an upper bound: weights not subtracted) holds, for the
Qwen3-Omni-30B-A3B thinker (48 layers, 4 KV heads of 128) and the Qwen2.5-Omni-7B thinker (28 layers, 4 KV heads of
128), bf16 against int8 KV, at OmniPick's default window (high_watermark 2,500) and SinkWindow's (16 sinks + 1,024),
each plus 64 answer tokens and one 1 s chunk of 2 fps video at 448x252 + audio (125 tokens) written before its trim,
rounded up to pages of 64 slots (as `qwen3_omni_moe` counts). Page and per-session bytes come from the abstract
`omnijax.init_state` (K/V plus slot metadata, page-table entries, logits row).

Run: `python -m bench.metronome.pool_scaling [--pages 64 256 1024 2048] [--compare DIR] [--small] [--kv-dtype int8]
[--capacity [--pool-gb 141]] [--out bench/out] [--smoke]`. Each worker is this module run with `--worker PAGES` in
a fresh process whose working directory is the checkout measured (this repository, or `--compare DIR`; `--smoke`, a
check of this checkout that measures nothing, runs it in the script's own process), so that
checkout's `omnijax` is the one imported.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import time
from pathlib import Path

from bench import harness

UNIT, ANSWER, PROMPT_UNITS = 124, 8, 4


def session_part(model, vocab: int, pages: int, repeats: int, rng, kv_dtype: str = "float") -> dict:
    """The `Session` part of a worker: the prompt, then `repeats` rounds of the timed chunks; the session (and its
    pool) is freed on return, before the engine part allocates its own."""
    import jax
    import numpy as np

    import omnijax
    from omnijax.chunks.chunk import text_chunk

    session = omnijax.Session(model, num_pages=pages, page_size=64, impl="xla", max_answer_tokens=ANSWER,
                              **({"kv_dtype": kv_dtype} if kv_dtype != "float" else {}))
    unit = 0

    def feed(length: int, answer: int = 0) -> float:
        nonlocal unit
        chunk = text_chunk(rng.integers(0, vocab, length).tolist(), unit=unit, answer_tokens=answer)
        unit += 1
        start = time.perf_counter()
        jax.block_until_ready(session.feed(chunk))
        return 1e3 * (time.perf_counter() - start)

    for _ in range(PROMPT_UNITS):
        feed(UNIT)
    feed(1), feed(1, ANSWER)  # compile the shapes timed below
    chunk_ms, plain_ms, answered_ms = [], [], []
    for _ in range(repeats):
        chunk_ms.append(feed(UNIT))
        plain_ms.append(feed(1))
        answered_ms.append(feed(1, ANSWER))
    return {"cells": int(np.asarray(session.state.kv.valid).sum()), "chunk_ms": float(np.median(chunk_ms)),
            "token_ms": float((np.median(answered_ms) - np.median(plain_ms)) / ANSWER),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def worker(pages: int, repeats: int, small: bool = False, kv_dtype: str = "float") -> dict:
    """One (checkout, pool) measurement, in a fresh process of `run_worker` whose `omnijax` is the checkout's.

    Args:
        pages: the pool's pages (64 slots each).
        repeats: timed rounds of each part.
        small: a 1-layer model with 4 query heads of 16 (a quick check) instead of the 7B attention shapes.
        kv_dtype: the pools' `StreamConfig.kv_dtype` ("float" is not passed, so older checkouts run).

    Returns:
        The row: pool pages, retained cells, chunk / answer-token / engine-tick milliseconds and peak RSS.
    """
    import numpy as np
    from flax import nnx

    import omnijax
    from omnijax.chunks.chunk import text_chunk
    from omnijax.models.config import DecoderConfig
    from omnijax.models.decoder import Decoder
    from omnijax.retention import SinkWindow
    from omnijax.serve.engine.engine import Engine, EngineConfig

    config = DecoderConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=28,
                           num_kv_heads=4, head_dim=128, mrope_section=None)
    if small:
        config = config.replace(hidden_size=64, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                                head_dim=16)
    model = Decoder(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    row = {"pages": pages, **session_part(model, config.vocab_size, pages, repeats, rng, kv_dtype)}

    # The serving engine on the same pool: 4 sessions, one 64-token frame each per tick, 2 answer tokens.
    stream = omnijax.StreamConfig(policy=SinkWindow(sink=16, window=512), num_pages=pages, page_size=64,
                                  max_answer_tokens=2, **({"kv_dtype": kv_dtype} if kv_dtype != "float" else {}))
    engine = Engine(model, EngineConfig(stream, max_pages=32, chunk_tokens=64, buckets=(4,)))
    ticks = []
    for name in "abcd":
        engine.open(name)
    for _ in range(2 + 2 * repeats):  # the first ticks compile
        for name in "abcd":
            engine.submit(name, text_chunk(rng.integers(0, config.vocab_size, 64).tolist()), answer_tokens=2)
        ticks.append(1e3 * engine.tick().latency_s)
    return {**row, "tick_ms": float(np.median(ticks[2:]))}


def run_worker(root: Path, pages: int, repeats: int, small: bool = False, kv_dtype: str = "float",
               inline: bool = False) -> dict:
    """Runs `worker` in a fresh `python -m` process started in the checkout `root`, which supplies its `omnijax`
    (`harness.checkout_env`), and returns its row; `inline` (a `--smoke` check of this checkout): in this process
    (`harness.run_worker`)."""
    cmd = harness.module_command(__spec__.name, "--worker", pages, "--repeats", repeats,
                                 *(["--small"] if small else []),
                                 *(["--kv-dtype", kv_dtype] if kv_dtype != "float" else []))
    if inline and Path(root).resolve() != harness.ROOT:
        raise ValueError(f"an inline worker measures this checkout, not {root}")
    done = (harness.run_worker(cmd, inline=True) if inline else
            subprocess.run(cmd, capture_output=True, text=True, env=harness.checkout_env(), cwd=root))
    if done.returncode:
        raise RuntimeError(f"worker for {root} at {pages} pages failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# Decoder shapes of the capacity table: (layers, kv heads, head dim, vocab) of the thinkers.
CAPACITY_MODELS = {"Qwen3-Omni-30B-A3B": (48, 4, 128, 152064), "Qwen2.5-Omni-7B": (28, 4, 128, 152064)}
PAGE, ANSWER_TOKENS, CHUNK_TOKENS, GB = 64, 64, 125, 1e9


def capacity(pool_gb: float) -> list[dict]:
    """Rows of the capacity table (module docstring): bytes per cell and sessions per `pool_gb` GB of pool."""
    import math

    import jax
    import jax.numpy as jnp

    import omnijax
    from omnijax.kv.quant_kv import kv_bytes_per_cell
    from omnijax.models.config import DecoderConfig
    from omnijax.retention import OmniPick, SinkWindow

    def nbytes(tree) -> int:
        return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))

    windows = {"OmniPick()": OmniPick().high_watermark, "SinkWindow()": SinkWindow().sink + SinkWindow().window}
    rows = []
    for name, (L, G, d, vocab) in CAPACITY_MODELS.items():
        c = DecoderConfig(vocab_size=vocab, hidden_size=G * d, intermediate_size=8, num_layers=L, num_heads=G,
                          num_kv_heads=G, head_dim=d, dtype="bfloat16")
        for kv_dtype in ("float", "int8"):
            def state(pages, batch=1, kv_dtype=kv_dtype, c=c):
                return jax.eval_shape(lambda: omnijax.init_state(c, num_pages=pages, page_size=PAGE, batch=batch,
                                                                 max_pages=8, kv_dtype=kv_dtype))
            page_b = nbytes(state(2)) - nbytes(state(1))
            session_b = nbytes(state(1, batch=2)) - nbytes(state(1))
            cell_kv = kv_bytes_per_cell(L, G, d, kv_dtype, 2)
            for policy, window in windows.items():
                pages = -(-(window + ANSWER_TOKENS + CHUNK_TOKENS) // PAGE)
                per_session = pages * page_b + session_b + 4 * pages
                rows.append({"model": name, "kv": "bf16" if kv_dtype == "float" else "int8", "policy": policy,
                             "kv_bytes_per_cell": cell_kv, "page_bytes": page_b, "pages": pages,
                             "mb_per_session": per_session / 1e6, "sessions": int(pool_gb * GB // per_session)})
    return rows


def revision(root: Path) -> str:
    done = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "compare"


def plot(rows: list[dict], out: Path) -> None:
    fig, axes = harness.pyplot().subplots(1, 4, figsize=(18, 4))
    for label in dict.fromkeys(r["library"] for r in rows):
        mine = [r for r in rows if r["library"] == label]
        pages = [r["pages"] for r in mine]
        for ax, key in zip(axes, ("chunk_ms", "token_ms", "tick_ms", "peak_rss_mib")):
            ax.plot(pages, [r[key] for r in mine], marker="o", label=label)
    pages = sorted({r["pages"] for r in rows})
    axes[3].plot(pages, pages, color="gray", linestyle="--", label="the pool's K and V")  # 1 MiB a page
    axes[3].legend()
    for ax, title in zip(axes, ("124-token chunk, ms", "ms per answer token", "engine tick (4 sessions), ms",
                                "peak RSS, MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("pool pages (1 MiB each)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle("Same session content, growing KV pool")
    harness.save_png(fig, out, "pool_scaling")


def main(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument("--pages", type=int, nargs="+", default=[64, 256, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compare", type=Path, help="another checkout to measure beside this one")
    parser.add_argument("--small", action="store_true", help="a 1-layer narrow model (a quick check)")
    parser.add_argument("--kv-dtype", choices=("float", "int8"), default="float", help="KV pool storage")
    parser.add_argument("--capacity", action="store_true", help="print the capacity table only (no timing)")
    parser.add_argument("--pool-gb", type=float, default=141.0, help="pool size of --capacity, decimal GB")
    parser.add_argument("--worker", type=int, metavar="PAGES", help=argparse.SUPPRESS)  # one run_worker process
    args = harness.parse(parser, argv, smoke=dict(pages=[32], repeats=1, small=True))
    out = harness.output_dir(args)
    if args.worker:
        print(json.dumps(worker(args.worker, args.repeats, args.small, args.kv_dtype)))
        return
    if args.capacity:
        rows = capacity(args.pool_gb)
        print(f"\nsessions a {args.pool_gb:g} GB KV pool holds (pages of {PAGE}; window + {ANSWER_TOKENS} answer + "
              f"{CHUNK_TOKENS} chunk tokens)")
        harness.print_table(rows, [("model".ljust(20), lambda r: f"{r['model']:<20}", ""), ("kv", "kv", ""),
                                   ("policy".ljust(13), lambda r: f"{r['policy']:<13}", ""),
                                   ("KV B/cell", "kv_bytes_per_cell", ","), ("page B", "page_bytes", ","),
                                   ("pages", "pages", ","), ("MB/session", "mb_per_session", ".1f"),
                                   ("sessions", "sessions", ",")])
        harness.write_json(out, "pool_capacity", rows)
        return
    libraries = {"this checkout": harness.ROOT}
    if args.compare is not None:
        libraries[f"{revision(args.compare)} ({args.compare.name})"] = args.compare.resolve()

    rows = []
    start = time.perf_counter()
    for pages in args.pages:
        for label, root in libraries.items():
            row = {"library": label, "kv_dtype": args.kv_dtype,
                   **run_worker(root, pages, args.repeats, args.small, args.kv_dtype,
                                inline=args.smoke and root == harness.ROOT)}
            rows.append(row)
            print(f"  {label:>24} {pages:>5} pages: chunk {row['chunk_ms']:8.1f} ms, "
                  f"{row['token_ms']:8.1f} ms/token, tick {row['tick_ms']:8.1f} ms, "
                  f"peak {row['peak_rss_mib']:7.0f} MiB "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)

    base = {r["library"]: r for r in rows if r["pages"] == min(args.pages)}
    keys = ("chunk_ms", "token_ms", "tick_ms")
    print("\n| library | pool pages | cells | chunk ms (x smallest pool) | ms / answer token (x) | engine tick ms (x) "
          "| peak RSS MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        b = base[r["library"]]
        cols = " | ".join(f"{r[k]:.1f} ({r[k] / b[k]:.2f})" for k in keys)
        print(f"| {r['library']} | {r['pages']:,} | {r['cells']:,} | {cols} | {r['peak_rss_mib']:,.0f} |")
    if len(libraries) == 2:
        mine, other = libraries
        print(f"\n{other} / {mine}:\n| pool pages | chunk | answer token | engine tick |")
        print("|---:|---:|---:|---:|")
        for pages in args.pages:
            a, b = (next(r for r in rows if r["library"] == lib and r["pages"] == pages) for lib in (mine, other))
            print(f"| {pages:,} | " + " | ".join(f"{b[k] / a[k]:.1f}x" for k in keys) + " |")
    harness.write_json(out, "pool_scaling", rows)
    plot(rows, out)


if __name__ == "__main__":
    main()
