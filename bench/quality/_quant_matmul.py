"""`quantized --matmul` (issue 41 item 4): CPU time of the quantised matmul against the float32 one, as a ratio.

No model file: one jitted call runs a decoder layer's seven projections (`q, k, v, o, gate, up, down` of SmolLM2's
widths by default: hidden 576, key/value 192, MLP 1536) for `--matmul-layers` layers of random weights, each product
`omnijax.models.layers.linear` (so a float weight takes the decoder's einsum and a quantised one
`omnijax.kernels.quant.qmatmul` with `method="auto"`), on `--matmul-rows` activation rows (1-2: a decode step; 64: a
prefill chunk). Each product's output feeds the next product's input (the decoder's products are mostly sequential
too). The weights are arguments of the call, as the decoder's are, so every call dequantises again (a loop inside
one call would let XLA hoist the dequantisation out of it).

Variants: float32; int8 per channel, int4 g32 and int4 g64, each with `method="grouped"` and `method="dense"`
(what `method="auto"` runs today: `GROUPED_ROWS` is 0). Timed interleaved round by round (each call's wall time and
the process's CPU time around it); each variant is reported as the median of its same-round ratios to float32 at the
same rows. Every variant's output is checked against `qmatmul_reference` (float32, 1e-5 of the output's magnitude)
before timing. Writes `quantized_matmul.json`.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from bench import harness

SCHEMES = ("int8", "int4_g32", "int4_g64")


def add_args(p) -> None:
    p.add_argument("--matmul", action="store_true",
                   help="CPU time of the quantised matmul vs float32 on a layer's projection shapes (no model file)")
    p.add_argument("--matmul-rows", type=int, nargs="+", default=[1, 2, 8, 64], help="--matmul: activation rows")
    p.add_argument("--matmul-layers", type=int, default=6, help="--matmul: layers of 7 projections per timed call")
    p.add_argument("--matmul-widths", type=int, nargs=3, default=[576, 192, 1536], metavar=("HIDDEN", "KV", "MLP"),
                   help="--matmul: the hidden, key/value and MLP widths (SmolLM2-135M's by default)")


def check_args(args) -> None:
    """Refuses non-positive rows, layers or widths by flag."""
    for flag in ("matmul_rows", "matmul_widths"):
        if min(getattr(args, flag)) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.matmul_layers < 1:
        raise SystemExit(f"--matmul-layers must be >= 1, got {args.matmul_layers}")


def _scheme(name: str):
    from omnijax.kernels.quant import Int4Grouped, Int8PerChannel

    return Int8PerChannel() if name == "int8" else Int4Grouped(int(name.split("_g")[1]))


def run(args, out: Path) -> None:
    """The `--matmul` table (module docstring)."""
    import jax
    import jax.numpy as jnp

    from omnijax.kernels import quant
    from omnijax.models.layers import linear

    check_args(args)
    hidden, kv, mlp = args.matmul_widths
    shapes = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden), (hidden, mlp), (hidden, mlp),
              (mlp, hidden)]
    for name in SCHEMES:
        for width in (hidden, mlp):
            if width % _scheme(name).group_size(width):
                raise SystemExit(f"--matmul-widths {args.matmul_widths}: {name}'s group size "
                                 f"{_scheme(name).group_size(width)} does not divide the input width {width}")
    rng = np.random.default_rng(0)
    floats = [[(rng.normal(size=s) * 0.05).astype(np.float32) for s in shapes] for _ in range(args.matmul_layers)]
    weights = {"float32": floats}
    for name in SCHEMES:
        weights[name] = [[quant.quantize(w, _scheme(name)) for w in layer] for layer in floats]

    def program(method):
        def products(x, layers):
            return chain(x, layers, lambda xi, w: quant.qmatmul(xi, w, preferred_element_type=jnp.float32,
                                                                method=method)
                         if isinstance(w, quant.QuantizedWeight) else linear(xi, w))
        return jax.jit(products)

    def chain(x, layers, product):
        # each product feeds the next one's input, as a decoder's layers do (independent products would run at once
        # on XLA:CPU's executor, which a decode step mostly does not); x is as wide as the widest input
        ys = []
        for layer in layers:
            for w in layer:
                y = product(x[..., :w.shape[0]], w)
                ys.append(y)
                x = x + 0.01 * jnp.tile(y, -(-x.shape[-1] // y.shape[-1]))[..., :x.shape[-1]]
        return ys

    def reference(x, layers):
        return chain(x, layers, lambda xi, w: quant.qmatmul_reference(xi, w, preferred_element_type=jnp.float32))

    variants = {"float32": ("float32", "dense")}
    for name in SCHEMES:
        variants[name + " grouped"] = (name, "grouped")
        variants[name + " dense"] = (name, "dense")
    programs = {"grouped": program("grouped"), "dense": program("dense")}
    rows_out = []
    for rows in args.matmul_rows:
        x = jnp.asarray(rng.normal(size=(rows, max(hidden, mlp))).astype(np.float32))
        for label, (name, method) in variants.items():
            if name == "float32":
                continue
            got = programs[method](x, weights[name])
            for a, b in zip(got, reference(x, weights[name])):
                scale = float(jnp.max(jnp.abs(b)))
                if float(jnp.max(jnp.abs(a - b))) > 1e-5 * scale:
                    raise SystemExit(f"--matmul: {label} at {rows} rows differs from qmatmul_reference")
        wall = {k: [] for k in variants}
        cpu = {k: [] for k in variants}

        def timed(label, name, method):
            def fn():
                c0, t0 = time.process_time(), time.perf_counter()
                jax.block_until_ready(programs[method](x, weights[name]))
                wall[label].append(1e3 * (time.perf_counter() - t0))
                cpu[label].append(1e3 * (time.process_time() - c0))
            return fn

        cases = {label: timed(label, *v) for label, v in variants.items()}
        harness.interleaved(cases, args.rounds, label=f"matmul rows={rows}")
        n = args.rounds
        wall = {k: np.asarray(v[-n:]) for k, v in wall.items()}  # the warm-up call is dropped
        cpu = {k: np.asarray(v[-n:]) for k, v in cpu.items()}
        for label, (name, method) in variants.items():
            rows_out.append(dict(rows=rows, variant=label, formulation="einsum" if name == "float32" else method,
                                 wall_ms=float(np.median(wall[label])), cpu_ms=float(np.median(cpu[label])),
                                 wall_ratio=harness.same_round_ratio(wall[label], wall["float32"]),
                                 cpu_ratio=harness.same_round_ratio(cpu[label], cpu["float32"])))
    print(f"\n{args.matmul_layers} layers x 7 projections (widths {hidden} / {kv} / {mlp}) per call, median of "
          f"{args.rounds} interleaved rounds; ratios: same-round median vs float32 at the same rows")
    harness.print_table(rows_out, [("rows", "rows", ""), ("variant", "variant", ""),
                                   ("formulation", "formulation", ""), ("wall ms", "wall_ms", ".2f"),
                                   ("CPU ms", "cpu_ms", ".2f"), ("wall / f32", "wall_ratio", ".2f"),
                                   ("CPU / f32", "cpu_ratio", ".2f")])
    harness.write_json(out, "quantized_matmul", dict(layers=args.matmul_layers, widths=args.matmul_widths,
                                                     rounds=args.rounds, device=str(jax.devices()[0]),
                                                     rows=rows_out))
