"""Attention cost against active pages at a fixed cache capacity: `impl="reference"` vs `impl="xla"`.

The reference attends densely over every page-table entry, so its cost follows capacity; the XLA implementation
visits only pages holding a live slot, so its cost should follow active pages. Both run side by side on the same
caches, interleaved (one sequence, Qwen2.5-Omni-3B attention shapes: 16 query heads, 2 KV heads, head dim 128),
for a decode step (T = 1) and a
64-token prefill chunk. (`impl="pallas"` runs in interpret mode on CPU, which times the interpreter,
not the kernel; it is left out here.)

Run: `python -m bench.omnitide.attention_impls [--pages 64] [--page-size 64] [--out bench/out] [--smoke]`
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from omnijax.kv import attention

H, G, D = 16, 2, 128


def make_case(rng, pages, page_size, active, T):
    """A one-sequence cache of `pages` table entries, of which `active` (spread evenly) hold live slots."""
    N = pages
    k = jnp.asarray(rng.standard_normal((N, page_size, G, D)).astype(np.float32))
    v = jnp.asarray(rng.standard_normal((N, page_size, G, D)).astype(np.float32))
    live_pages = np.linspace(0, pages - 1, active).round().astype(int)
    valid = np.zeros((N, page_size), bool)
    valid[live_pages] = True
    order = np.arange(N * page_size, dtype=np.int32).reshape(N, page_size)
    view = attention.CacheView(
        write_slots=jnp.full((1, T), -1, jnp.int32), page_table=jnp.asarray(np.arange(pages, dtype=np.int32)[None]),
        slot_valid=jnp.asarray(valid), slot_order=jnp.asarray(order),
        q_order=jnp.full((1, T), N * page_size, jnp.int32))
    q = jnp.asarray(rng.standard_normal((1, T, H, D)).astype(np.float32))
    return q, k, v, view


def main(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    args = harness.parse(parser, argv, smoke=dict(pages=2, page_size=16, repeats=1))
    out = harness.output_dir(args)
    rng = np.random.default_rng(0)
    fns = {impl: jax.jit(lambda q, k, v, c, impl=impl: attention.attend(q, k, v, c, impl=impl))
           for impl in ("reference", "xla")}
    rows = []
    for T in (1, 64):
        for active in sorted({max(1, args.pages // f) for f in (32, 16, 8, 4, 2, 1)}):
            case = make_case(rng, args.pages, args.page_size, active, T)
            ms = harness.interleaved({impl: harness.Case(fn, lambda: case) for impl, fn in fns.items()}, args.repeats)
            ms = {impl: float(np.median(t)) for impl, t in ms.items()}
            got = np.asarray(fns["xla"](*case))
            want = np.asarray(fns["reference"](*case))
            rows.append({"T": T, "active_pages": active, "capacity_pages": args.pages,
                         "reference_ms": ms["reference"], "xla_ms": ms["xla"],
                         "xla_over_reference": ms["xla"] / ms["reference"],
                         "max_abs_diff": float(np.abs(got - want).max())})
    harness.print_table(rows, [("T", "T", "d"), ("active", "active_pages", "d"), ("capacity", "capacity_pages", "d"),
                               ("reference ms", "reference_ms", ".2f"), ("xla ms", "xla_ms", ".2f"),
                               ("xla/ref", "xla_over_reference", ".2f"), ("max diff", "max_abs_diff", ".1e")])
    harness.write_json(out, "attention_impls", rows, indent=2)

    fig, axes = harness.pyplot().subplots(1, 2, figsize=(9, 3.5))
    for ax, T in zip(axes, (1, 64)):
        sel = [r for r in rows if r["T"] == T]
        x = [r["active_pages"] for r in sel]
        ax.plot(x, [r["reference_ms"] for r in sel], "o-", label="reference (dense over capacity)")
        ax.plot(x, [r["xla_ms"] for r in sel], "s-", label="xla (active pages only)")
        ax.set_xlabel(f"active pages (capacity {args.pages} x {args.page_size})")
        ax.set_ylabel("ms")
        ax.set_title("decode (T=1)" if T == 1 else f"prefill chunk (T={T})")
        ax.legend(fontsize=8)
    harness.save_png(fig, out, "attention_impls", dpi=110)


if __name__ == "__main__":
    main()
