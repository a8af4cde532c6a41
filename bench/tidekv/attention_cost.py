"""Where TideKV's prefill attention spends its CPU seconds, against torch's SDPA on the same shapes.

TideKV's layer step attends each 2,048-token chunk to the layer's keys so far with `attention.attend_contiguous`
(blocked online softmax, impl "xla"). This script takes SmolLM2-135M's attention shapes (9 query heads, 3 KV heads,
head_dim 64), random float32 inputs, a prompt of S tokens cut into chunks of 2,048, and measures CPU seconds
(`getrusage`: the figure a loaded machine cannot inflate the way it inflates wall time), in interleaved rounds:

    layer        one layer's attention as the layer step runs it (every chunk), for the default blocks and for
                 `--blocks` (query rows x key slots per block), and split per KV head (one `attend_contiguous` per
                 head group: a third of the score tile per block);
    parts        one block's work alone, each part its own jitted call on a `[G, R*bq, bk]` score tile: the score
                 product (q k^T), the row maximum, the exponential, the row sum, the value product (p v); times the
                 number of blocks a layer runs, this models the layer's attention as products vs softmax passes;
    sdpa         torch's `scaled_dot_product_attention(is_causal=True, enable_gqa=True)` over the whole prompt in a
                 worker process on one thread (torch and JAX never share a process), when torch is installed.

Outputs `attention_cost.json` and a PNG of the layer variants and the parts model. `--smoke`: S = 2,048, one round
(a check that the script runs, not a measurement: the torch worker runs in the script's own process).

    python -m bench.tidekv.attention_cost --lengths 4096 8192 --rounds 3
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource

import numpy as np

from bench import harness

H, G, D = 9, 3, 64  # SmolLM2-135M: query heads, KV heads, head_dim
CHUNK = 2048


def _cpu() -> float:
    return sum(resource.getrusage(resource.RUSAGE_SELF)[:2])


def _cpu_ms(fn, rounds: int) -> dict[str, list[float]]:
    """CPU milliseconds of each `fn[name]()` (one warm-up call each), `rounds` interleaved rounds, order rotated."""
    names = list(fn)
    for name in names:
        harness.block(fn[name]())
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = _cpu()
            harness.block(fn[name]())
            out[name].append(1e3 * (_cpu() - start))
    return out


def blocks_run(S: int, bq: int, bk: int) -> int:
    """Key blocks `attend_contiguous` folds for a prompt of S tokens in chunks of `CHUNK`: per row block, the blocks
    wholly before its first row, then those reaching its last row."""
    total = 0
    for start in range(0, S, CHUNK):
        for first in range(start, start + min(CHUNK, S - start), bq):
            total += -(-min(first + bq, S) // bk)
    return total


def jax_side(S: int, rounds: int, blocks: list[tuple[int, int]]) -> dict:
    import jax
    import jax.numpy as jnp

    from omnijax.kv import attention

    R = H // G
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, S, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, S, G, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, S, G, D)), jnp.float32)

    def per_head(q, k, v, s, bq, bk):
        return jnp.concatenate([attention.attend_contiguous(q[:, :, g * R:(g + 1) * R], k[:, :, g:g + 1],
                                                            v[:, :, g:g + 1], s, block_q=bq, block_k=bk)
                                for g in range(G)], axis=2)

    default = attention.contiguous_blocks(min(CHUNK, S), H, S)
    variants = {f"default {default[0]}x{default[1]}": jax.jit(attention.attend_contiguous)}
    for bq, bk in blocks:
        variants[f"{bq}x{bk}"] = jax.jit(lambda q, k, v, s, bq=bq, bk=bk: attention.attend_contiguous(
            q, k, v, s, block_q=bq, block_k=bk))
    variants[f"per KV head {default[0]}x{default[1]}"] = jax.jit(
        lambda q, k, v, s: per_head(q, k, v, s, default[0], default[1]))

    def layer(f):
        return lambda: [f(q[:, s:s + CHUNK], k, v, jnp.int32(s)) for s in range(0, S, CHUNK)]

    ref = np.concatenate([np.asarray(x) for x in harness.block(layer(variants[next(iter(variants))])())], axis=1)
    diffs = {name: float(np.abs(np.concatenate([np.asarray(x) for x in harness.block(layer(f)())], axis=1)
                                - ref).max()) for name, f in variants.items()}
    layer_ms = _cpu_ms({name: layer(f) for name, f in variants.items()}, rounds)

    bq, bk = default
    n = R * min(bq, S)
    qt = jnp.asarray(rng.standard_normal((G, n, D)), jnp.float32)
    kt = jnp.asarray(rng.standard_normal((G, bk, D)), jnp.float32)
    s = jnp.einsum("gnd,gkd->gnk", qt, kt)
    m = jnp.max(s, axis=-1)
    parts = {"score product": (jax.jit(lambda a, b: jnp.einsum("gnd,gkd->gnk", a, b)), (qt, kt)),
             "row max": (jax.jit(lambda a: jnp.max(a, axis=-1)), (s,)),
             "exp": (jax.jit(lambda a, b: jnp.exp(a - b[..., None])), (s, m)),
             "row sum": (jax.jit(lambda a: jnp.sum(a, axis=-1)), (s,)),
             "value product": (jax.jit(lambda a, b: jnp.einsum("gnk,gkd->gnd", a, b)), (s, kt))}
    reps = 20
    part_ms = _cpu_ms({name: (lambda f=f, a=a: [f(*a) for _ in range(reps)]) for name, (f, a) in parts.items()},
                      rounds)
    count = blocks_run(S, bq, bk)
    per_block = {name: float(np.median(ms)) / reps for name, ms in part_ms.items()}
    flops = 2 * G * n * bk * D
    return {"default_blocks": list(default), "max_abs_diff": diffs,
            "layer_ms": {name: float(np.median(ms)) for name, ms in layer_ms.items()}, "layer_ms_all": layer_ms,
            "blocks_per_layer": count, "part_ms_per_block": per_block,
            "parts_model_ms": {name: ms * count for name, ms in per_block.items()},
            "product_gflops": {name: flops / (per_block[name] * 1e6) for name in ("score product", "value product")}}


def torch_side(S: int, rounds: int) -> dict:
    import torch

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, S, D, generator=g)
    k = torch.randn(1, G, S, D, generator=g)
    v = torch.randn(1, G, S, D, generator=g)
    with torch.inference_mode():
        ms = _cpu_ms({"sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True)}, rounds)
    return {"sdpa_ms": float(np.median(ms["sdpa"])), "sdpa_ms_all": ms["sdpa"]}


def main(argv=None) -> int:
    p = harness.parser(__doc__)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096], help="prompt lengths S")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians are reported)")
    p.add_argument("--blocks", nargs="*", default=["256x128", "512x256", "512x512", "128x128"],
                   help="other (query rows)x(key slots) blocks to time")
    p.add_argument("--worker", choices=("torch",), help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = harness.parse(p, argv, smoke={"lengths": [2048], "rounds": 1, "blocks": ["256x128"]})
    if args.worker:
        print(json.dumps(torch_side(args.length, args.rounds)))
        return 0
    try:
        blocks = [tuple(int(x) for x in b.split("x")) for b in args.blocks]
    except ValueError:
        p.error(f"--blocks takes ROWSxSLOTS pairs such as 512x128, got {args.blocks}")
    if args.rounds < 1 or any(S < 1 or S % CHUNK for S in args.lengths):
        p.error(f"--rounds must be at least 1 and every length a multiple of {CHUNK}, got {args.rounds}, "
                f"{args.lengths}")
    out = harness.output_dir(args)
    rows = []
    for S in args.lengths:
        row = {"length": S, "load_avg": os.getloadavg()[0], **jax_side(S, args.rounds, blocks)}
        if importlib.util.find_spec("torch") is not None:
            # --smoke (a check that measures nothing): the torch worker runs in this process
            done = harness.run_worker(harness.module_command(__spec__.name, "--worker", "torch", "--length", S,
                                                             "--rounds", args.rounds),
                                      inline=args.smoke, timeout=1800, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
            if done.returncode != 0:
                raise SystemExit(f"torch worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
            row.update(json.loads(done.stdout.strip().splitlines()[-1]))
        rows.append(row)
        sdpa = row.get("sdpa_ms")
        print(f"S={S} load {row['load_avg']:.1f}: {row['blocks_per_layer']} blocks per layer; torch SDPA (1 thread) "
              f"{'-' if sdpa is None else f'{sdpa:.0f}'} CPU ms")
        harness.print_table([{"variant": name, "ms": ms, "vs_sdpa": None if sdpa is None else ms / sdpa,
                              "diff": row["max_abs_diff"][name]} for name, ms in row["layer_ms"].items()],
                            [("attention of one layer", "variant", "<28"), ("CPU ms", "ms", ".1f"),
                             ("/ SDPA", "vs_sdpa", ".2f"), ("max |diff|", "diff", ".1e")])
        harness.print_table([{"part": name, "ms": row["part_ms_per_block"][name], "model": ms}
                             for name, ms in row["parts_model_ms"].items()],
                            [("one block's part alone", "part", "<24"), ("CPU ms", "ms", ".3f"),
                             ("x blocks per layer", "model", ".1f")])
    harness.write_json(out, "attention_cost", {"smoke": bool(args.smoke), "rounds": args.rounds,
                                               "heads": [H, G, D], "chunk": CHUNK, "rows": rows})
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    row = rows[-1]
    names = list(row["layer_ms"]) + (["torch SDPA"] if "sdpa_ms" in row else [])
    axes[0].barh(names, list(row["layer_ms"].values()) + ([row["sdpa_ms"]] if "sdpa_ms" in row else []))
    axes[0].invert_yaxis()
    axes[0].set_xlabel("CPU ms, one layer's attention")
    axes[1].barh(list(row["parts_model_ms"]), list(row["parts_model_ms"].values()))
    axes[1].invert_yaxis()
    axes[1].set_xlabel("CPU ms: one block's part alone x blocks per layer")
    fig.suptitle(f"S = {row['length']}, SmolLM2 shapes (9 / 3 heads of 64), chunks of {CHUNK}", fontsize=9)
    harness.save_png(fig, out, "attention_cost")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
