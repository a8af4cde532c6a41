"""Method A of `bench/tidekv/prefill_memory.py`: compiled memory analysis of each prefill schedule at Qwen2.5-Omni-7B
layer shapes, without execution (see that script's docstring for the phases and what counts as transient).

The process must have set `XLA_FLAGS` (`--xla_cpu_experimental_ynn_fusion_type=`, `--xla_dump_to=<dump_dir>`) before
jax was imported; `bench/tidekv/prefill_memory.py` does.
"""

from __future__ import annotations

import glob
import os
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from bench.tidekv._prefill_memory_common import NARROW, PAGE, GiB, MiB, nbytes
from omnijax.models.config import QWEN2_5_OMNI_7B, DecoderConfig


def weight_structs(cfg: DecoderConfig) -> dict:
    """Stacked layer weights `[L, ...]` as float32 `ShapeDtypeStruct`s (see the docstring for why float32)."""
    from flax import nnx

    from omnijax.models.decoder import Decoder

    abstract = nnx.eval_shape(lambda: Decoder(cfg))
    return {n: jax.ShapeDtypeStruct(v.get_value().shape, jnp.float32) for n, v in vars(abstract.layers).items()
            if isinstance(v, nnx.Param)}


def kv_bytes(layer_cache) -> int:
    return nbytes((layer_cache.k, layer_cache.v))


def stats(compiled) -> dict:
    m = compiled.memory_analysis()
    return {"argument": int(m.argument_size_in_bytes), "output": int(m.output_size_in_bytes),
            "alias": int(m.alias_size_in_bytes), "temp": int(m.temp_size_in_bytes)}


def temp_values(module: str, weight_shapes: set, dump_dir: str) -> dict:
    """From the newest buffer-assignment dump of `module` in `dump_dir`: the largest values of the preallocated temp
    and the total size of weight-slice copies (values whose f32 shape is one layer's weight shape)."""
    files = sorted(glob.glob(os.path.join(dump_dir, f"*{module}*after_optimizations-buffer-assignment.txt")),
                   key=os.path.getmtime)
    if not files:
        return {"largest": [], "weight_slices": 0}
    text = Path(files[-1]).read_text()
    block = re.search(r"^allocation \d+: size \d+, preallocated-temp:\n(.*?)(?=^allocation |\Z)", text, re.S | re.M)
    values = {}
    for name, size, dtype, shape in re.findall(r"value: <\d+ (\S+) @0> \(size=(\d+),offset=\d+\): (\w+)\[([\d,]*)\]",
                                               block.group(1) if block else ""):
        values.setdefault((name, dtype, shape), int(size))
    largest = sorted(values.items(), key=lambda kv: -kv[1])[:8]
    w = sum(size for (name, dtype, shape), size in values.items()
            if dtype == "f32" and tuple(int(s) for s in shape.split(",") if s) in weight_shapes
            and "slice" in name)
    for f in files:
        os.remove(f)
    return {"largest": [f"{dtype}[{shape}] {name}: {size / MiB:.0f} MiB" for (name, dtype, shape), size in largest],
            "weight_slices": int(w)}


def compile_tidekv(cfg, S, *, budget, chunk, selector, weights, dump_dir):
    """TideKV's `layer_step` (chunk < S) or the layer-wise one-shot schedule (chunk = S), compiled for one layer."""
    from omnijax.prefill.layer_major import layer_step, padded_length

    Sp = padded_length(S, chunk, PAGE)
    one = {n: jax.ShapeDtypeStruct(w.shape[1:], w.dtype) for n, w in weights.items()}
    t = time.perf_counter()
    lowered = layer_step.lower(one, jax.ShapeDtypeStruct((1, Sp, cfg.hidden_size), cfg.jnp_dtype),
                               jax.ShapeDtypeStruct((cfg.position_axes, 1, Sp), jnp.int32), config=cfg, prompt_len=S,
                               chunk=chunk, page=PAGE, impl="xla", selector=selector, budget=budget,
                               window=selector.window, room=0)
    st = stats(lowered.compile())
    compile_s = time.perf_counter() - t
    _, cache = lowered.out_info
    weight_arg = nbytes(one)
    x = S * cfg.hidden_size * cfg.jnp_dtype.dtype.itemsize
    step = (st["argument"] - weight_arg) + st["temp"] + (st["output"] - st["alias"] - nbytes(cache))
    wshapes = {tuple(w.shape[1:]) for w in weights.values()}
    return {"stats": st, "weight_args": weight_arg, "x": x, "transient": x + step, "compile_s": compile_s,
            "cache_kv_bytes": cfg.num_layers * kv_bytes(cache), "cache_all_bytes": cfg.num_layers * nbytes(cache),
            "breakdown": {"x (caller's embeddings)": x, "bridge + positions (arguments)": st["argument"] - weight_arg,
                          "layer_step temp": st["temp"]},
            "temp_values": temp_values("layer_step", wshapes, dump_dir)}


