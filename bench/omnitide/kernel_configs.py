"""Block-sparse attention kernel configurations at the last checkpoint: block_q, num_warps, num_stages, num_splits.

`bench/omnitide/attention_kernel.py --impl pallas` times the Triton kernel with its default configuration (block_q 16, 4
warps, 2 stages, no split). This script times a grid of configurations on the same captured layouts, at the last
checkpoint only (32,884 tokens by default): full context and OmniPick under native, tile_skip and eager, prefill (the
next unit's 124 queries) and decode (one query), Qwen2.5-Omni-7B shapes, `--inner` layers per timed call. It reports,
per phase and layout, the default configuration's time, the fastest configuration and its time, and tile_skip's speedup
over full context with the default configuration and with each side at its fastest.

Grid: prefill varies block_q (16, 32, 64), num_warps (4, 8) and num_stages (1, 2, 3), plus block_q 32 and 64 split
over 2 and 4 programs (124 queries of 7 heads make 14 blocks of 64 rows per kv head: 56 programs for 132 SMs);
decode varies num_splits (1, 2, 4, 8, 16, 32) and num_warps (2, 4). A configuration that does not compile (shared
memory, for instance) is reported as failed and left out. Every case runs once per round, interleaved, after two
warm-up calls; medians over `--repeats` rounds.

Meant for a GPU: on CPU the kernel runs in the Pallas interpreter, which takes minutes per configuration at these
sizes; `--quick` keeps one configuration per axis value there for a check that the script runs.

Run: `python -m bench.omnitide.kernel_configs --layouts .layouts/layouts_32k.pkl [--dtype bfloat16] [--inner 28]
[--unroll] [--repeats 3] [--quick] [--out bench/out] [--smoke]`
(`--smoke`: `--quick`, one layer, no warm-up call beyond the compiling one, one round, on tiny layouts that
`attention_kernel.py --smoke` captures.)
"""

from __future__ import annotations

import itertools
import pickle
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from bench.omnitide.attention_kernel import (
    PAGE,
    UNIT,
    D,
    G,
    H,
    attention_case,
    layered,
    layouts_path,
    pallas_attend,
    timed_rounds,
)

DEFAULT = {"block_q": 16, "num_warps": 4, "num_stages": 2, "num_splits": 1}
LAYOUTS = ("full", "native", "tile_skip", "eager")


def grid(phase: str, quick: bool) -> list[dict]:
    """The configurations timed for a phase (the default first)."""
    if phase == "prefill":
        axes = [(16, 32, 64), (4, 8), (1, 2, 3), (1,)]
    else:
        axes = [(16,), (2, 4), (2,), (1, 2, 4, 8, 16, 32)]
    if quick:
        axes = [(16,), (4,), (2,), (1, 4) if phase == "decode" else (1,)]
    configs = [dict(zip(DEFAULT, values)) for values in itertools.product(*axes)]
    if phase == "prefill" and not quick:  # larger query blocks leave SMs idle (64 rows: 56 programs); split them
        configs += [dict(DEFAULT, block_q=bq, num_splits=k) for bq in (32, 64) for k in (2, 4)]
    return [DEFAULT] + [c for c in configs if c != DEFAULT]


def label(config: dict) -> str:
    return "bq{block_q} w{num_warps} s{num_stages} k{num_splits}".format(**config)


