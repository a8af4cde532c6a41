"""`quantized --capacity` (issue 41 item 4): weight bytes of the Qwen2.5-Omni-7B and Qwen3-Omni-30B-A3B thinkers with
bf16, int8 and int4 linear weights, and the sessions the rest of a 141 GB GPU holds with bf16 or int8 KV.

Arithmetic only: no weights, no model run. Each decoder (`QWEN2_5_OMNI_7B`, `QWEN3_OMNI_30B_A3B`) and its encoders
(7B: `QWEN2_5_OMNI_7B_VISION` + `QWEN2_5_OMNI_7B_AUDIO`; 30B-A3B: `QWEN3_OMNI_30B_A3B_VISION` / `_AUDIO`) are built
abstractly in bfloat16 (`nnx.eval_shape`). A quantised variant replaces what `omnijax convert --quantize` quantises,
the decoder's attention and MLP projections and its expert stacks, by the abstract result of
`omnijax.kernels.quant.quantize` on that leaf (`jax.eval_shape`: codes, float32 scales, float32 offsets for int4);
the embedding, the lm head, norms, biases, the router and both encoders stay bf16 (as a converted checkpoint keeps
them).

Sessions: the pool gets `--gpu-gb` (141) less the weights and a `--reserve-gb` (6) margin, as
`bench.metronome.qwen3_omni_moe` plans it, and each session costs what `bench.metronome.pool_scaling --capacity`
counts for it (pages of 64 holding OmniPick's default window of 2,500 cells or SinkWindow's 16 + 1,024, plus 64
answer tokens and a 125-token chunk written before its trim; K/V plus slot metadata, page-table entries and the
logits row, from the abstract `init_state`), with bf16 or int8 KV. Writes `quantized_capacity.json`.
"""

from __future__ import annotations

import math
from pathlib import Path

from bench import harness

SCHEMES = ("bf16", "int8", "int4_g32", "int4_g64", "int4_g128")
QUANTISED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "expert_gate",
             "expert_up", "expert_down")


def add_args(p) -> None:
    p.add_argument("--capacity", action="store_true",
                   help="weight bytes of 7B / 30B-A3B with quantised weights and sessions per GPU (no model run)")
    p.add_argument("--gpu-gb", type=float, default=141.0, help="--capacity: GPU memory, decimal GB")
    p.add_argument("--reserve-gb", type=float, default=6.0, help="--capacity: kept out of the pool, decimal GB")


def _scheme(name: str):
    from omnijax.kernels.quant import Int4Grouped, Int8PerChannel

    return None if name == "bf16" else Int8PerChannel() if name == "int8" else Int4Grouped(int(name.split("_g")[1]))


def model_bytes(decoder_config, encoders) -> dict[str, dict[str, int]]:
    """Per scheme: the decoder's quantised leaves' bytes, the rest of the decoder's, the encoders' (all bf16)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from omnijax.kernels.quant import quantize
    from omnijax.models.decoder import Decoder

    def nbytes(tree) -> int:
        return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))

    state = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Decoder(decoder_config.replace(dtype="bfloat16"))),
                                       nnx.Param))
    layers = state["layers"]
    chosen = {k: v for k, v in layers.items() if k in QUANTISED}
    rest = nbytes(state) - nbytes(chosen)
    enc = sum(nbytes(nnx.state(nnx.eval_shape(make), nnx.Param)) for make in encoders)
    out = {}
    for name in SCHEMES:
        scheme = _scheme(name)
        if scheme is None:
            q = nbytes(chosen)
        else:
            q = nbytes([jax.eval_shape(lambda w, s=scheme: quantize(w, s), v) for v in chosen.values()])
        out[name] = {"quantised_leaves": q, "decoder_rest": rest, "encoders": enc, "total": q + rest + enc}
    return out


def run(args, out: Path) -> None:
    """The `--capacity` table (module docstring)."""
    from bench.metronome.pool_scaling import capacity
    from omnijax.models.config import QWEN2_5_OMNI_7B, QWEN3_OMNI_30B_A3B
    from omnijax.models.encoders.whisper import QWEN2_5_OMNI_7B_AUDIO, AudioEncoder
    from omnijax.models.qwen2_5_omni.vision import QWEN2_5_OMNI_7B_VISION, VisionEncoder
    from omnijax.models.qwen3_omni.audio import QWEN3_OMNI_30B_A3B_AUDIO, Qwen3AudioEncoder
    from omnijax.models.qwen3_omni.vision import QWEN3_OMNI_30B_A3B_VISION, Qwen3VisionEncoder

    gb = 1e9
    models = {
        "Qwen2.5-Omni-7B": (QWEN2_5_OMNI_7B, [lambda: VisionEncoder(QWEN2_5_OMNI_7B_VISION.replace(dtype="bfloat16")),
                                              lambda: AudioEncoder(QWEN2_5_OMNI_7B_AUDIO.replace(dtype="bfloat16"))]),
        "Qwen3-Omni-30B-A3B": (QWEN3_OMNI_30B_A3B,
                               [lambda: Qwen3VisionEncoder(QWEN3_OMNI_30B_A3B_VISION.replace(dtype="bfloat16")),
                                lambda: Qwen3AudioEncoder(QWEN3_OMNI_30B_A3B_AUDIO.replace(dtype="bfloat16"))]),
    }
    per_session = {(r["model"], r["kv"], r["policy"]): r for r in capacity(args.gpu_gb)}
    rows = []
    for model, (config, encoders) in models.items():
        weights = model_bytes(config, encoders)
        for scheme, b in weights.items():
            pool = args.gpu_gb * gb - b["total"] - args.reserve_gb * gb
            row = dict(model=model, weights=scheme, weights_gb=b["total"] / gb,
                       quantised_gb=b["quantised_leaves"] / gb, rest_gb=(b["decoder_rest"] + b["encoders"]) / gb,
                       pool_gb=pool / gb)
            for kv in ("bf16", "int8"):
                for policy, tag in (("OmniPick()", "omnipick"), ("SinkWindow()", "sinkwindow")):
                    r = per_session[(model, kv, policy)]
                    row[f"{tag}_{kv}"] = int(pool // (r["mb_per_session"] * 1e6)) if pool > 0 else 0
                    row[f"kv_bytes_per_cell_{kv}"] = r["kv_bytes_per_cell"]
            rows.append(row)
    print(f"\nweights and sessions on a {args.gpu_gb:g} GB GPU ({args.reserve_gb:g} GB reserve); quantised: the "
          "decoder's projections and experts (embedding, head, norms, router, encoders bf16)")
    harness.print_table(rows, [("model", "model", ""), ("weights", "weights", ""), ("GB", "weights_gb", ".2f"),
                               ("quantised part GB", "quantised_gb", ".2f"), ("bf16 rest GB", "rest_gb", ".2f"),
                               ("pool GB", "pool_gb", ".1f"), ("OmniPick bf16 KV", "omnipick_bf16", ""),
                               ("OmniPick int8 KV", "omnipick_int8", ""), ("SinkWindow bf16", "sinkwindow_bf16", ""),
                               ("SinkWindow int8", "sinkwindow_int8", "")])
    harness.write_json(out, "quantized_capacity", dict(gpu_gb=args.gpu_gb, reserve_gb=args.reserve_gb, rows=rows))