def compile_post(cfg, S, *, budget, chunk, selector, weights, dump_dir):
    """Post-prefill SnapKV: `token_major` (chunk=None -> S, one shot) then per-layer selection."""
    from omnijax.prefill.baselines import token_major
    from omnijax.prefill.cache import pack
    from omnijax.prefill.layer_major import padded_length

    C = S if chunk is None else chunk
    Sp = padded_length(S, C, PAGE)
    t = time.perf_counter()
    lowered = token_major.lower(weights, jax.ShapeDtypeStruct((1, Sp, cfg.hidden_size), cfg.jnp_dtype),
                                 jax.ShapeDtypeStruct((cfg.position_axes, 1, Sp), jnp.int32), config=cfg,
                                 prompt_len=S, chunk=C, page=PAGE, impl="xla", window=selector.window)
    st = stats(lowered.compile())
    wshapes = {tuple(w.shape[1:]) for w in weights.values()}
    tv = temp_values("token_major", wshapes, dump_dir)
    hidden, k_all, v_all, q_all = lowered.out_info
    weight_arg = nbytes(weights)
    x = S * cfg.hidden_size * cfg.jnp_dtype.dtype.itemsize
    phase1 = x + (st["argument"] - weight_arg) + st["temp"] + st["output"]

    keys = jax.ShapeDtypeStruct((1, S, cfg.num_kv_heads, cfg.head_dim), cfg.jnp_dtype)
    q_obs = jax.ShapeDtypeStruct((1, selector.window, cfg.num_heads, cfg.head_dim), cfg.jnp_dtype)
    def select_pack(q, k, v):
        return pack(k, v, selector.select(q, k, budget))

    lowered_sel = jax.jit(select_pack).lower(q_obs, keys, keys)
    sel = stats(lowered_sel.compile())
    compile_s = time.perf_counter() - t
    cache = lowered_sel.out_info
    phase2 = (x + (Sp * cfg.hidden_size * cfg.jnp_dtype.dtype.itemsize) + nbytes((hidden, k_all, v_all, q_all))
              + sel["argument"] + sel["temp"])
    transient = max(phase1, phase2)
    return {"stats": st, "select_stats": sel, "weight_args": weight_arg, "x": x, "phase1": phase1, "phase2": phase2,
            "transient_raw": transient, "weight_slices": tv["weight_slices"],
            "transient": max(phase1 - tv["weight_slices"], phase2), "compile_s": compile_s,
            "cache_kv_bytes": cfg.num_layers * kv_bytes(cache), "cache_all_bytes": cfg.num_layers * nbytes(cache),
            "breakdown": {"x (caller's embeddings)": x, "padded x + positions (arguments)": st["argument"] - weight_arg,
                          "hidden (output)": nbytes(hidden), "all layers' K+V (outputs)": nbytes((k_all, v_all)),
                          "window queries (output)": nbytes(q_all), "token_major temp": st["temp"],
                          "of which weight-slice copies": tv["weight_slices"]},
            "temp_values": tv["largest"]}


def nbytes_of(entry: dict, key: str) -> int:
    return int(entry["breakdown"][key])


def method_a(args, dump_dir: str):
    """Every schedule of every `args.seq` compiled at Qwen2.5-Omni-7B shapes; XLA dumps its buffer assignments into
    `dump_dir`. Returns `(config, rows)`."""
    from omnijax.prefill import SnapKV

    cfg = QWEN2_5_OMNI_7B.replace(dtype="bfloat16")
    if getattr(args, "small", False):  # a quick check: the narrow model's shapes, two layers
        cfg = NARROW.replace(dtype="bfloat16", num_layers=2)
    selector = SnapKV(window=args.window)
    weights = weight_structs(cfg)
    rows = []
    for S in args.seq:
        row = {"seq": S}
        row["tidekv"] = compile_tidekv(cfg, S, budget=args.budget, chunk=args.chunk, selector=selector,
                                       weights=weights, dump_dir=dump_dir)
        row["layerwise_oneshot"] = compile_tidekv(cfg, S, budget=args.budget, chunk=S, selector=selector,
                                                  weights=weights, dump_dir=dump_dir)
        row["post_oneshot"] = compile_post(cfg, S, budget=args.budget, chunk=None, selector=selector,
                                           weights=weights, dump_dir=dump_dir)
        row["post_chunked"] = compile_post(cfg, S, budget=args.budget, chunk=args.chunk, selector=selector,
                                           weights=weights, dump_dir=dump_dir)
        t, p, pc = row["tidekv"]["transient"], row["post_oneshot"]["transient"], row["post_chunked"]["transient"]
        row["reduction_vs_oneshot"] = 1 - t / p
        row["reduction_vs_oneshot_raw"] = 1 - t / row["post_oneshot"]["transient_raw"]
        row["reduction_vs_chunked"] = 1 - t / pc
        row["reduction_vs_layerwise_oneshot"] = 1 - t / row["layerwise_oneshot"]["transient"]
        floor = row["post_oneshot"]["x"] + nbytes_of(row["post_oneshot"], "hidden (output)") + nbytes_of(
            row["post_oneshot"], "all layers' K+V (outputs)")
        row["post_floor"] = floor
        row["reduction_vs_post_floor"] = 1 - t / floor
        row["same_cache_bytes"] = (row["tidekv"]["cache_all_bytes"] == row["post_oneshot"]["cache_all_bytes"]
                                   == row["post_chunked"]["cache_all_bytes"]
                                   == row["layerwise_oneshot"]["cache_all_bytes"])
        rows.append(row)
        print(f"  S={S}: post one-shot {p / GiB:.2f} GiB (raw {row['post_oneshot']['transient_raw'] / GiB:.2f}), "
              f"post chunked {pc / GiB:.2f} GiB, TideKV {t / GiB:.3f} GiB -> {100 * row['reduction_vs_oneshot']:.2f}"
              f" % lower (compile {row['post_oneshot']['compile_s']:.0f} + {row['tidekv']['compile_s']:.0f} s)",
              flush=True)
    return cfg, rows