def main(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument("--layouts", default=".layouts/layouts_32k.pkl",
                        help="layouts pickled by bench.omnitide.attention_kernel --save-layouts (--smoke: tiny ones)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--inner", type=int, default=28, help="layers per timed call")
    parser.add_argument("--unroll", action="store_true", help="the --inner calls as straight-line code, not a loop")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="two configurations only (a check that it runs)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up calls per compiled shape before the rounds")
    args = harness.parse(parser, argv, smoke=dict(layouts=None, inner=1, repeats=1, quick=True, warmup=0))
    path = layouts_path(args)
    if not path.exists():
        parser.error(f"{path} not found; write it with: python -m bench.omnitide.attention_kernel --repeats 0 "
                     f"--save-layouts {path}")
    if args.inner < 1 or args.repeats < 1:
        parser.error("--inner and --repeats must be at least 1")
    t_run = time.perf_counter()
    saved = pickle.loads(path.read_bytes())
    layouts = saved["layouts"]
    last = max(r["chunk"] for r in layouts["full"])  # the full-context rows are the checkpoints
    rows = {name: next(r for r in layouts[name] if r["chunk"] == last) for name in LAYOUTS}
    rng = np.random.default_rng(0)
    rand = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32), args.dtype)  # noqa: E731
    qs = {"prefill": rand(1, UNIT, H, D), "decode": rand(1, 1, H, D)}
    pools = {n: rows[n]["valid"].shape[0] for n in LAYOUTS}
    kv_pages = {p: (rand(p, PAGE, G, D), rand(p, PAGE, G, D)) for p in set(pools.values())}

    cases, index, failed = [], {}, []
    for phase, q in qs.items():
        for config in grid(phase, args.quick):
            fn = layered(pallas_attend(**config), args.inner, args.unroll)
            for name in LAYOUTS:
                a = attention_case(rows[name], q, kv_pages[pools[name]])
                try:
                    jax.block_until_ready(fn(*a))  # compiles; a configuration Triton rejects fails here
                except Exception as err:  # noqa: BLE001 - any compile or launch failure rules the configuration out
                    failed.append({"phase": phase, "config": config, "layout": name, "error": str(err)[:300]})
                    print(f"  {phase} {label(config)} {name}: failed ({type(err).__name__})", flush=True)
                    continue
                index[phase, label(config), name] = len(cases)
                cases.append(harness.Case(fn, lambda a=a: a, (phase, label(config), pools[name])))
    print(f"timing {len(cases)} cases per round at chunk {last} ({saved['tokens']} tokens streamed), {args.dtype}, "
          f"{args.inner} layers a call, {jax.devices()[0].device_kind}", flush=True)
    ms = timed_rounds(cases, args.repeats, args.warmup) / args.inner  # [R, cases], per layer
    med = {key: float(np.median(ms[:, i])) for key, i in index.items()}

    results = []
    for phase in qs:
        labels = [label(c) for c in grid(phase, args.quick)]
        entry = {"phase": phase, "default": label(DEFAULT), "ms": {}}
        for name in LAYOUTS:
            timed = {lb: med[phase, lb, name] for lb in labels if (phase, lb, name) in med}
            best = min(timed, key=timed.get)
            entry["ms"][name] = timed
            entry[f"{name}_best"] = best
            print(f"{phase:>7} {name:>9}: default {timed.get(label(DEFAULT), float('nan')):8.3f} ms, fastest "
                  f"{best} {timed[best]:8.3f} ms")
        d, t = label(DEFAULT), entry["ms"]
        if d in t["full"] and d in t["tile_skip"]:
            entry["speedup_default"] = t["full"][d] / t["tile_skip"][d]
        entry["speedup_each_fastest"] = min(t["full"].values()) / min(t["tile_skip"].values())
        best = min((lb for lb in t["tile_skip"] if lb in t["full"]), key=t["tile_skip"].get)
        entry["speedup_same_config_fastest_for_tile_skip"] = t["full"][best] / t["tile_skip"][best]
        print(f"{phase:>7} tile_skip speedup vs full context: default "
              f"{entry.get('speedup_default', float('nan')):.2f}x, each at its fastest "
              f"{entry['speedup_each_fastest']:.2f}x, tile_skip's fastest for both "
              f"{entry['speedup_same_config_fastest_for_tile_skip']:.2f}x (paper 12.72x)")
        results.append(entry)
    out = harness.output_dir(args)
    stem = f"kernel_configs_{jax.default_backend()}_{args.dtype}" + ("_unrolled" if args.unroll else "")
    summary = {"device": jax.devices()[0].device_kind, "dtype": args.dtype, "inner_layers": args.inner,
               "unrolled": args.unroll,
               "chunk": last, "tokens": saved["tokens"], "results": results, "failed": failed,
               "runtime_s": time.perf_counter() - t_run}
    print(f"total runtime {summary['runtime_s']:.0f} s")
    harness.write_json(out, stem, summary)
    plot(results, summary, out, stem)


def plot(results, summary, out, stem):
    fig, axes = harness.pyplot().subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, entry in zip(axes[0], results):
        labels = list(entry["ms"]["tile_skip"])
        x = np.arange(len(labels))
        for i, name in enumerate(LAYOUTS):
            ax.bar(x + (i - 1.5) * 0.2, [entry["ms"][name].get(lb, np.nan) for lb in labels], 0.2, label=name)
        ax.set_yscale("log")
        ax.set_xticks(x, labels, rotation=90, fontsize=7)
        ax.set_ylabel("ms per layer")
        ax.set_title(f"{entry['phase']}: {summary['device']}, {summary['dtype']}")
        ax.legend(fontsize=8)
    harness.save_png(fig, out, stem, dpi=110)


if __name__ == "__main__":
    main()
