"""The decoder's layer loop, scanned (the default) or unrolled: compile time, time per chunk and per decoded token,
and agreement, side by side in one run.

`Decoder.run_layers` runs its layers as one `lax.scan` over stacked weights, so compile time does not grow with depth.
XLA:GPU slices each layer's weights out of the stacked arrays with a device copy (`bench/omnitide/gpu_census.py`: 7 per
layer, about 0.5 GB per layer of the 7B model in bfloat16), bytes a memory-bound decode step moves on top of the weights
its matrix products read. `run_layers(unroll=True)` slices statically instead (no copy, no loop) and compiles every
layer separately. This script measures both on the backend it runs on:

- phases: a chunk of `--chunk` tokens (prefill) and one token (decode) through `--layers` layers of a preset's
  shapes, over a paged cache already holding `--history` tokens (random keys and values), attention `--impl`; the
  K/V stacks are donated to every call and the next call takes the returned ones, as a session does. The embedding
  and LM head are left out (vocabulary cut to 1,024): only the layer loop differs between the two.
- compile: seconds to lower and compile each program (the whole cost of unrolling on the host).
- timing: `--repeats` rounds after a warm-up, the two loops interleaved in every round; medians, and the median of
  the per-round ratios (unrolled / scanned), since this machine's speed drifts between rounds.
- agreement: the largest difference between the two loops' hidden states, relative to their largest magnitude.

Run (CPU default: 2 layers of the 3B shapes in float32; on a GPU, the 7B shapes in bfloat16 with the Triton kernel):
  python -m bench.omnitide.layer_loop
  python -m bench.omnitide.layer_loop --preset qwen2_5_omni_7b --layers 8 --dtype bfloat16 --impl pallas --history 2048
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import omnijax
from bench import harness
from omnijax.chunks.spans import SpanKind
from omnijax.kv import attention, paged
from omnijax.models.config import PRESETS
from omnijax.streaming.step import init_state

LOOPS = ("scan", "unrolled")


def reserve_view(kv, start: int, length: int, positions_axes: int):
    """Reserves `length` tokens at positions `start...` of sequence 0; `(kv, CacheView, positions [A, 1, T])`."""
    positions = jnp.broadcast_to(jnp.arange(start, start + length, dtype=jnp.int32), (positions_axes, 1, length))
    zeros = jnp.zeros((1, length), jnp.int32)
    meta = paged.SlotMeta(pos=positions, unit=zeros, span=jnp.full((1, length), SpanKind.TEXT, jnp.int32),
                          offset=zeros)
    kv, slots, q_order = paged.reserve(kv, jnp.ones((1, length), bool), meta)
    view = attention.CacheView.of(kv, slots, q_order)
    return kv, view, positions


def build(args):
    """The model's parameters, the history cache and the two phases' inputs."""
    config = PRESETS[args.preset].replace(num_layers=args.layers, dtype=args.dtype, vocab_size=1024)
    graphdef, params = nnx.split(omnijax.Decoder(config, rngs=nnx.Rngs(0)))
    pages = -(-(args.history + args.chunk + 1) // args.page_size) + 1
    kv = init_state(config, num_pages=pages, page_size=args.page_size).kv
    kv, _, _ = reserve_view(kv, 0, args.history, config.position_axes)
    keys = jax.random.split(jax.random.key(1), 3)
    kv = kv.replace(k=jax.random.normal(keys[0], kv.k.shape, kv.k.dtype),
                    v=jax.random.normal(keys[1], kv.v.shape, kv.v.dtype))
    phases = {}
    for phase, length in (("prefill", args.chunk), ("decode", 1)):
        _, view, positions = reserve_view(kv, args.history, length, config.position_axes)
        x = jax.random.normal(keys[2], (1, length, config.hidden_size), config.jnp_dtype)
        phases[phase] = (view, positions, x)
    return config, graphdef, params, kv, phases


def compiled_loop(graphdef, params, kv, view, positions, x, *, impl: str, unroll: bool):
    """`(compiled fn(params, x, k, v) -> (hidden [1, T, D], k, v), compile seconds)`, the stacks donated."""
    def run(params, x, k_pages, v_pages):
        model = nnx.merge(graphdef, params)
        hidden, k_pages, v_pages, _ = model.run_layers(x, positions, view, k_pages, v_pages, impl=impl,
                                                       unroll=unroll)
        return hidden, k_pages, v_pages

    start = time.perf_counter()
    compiled = jax.jit(run, donate_argnums=(2, 3)).lower(params, x, kv.k, kv.v).compile()
    return compiled, time.perf_counter() - start


def measure(args) -> list[dict]:
    config, graphdef, params, kv, phases = build(args)
    rows = []
    for phase, (view, positions, x) in phases.items():
        fns, compile_s, stacks, hidden = {}, {}, {}, {}
        for loop in LOOPS:
            fns[loop], compile_s[loop] = compiled_loop(graphdef, params, kv, view, positions, x, impl=args.impl,
                                                       unroll=loop == "unrolled")
            print(f"  {phase} {loop}: compiled in {compile_s[loop]:.1f} s", flush=True)
            stacks[loop] = (jnp.copy(kv.k), jnp.copy(kv.v))
            out, *stacks[loop] = fns[loop](params, x, *stacks[loop])  # also the warm-up
            hidden[loop] = np.asarray(out, np.float32)
        def call(loop):  # the returned stacks feed the next call (the arguments are donated)
            out, *stacks[loop] = fns[loop](params, x, *stacks[loop])
            return out

        times = harness.interleaved({loop: functools.partial(call, loop) for loop in LOOPS}, args.repeats, warmup=0)
        scale = float(np.abs(hidden["scan"]).max())
        ratios = (times["unrolled"] / times["scan"]).tolist()
        rows.append({"phase": phase, "tokens": int(x.shape[1]),
                     **{f"{loop}_compile_s": compile_s[loop] for loop in LOOPS},
                     **{f"{loop}_ms": float(np.median(times[loop])) for loop in LOOPS},
                     "unrolled_over_scan": float(np.median(ratios)), "ratios": ratios,
                     "max_rel_diff": float(np.abs(hidden["unrolled"] - hidden["scan"]).max()) / max(scale, 1e-30)})
    return rows


def main(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument("--preset", default="qwen2_5_omni_3b", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--impl", default="xla", choices=["reference", "xla", "pallas"])
    parser.add_argument("--history", type=int, default=1024, help="tokens already in the cache")
    parser.add_argument("--chunk", type=int, default=124, help="prefill tokens (one 2 s audiovisual unit)")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = harness.parse(parser, argv, smoke=dict(preset="tiny_omni", layers=2, history=32, chunk=8, page_size=16,
                                                  repeats=1))
    if args.layers < 1 or args.repeats < 1 or args.history < 0 or args.chunk < 1:
        parser.error("--layers, --repeats and --chunk must be positive and --history non-negative")
    start = time.perf_counter()
    device = jax.devices()[0]
    print(f"{args.layers} layers of {args.preset} in {args.dtype}, impl={args.impl}, history {args.history}, "
          f"on {device.device_kind} ({jax.default_backend()})", flush=True)
    rows = measure(args)
    harness.print_table(rows, [("phase", "phase", ""), ("tokens", "tokens", "d"),
                               ("compile s scan", "scan_compile_s", ".1f"), ("unrolled", "unrolled_compile_s", ".1f"),
                               ("ms scan", "scan_ms", ".2f"), ("unrolled", "unrolled_ms", ".2f"),
                               ("unrolled/scan", "unrolled_over_scan", ".2f"), ("max rel diff", "max_rel_diff", ".1e")])
    out = harness.output_dir(args)
    meta = {**vars(args), "device": device.device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
            "runtime_s": time.perf_counter() - start}
    print(f"total runtime {meta['runtime_s']:.0f} s")
    harness.write_json(out, "layer_loop", {"config": meta, "rows": rows})
    plot(rows, meta, out)


def plot(rows, meta, out):
    fig, axes = harness.pyplot().subplots(1, 2, figsize=(9, 3.4))
    width = 0.38
    at = np.arange(len(rows))
    for offset, loop in zip((-width / 2, width / 2), LOOPS):
        axes[0].bar(at + offset, [r[f"{loop}_ms"] for r in rows], width, label=loop)
        axes[1].bar(at + offset, [r[f"{loop}_compile_s"] for r in rows], width, label=loop)
    for ax, label in zip(axes, ("ms per call (median)", "compile s")):
        ax.set_xticks(at, [f"{r['phase']} ({r['tokens']} tok)" for r in rows])
        ax.set_ylabel(label)
    axes[0].legend()
    fig.suptitle(f"{meta['layers']} layers of {meta['preset']}, {meta['dtype']}, impl={meta['impl']} on "
                 f"{meta['device']}", fontsize=10)
    harness.save_png(fig, out, "layer_loop", dpi=110)


if __name__ == "__main__":
    main()
