"""Qwen3-Omni-30B-A3B thinker on one GPU: a memory plan from the real parameter trees, and the cost of one MoE
feed-forward (grouped matmul) against a dense MLP of the same active size and the all-experts einsum.

1. Memory plan (pure arithmetic, nothing timed, no real arrays): the decoder
   (`omnijax.models.config.QWEN3_OMNI_30B_A3B`: 48 layers, hidden 2048, 32 q / 4 KV heads of 128, 128 experts of width
   768, top 8, vocab 152,064), the vision
   encoder (`QWEN3_OMNI_30B_A3B_VISION`) and the audio encoder (`QWEN3_OMNI_30B_A3B_AUDIO`) are built abstractly
   (`nnx.eval_shape`) in bfloat16 and their parameter leaves summed. Active parameters per token: everything of the
   decoder but the experts, plus top_k / num_experts of them (attention, norms, router, embedding, lm head; the
   encoders run per media input, not per token, and are listed apart). KV bytes per token: layers * KV heads *
   head_dim * 2 (K, V) * 2 B. A page's bytes are taken from the abstract KV pool (`omnijax.kv.paged.init`): its K/V
   plus the per-slot metadata (position, order, unit, span, offset, score, valid: 30 B per slot); a session's fixed
   bytes (its last logits, float32 [vocab], page-table row, key) from the abstract `omnijax.init_state` too.
   On a GPU of `--gpu-gb` (default 141, decimal GB: an H200's nominal HBM; a live H200 reports somewhat more, so this
   is the conservative side) the pool gets what is left after the weights of all three parts and a fixed
   `--reserve-gb` (default 6 GB) for the CUDA context, library workspaces, XLA's temporaries of one prefill chunk
   (at 2048 wide these are tens of MB per layer; the logits row is 0.6 MB) and allocator fragmentation: a round
   margin of about 4 % of the card, not a measurement. Pages of `--page-size` slots (64) that fit, and sessions:
   - OmniPick at its defaults (`omnijax.retention.OmniPick()`): the bound is its `high_watermark` (2,500 retained
     cells; the trigger: a trim brings retained cells back to at most this, down towards `low_watermark`, 1,800,
     which is a target, not a bound). Between trims the cache holds the high watermark, the answer tokens asked after
     the trim (`--answer-tokens`, default 64) and the next chunk written before its own trim (`--chunk-seconds` of
     media, default 1 s), rounded up to whole pages as if the survivors were packed (eager / ordered_suffix; the
     native layout keeps holes and may hold a few pages more, see `kv_layout.py`);
   - unbounded sessions (no eviction) of `--minutes` (10 / 30 / 60) of audio + video.
   Token rates: audio from `audio_token_count` (100 mel frames per second, 13 tokens per 1 s chunk: the reference's
   formula, which gives 13 /s where Qwen's papers say 12.5 Hz); video at `--fps` (2) frames per second, temporal
   patch 2 -> one grid step per second, each frame of `--resolution` (default 448x252, a 16:9 stream at low
   resolution) rounded to multiples of patch 16 * merge 2 = 32 px (`smart_resize` with no pixel bounds:
   448x256 -> 28x16 patches -> 112 tokens per grid step). Markup tokens (one bos / eos pair per stream) are left
   out.

2. MoE layer time on this machine: `omnijax.models.moe.moe_ffn` (router, top-k, gate / up / down as a grouped
   matmul over the tokens' expert groups) in both implementations, `impl="blocked"` (the CPU default: blocks of
   rows of one expert in a loop over the non-empty blocks) and `impl="ragged_dot"` (`jax.lax.ragged_dot`, the
   GPU/TPU default), against (a) the decoder's dense SwiGLU MLP
   (`omnijax.models.decoder.mlp`) of the same active width, intermediate = top_k * moe_intermediate, and (b)
   `moe_ffn_reference` (every token through every expert, dense einsum), at `--tokens` 1 (a decode step), 16, 128
   and 512 (a prefill chunk) tokens. Sizes default to hidden 512, expert width 192, 128 experts, top 8 (the model's
   expert count and ratio, a quarter of its widths, so the script runs in about two minutes on 2 CPU cores);
   `--full-size` takes the model's 2048 / 768 (for a GPU run, with `--dtype bfloat16`, which XLA:CPU cannot
   run: it has no bfloat16 dot with a float32 result for the einsum). Weights are random, scaled by
   1/sqrt(fan in), float32 by default. Before timing, `moe_ffn` is checked against `moe_ffn_reference` on the same
   inputs in float32 at highest matmul precision (max abs difference <= 1e-4, an assert). Each variant is jitted
   once per shape and warmed up, then timed in `--rounds` interleaved rounds (`harness.interleaved`); a timed call
   repeats the variant `inner` times (per variant, from one call after the warm-up, so a timed call takes about
   20 ms or one call) and reports the mean per call. Ratios are same-round ratios.

   What is compiled: JAX 0.10.2 hands `ragged_dot` to XLA as `chlo.ragged_dot` only on TPU and GPU; on CPU it
   takes the generic rule (`_ragged_dot_general_impl`): the `M = N * top_k` sorted rows are masked into an
   `[E, M, K]` array and multiplied with the weights transposed to `[K * E, out]` in one dense dot, so it computes
   every row against every expert (`top_k` times the reference einsum's work) and copies the weights each call.

Run: `python -m bench.metronome.qwen3_omni_moe [--tokens 1 16 128 512] [--rounds 5] [--hidden 512]
[--moe-intermediate 192] [--experts 128] [--top-k 8] [--full-size] [--dtype float32] [--gpu-gb 141] [--reserve-gb 6]
[--page-size 64] [--resolution 448x252] [--fps 2] [--minutes 10 30 60] [--chunk-seconds 1] [--answer-tokens 64]
[--out bench/out] [--smoke]`
"""

from __future__ import annotations

import contextlib
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import omnijax
from bench import harness
from omnijax.kv import paged as paged_lib
from omnijax.models.config import QWEN3_OMNI_30B_A3B, DecoderConfig
from omnijax.models.decoder import Decoder, mlp
from omnijax.models.encoders.qwen_vl_preprocess import smart_resize
from omnijax.models.moe import moe_ffn, moe_ffn_reference
from omnijax.models.qwen3_omni.audio import QWEN3_OMNI_30B_A3B_AUDIO, Qwen3AudioEncoder, audio_token_count
from omnijax.models.qwen3_omni.vision import QWEN3_OMNI_30B_A3B_VISION, Qwen3VisionEncoder
from omnijax.retention import OmniPick

GB = 1e9
EXPERT_LEAVES = ("expert_gate", "expert_up", "expert_down")
TARGET_MS = 20.0  # the fastest variant's timed call repeats until about this long
CHECK_ATOL = 1e-4


# ------------------------------------------------------------------------------------------------- memory plan


def param_leaves(module) -> dict[str, tuple[tuple[int, ...], int]]:
    """`path -> (shape, bytes)` of an abstract module's parameters."""
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(module, nnx.Param))
    return {jax.tree_util.keystr(path).replace(".value", ""): (tuple(leaf.shape), math.prod(leaf.shape)
                                                               * jnp.dtype(leaf.dtype).itemsize)
            for path, leaf in leaves}


def count(leaves, pick=lambda name: True) -> tuple[int, int]:
    """(parameters, bytes) of the leaves whose path `pick` accepts."""
    chosen = [(math.prod(shape), nbytes) for name, (shape, nbytes) in leaves.items() if pick(name)]
    return sum(n for n, _ in chosen), sum(b for _, b in chosen)


def abstract_bytes(tree) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def video_tokens_per_step(resolution: str, vision) -> tuple[int, tuple[int, int]]:
    """Merged tokens of one video grid step at `resolution` ("WxH") and the resized (height, width)."""
    width, height = (int(v) for v in resolution.lower().split("x"))
    factor = vision.patch_size * vision.spatial_merge_size
    h, w = smart_resize(height, width, factor=factor, min_pixels=factor * factor, max_pixels=1 << 62)
    return (h // vision.patch_size) * (w // vision.patch_size) // vision.merge_unit, (h, w)


def memory_plan(args) -> dict:
    c = QWEN3_OMNI_30B_A3B.replace(dtype="bfloat16")
    vision = QWEN3_OMNI_30B_A3B_VISION.replace(dtype="bfloat16")
    audio = QWEN3_OMNI_30B_A3B_AUDIO.replace(dtype="bfloat16")
    start = time.perf_counter()
    decoder = param_leaves(nnx.eval_shape(lambda: Decoder(c)))
    vision_leaves = param_leaves(nnx.eval_shape(lambda: Qwen3VisionEncoder(vision)))
    audio_leaves = param_leaves(nnx.eval_shape(lambda: Qwen3AudioEncoder(audio)))
    print(f"memory plan: abstract parameter trees built in {time.perf_counter() - start:.1f} s", flush=True)

    def is_expert(name):
        return any(f"'{e}'" in name for e in EXPERT_LEAVES)

    def is_embedding(name):
        return "'embed'" in name or "'lm_head'" in name

    expert_n, expert_b = count(decoder, is_expert)
    embed_n, embed_b = count(decoder, is_embedding)
    router_n, router_b = count(decoder, lambda n: "'router'" in n)
    rest_n, rest_b = count(decoder, lambda n: not (is_expert(n) or is_embedding(n) or "'router'" in n))
    decoder_n, decoder_b = count(decoder)
    share = c.num_experts_per_tok / c.num_experts
    active_n = decoder_n - expert_n + round(expert_n * share)
    components = [
        {"part": "decoder: attention + norms", "params": rest_n, "bytes": rest_b, "active": rest_n},
        {"part": "decoder: router", "params": router_n, "bytes": router_b, "active": router_n},
        {"part": f"decoder: experts ({c.num_experts_per_tok} of {c.num_experts} active)", "params": expert_n,
         "bytes": expert_b, "active": round(expert_n * share)},
        {"part": "decoder: embedding + lm head", "params": embed_n, "bytes": embed_b, "active": embed_n},
        {"part": "decoder (thinker LLM)", "params": decoder_n, "bytes": decoder_b, "active": active_n},
        {"part": "vision encoder", "params": count(vision_leaves)[0], "bytes": count(vision_leaves)[1],
         "active": None},
        {"part": "audio encoder", "params": count(audio_leaves)[0], "bytes": count(audio_leaves)[1], "active": None},
    ]
    weights_n = decoder_n + components[-2]["params"] + components[-1]["params"]
    weights_b = decoder_b + components[-2]["bytes"] + components[-1]["bytes"]
    components.append({"part": "total (decoder + encoders)", "params": weights_n, "bytes": weights_b,
                       "active": None})

    # KV: per token, per page (K/V + slot metadata of the pool), per session (its rows outside the pool)
    P = args.page_size
    kv_token = c.num_layers * c.num_kv_heads * c.head_dim * 2 * jnp.dtype(c.jnp_dtype).itemsize

    def pool(pages, batch=1, max_pages=8):
        return jax.eval_shape(lambda: omnijax.init_state(c, num_pages=pages, page_size=P, batch=batch,
                                                         max_pages=max_pages))

    page_b = abstract_bytes(pool(2)) - abstract_bytes(pool(1))
    session_b = abstract_bytes(pool(1, batch=2)) - abstract_bytes(pool(1))  # + 4 B per page-table entry
    kv_only = abstract_bytes(jax.eval_shape(lambda: paged_lib.init(
        num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, num_pages=1, page_size=P,
        dtype=c.jnp_dtype)).k) * 2
    assert kv_only == kv_token * P, (kv_only, kv_token * P)

    capacity = args.gpu_gb * GB
    free = capacity - weights_b - args.reserve_gb * GB
    pages_fit = int(free // page_b) if free > 0 else 0

    # token rates
    audio_per_s = audio_token_count(100) / 1.0  # one second = 100 mel frames
    per_step, resized = video_tokens_per_step(args.resolution, vision)
    steps_per_s = args.fps / vision.temporal_patch_size
    video_per_s = per_step * steps_per_s
    chunk_tokens = math.ceil(args.chunk_seconds * (audio_per_s + video_per_s))
    policy = OmniPick()
    scenarios = [("OmniPick default window", policy.high_watermark + args.answer_tokens + chunk_tokens, None)]
    for minutes in args.minutes:
        seconds = 60 * minutes
        tokens = audio_token_count(100 * seconds) + math.ceil(seconds * steps_per_s) * per_step
        scenarios.append((f"unbounded, {minutes:g} min", tokens, minutes))
    sessions = []
    for name, tokens, minutes in scenarios:
        pages = -(-tokens // P)
        per_session = pages * page_b + session_b + 4 * pages  # its page-table entries
        sessions.append({"session": name, "minutes": minutes, "tokens": int(tokens), "pages": int(pages),
                         "gb_per_session": per_session / GB,
                         "sessions_fit": int(free // per_session) if free > 0 else 0})
    return {
        "dtype": "bfloat16", "decoder_config": c.to_json(), "vision_config": vision.to_json(),
        "audio_config": audio.to_json(), "components": components,
        "kv_bytes_per_token": kv_token, "page_size": P, "page_bytes": page_b, "page_kv_bytes": kv_token * P,
        "session_fixed_bytes": session_b,
        "gpu_gb": args.gpu_gb, "reserve_gb": args.reserve_gb, "weights_gb": weights_b / GB, "free_gb": free / GB,
        "pages_fit": pages_fit, "slots_fit": pages_fit * P,
        "omnipick": {"field": "high_watermark", "high_watermark": policy.high_watermark,
                     "low_watermark": policy.low_watermark, "answer_tokens": args.answer_tokens,
                     "chunk_seconds": args.chunk_seconds, "chunk_tokens": chunk_tokens},
        "rates": {"audio_tokens_per_s": audio_per_s, "video_tokens_per_s": video_per_s,
                  "video_tokens_per_grid_step": per_step, "grid_steps_per_s": steps_per_s, "fps": args.fps,
                  "resolution": args.resolution, "resized_hw": list(resized)},
        "sessions": sessions,
    }


def print_plan(plan) -> None:
    print("\nparameters (bfloat16, from the abstract parameter trees)")
    harness.print_table(plan["components"], [
        ("part".ljust(44), lambda r: f"{r['part']:<44}", ""), ("params (B)", lambda r: r["params"] / 1e9, ".3f"),
        ("GB", lambda r: r["bytes"] / GB, ".2f"),
        ("active/token (B)", lambda r: None if r["active"] is None else r["active"] / 1e9, ".3f")])
    r, o = plan["rates"], plan["omnipick"]
    print(f"\nKV: {plan['kv_bytes_per_token']:,} B per token; a {plan['page_size']}-slot page "
          f"{plan['page_bytes']:,} B ({plan['page_kv_bytes']:,} B K/V + slot metadata); "
          f"{plan['session_fixed_bytes']:,} B fixed per session")
    print(f"GPU {plan['gpu_gb']:g} GB - weights {plan['weights_gb']:.2f} GB - reserve {plan['reserve_gb']:g} GB = "
          f"{plan['free_gb']:.2f} GB for the pool: {plan['pages_fit']:,} pages ({plan['slots_fit']:,} tokens)")
    print(f"rates: audio {r['audio_tokens_per_s']:g} tokens/s; video {r['resolution']} -> "
          f"{r['resized_hw'][1]}x{r['resized_hw'][0]} px, {r['video_tokens_per_grid_step']} tokens per grid step, "
          f"{r['grid_steps_per_s']:g} step/s at {r['fps']:g} fps = {r['video_tokens_per_s']:g} tokens/s")
    print(f"OmniPick(): high_watermark {o['high_watermark']} + answer {o['answer_tokens']} + one "
          f"{o['chunk_seconds']:g} s chunk {o['chunk_tokens']} tokens between trims")
    harness.print_table(plan["sessions"], [
        ("session".ljust(24), lambda r: f"{r['session']:<24}", ""), ("tokens", "tokens", ","), ("pages", "pages", ","),
        ("GB/session", "gb_per_session", ".3f"), ("sessions fit", "sessions_fit", ",")])


# ---------------------------------------------------------------------------------------------- MoE layer time


def moe_weights(D, I, E, k, dtype, seed=0) -> dict:
    rng = np.random.default_rng(seed)

    def normal(shape, fan_in):
        return jnp.asarray(rng.standard_normal(shape, np.float32) / np.sqrt(fan_in), dtype)

    return {"router": normal((D, E), D), "gate": normal((E, D, I), D), "up": normal((E, D, I), D),
            "down": normal((E, I, D), I), "gate_proj": normal((D, k * I), D), "up_proj": normal((D, k * I), D),
            "down_proj": normal((k * I, D), k * I)}


def variants(D, I, E, k, dtype_name):
    dense_config = DecoderConfig(vocab_size=8, hidden_size=D, intermediate_size=k * I, num_layers=1, num_heads=1,
                                 num_kv_heads=1, head_dim=2, dtype=dtype_name)
    moe_kw = dict(top_k=k, norm_topk_prob=True)
    experts = ("router", "gate", "up", "down")

    @jax.jit
    def blocked(w, x):
        return moe_ffn(x, *(w[n] for n in experts), **moe_kw, impl="blocked")

    @jax.jit
    def ragged(w, x):
        return moe_ffn(x, *(w[n] for n in experts), **moe_kw, impl="ragged_dot")

    @jax.jit
    def dense(w, x):
        p = {n: w[n] for n in ("gate_proj", "up_proj", "down_proj")}
        return mlp(dense_config, p, x[None])[0]

    @jax.jit
    def reference(w, x):
        return moe_ffn_reference(x, *(w[n] for n in experts), **moe_kw)

    return {"moe_ffn (blocked)": blocked, "moe_ffn (ragged_dot)": ragged, "dense active MLP": dense,
            "moe_ffn_reference (einsum)": reference}


KEYS = ("blocked", "ragged", "dense", "reference")  # row keys of the variants, in their order


def check(fns, w, x) -> tuple[float, bool]:
    """max |moe_ffn - moe_ffn_reference| over both implementations, in float32 at highest matmul precision on these
    inputs, and whether the check ran the timed programs themselves (float32 on CPU, full precision already)."""
    w32 = jax.tree.map(lambda a: a.astype(jnp.float32), w)
    same = w["router"].dtype == jnp.float32 and jax.default_backend() == "cpu"
    with contextlib.nullcontext() if same else jax.default_matmul_precision("highest"):
        want = fns["moe_ffn_reference (einsum)"](w32, x.astype(jnp.float32))
        diff = max(float(jnp.max(jnp.abs(fns[name](w32, x.astype(jnp.float32)) - want)))
                   for name in ("moe_ffn (blocked)", "moe_ffn (ragged_dot)"))
    assert diff <= CHECK_ATOL, f"moe_ffn differs from moe_ffn_reference by {diff:.3g} > {CHECK_ATOL}"
    return diff, same


def time_moe(args) -> dict:
    D, I, E, k = args.hidden, args.moe_intermediate, args.experts, args.top_k
    dtype = jnp.dtype(args.dtype)
    w = moe_weights(D, I, E, k, dtype)
    fns = variants(D, I, E, k, args.dtype)
    names = list(fns)
    rng = np.random.default_rng(1)
    rows = []
    for n in args.tokens:
        x = jnp.asarray(rng.standard_normal((n, D), np.float32), dtype)
        diff, warm = check(fns, w, x)
        inner = {}
        for name, fn in fns.items():
            if not (warm and name != "dense active MLP"):
                harness.block(fn(w, x))  # compile + warm (the check ran the other two)
            start = time.perf_counter()
            harness.block(fn(w, x))
            inner[name] = max(1, min(1000, math.ceil(TARGET_MS / max(1e3 * (time.perf_counter() - start), 1e-3))))

        def case(fn, inner, x=x):
            def run():
                for _ in range(inner):
                    out = harness.block(fn(w, x))
                return out
            return harness.Case(run)

        ms = harness.interleaved({name: case(fns[name], inner[name]) for name in names}, args.rounds, warmup=0,
                                 label=f"moe {n} tokens")
        per_call = {name: ms[name] / inner[name] for name in names}
        blocked, ragged, dense, ref = (per_call[name] for name in names)
        row = {"tokens": n, "inner": [inner[name] for name in names], "check_max_abs_diff": diff,
               **{f"{key}_ms": harness.stats(per_call[name]) for key, name in zip(KEYS, names)},
               "blocked_over_dense": harness.same_round_ratio(blocked, dense),
               "blocked_over_reference": harness.same_round_ratio(blocked, ref),
               "ragged_over_reference": harness.same_round_ratio(ragged, ref),
               "reference_over_dense": harness.same_round_ratio(ref, dense)}
        rows.append(row)
        print(f"  {n} tokens: " + ", ".join(f"{key} {row[key + '_ms']['median']:.3f} ms" for key in KEYS)
              + f" (check {diff:.2g})", flush=True)
    return {"hidden": D, "moe_intermediate": I, "experts": E, "top_k": k, "dense_intermediate": k * I,
            "dtype": args.dtype, "rounds": args.rounds, "backend": jax.default_backend(),
            "device": str(jax.devices()[0].device_kind), "variants": names, "rows": rows}


def print_moe(moe) -> None:
    print(f"\nMoE feed-forward, hidden {moe['hidden']}, {moe['experts']} experts of {moe['moe_intermediate']}, "
          f"top {moe['top_k']} (dense active MLP {moe['dense_intermediate']}), {moe['dtype']}, {moe['backend']} "
          f"({moe['device']}), medians of {moe['rounds']} rounds, ms per call")
    harness.print_table(moe["rows"], [
        ("tokens", "tokens", "d"), ("blocked ms", lambda r: r["blocked_ms"]["median"], ".3f"),
        ("ragged_dot ms", lambda r: r["ragged_ms"]["median"], ".3f"),
        ("dense ms", lambda r: r["dense_ms"]["median"], ".3f"),
        ("reference ms", lambda r: r["reference_ms"]["median"], ".3f"),
        ("blocked/dense", "blocked_over_dense", ".1f"), ("blocked/reference", "blocked_over_reference", ".2f"),
        ("ragged_dot/reference", "ragged_over_reference", ".2f"), ("reference/dense", "reference_over_dense", ".1f"),
        ("blocked p10-p90 ms", lambda r: f"{r['blocked_ms']['p10']:.3f}-{r['blocked_ms']['p90']:.3f}", ""),
        ("check", "check_max_abs_diff", ".1e"), ("inner", lambda r: "/".join(map(str, r["inner"])), "")])


def plot(out, plan, moe) -> None:
    plt = harness.pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    tokens = [r["tokens"] for r in moe["rows"]]
    for key, name, color in zip(KEYS, moe["variants"], ("tab:blue", "tab:purple", "tab:green", "tab:red")):
        med = np.array([r[f"{key}_ms"]["median"] for r in moe["rows"]])
        lo = np.array([r[f"{key}_ms"]["p10"] for r in moe["rows"]])
        hi = np.array([r[f"{key}_ms"]["p90"] for r in moe["rows"]])
        ax.errorbar(tokens, med, yerr=[med - lo, hi - med], marker="o", capsize=3, label=name, color=color)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(tokens, [str(t) for t in tokens])
    ax.minorticks_off()
    ax.set_xlabel("tokens per call")
    ax.set_ylabel("ms per call (median, p10-p90)")
    ax.set_title(f"MoE FFN: D {moe['hidden']}, {moe['experts']}x{moe['moe_intermediate']}, top {moe['top_k']} "
                 f"({moe['backend']}, {moe['dtype']})", fontsize=9)
    ax.legend(fontsize=8)
    names = [s["session"].replace("unbounded, ", "") for s in plan["sessions"]]
    fits = [s["sessions_fit"] for s in plan["sessions"]]
    bars = bx.bar(names, fits, color=["tab:blue"] + ["gray"] * (len(fits) - 1))
    bx.bar_label(bars, labels=[f"{f:,}" for f in fits], fontsize=8)
    bx.set_yscale("symlog", linthresh=1)
    bx.set_ylim(0, 4 * max(fits + [1]))
    bx.set_ylabel("concurrent sessions that fit")
    bx.set_title(f"{plan['gpu_gb']:g} GB GPU, bf16: {plan['free_gb']:.1f} GB for KV after weights "
                 f"{plan['weights_gb']:.1f} GB + reserve {plan['reserve_gb']:g} GB", fontsize=9)
    bx.tick_params(axis="x", labelsize=8)
    harness.save_png(fig, out, "qwen3_omni_moe")


def main(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 512], help="tokens per MoE call")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--moe-intermediate", type=int, default=192, help="one expert's SwiGLU width")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--full-size", action="store_true",
                        help="the model's sizes (hidden, expert width, experts, top-k) instead of the four above")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="of the MoE timing")
    parser.add_argument("--gpu-gb", type=float, default=141.0, help="GPU memory in decimal GB (H200: 141)")
    parser.add_argument("--reserve-gb", type=float, default=6.0,
                        help="activations / workspace / fragmentation reserve in GB")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--resolution", default="448x252", help="video frame WxH before resizing")
    parser.add_argument("--fps", type=float, default=2.0, help="video frames per second")
    parser.add_argument("--minutes", type=float, nargs="+", default=[10, 30, 60], help="unbounded session lengths")
    parser.add_argument("--chunk-seconds", type=float, default=1.0, help="media per chunk (written before a trim)")
    parser.add_argument("--answer-tokens", type=int, default=64, help="answer tokens held between trims")
    args = harness.parse(parser, argv, smoke=dict(tokens=[1, 8], rounds=1, hidden=64, moe_intermediate=32,
                                                  experts=16, top_k=4))
    if args.dtype == "bfloat16" and jax.default_backend() == "cpu":
        parser.error("--dtype bfloat16 needs a GPU: XLA:CPU refuses the all-experts einsum's bfloat16 dot with a "
                     "float32 result (DotThunk: BF16 x BF16 = F32) for more than one token")
    if args.full_size:
        c = QWEN3_OMNI_30B_A3B
        args.hidden, args.moe_intermediate = c.hidden_size, c.moe_intermediate_size
        args.experts, args.top_k = c.num_experts, c.num_experts_per_tok
    out = harness.output_dir(args)

    plan = memory_plan(args)
    print_plan(plan)
    print(f"\nMoE timing: hidden {args.hidden}, {args.experts} experts of {args.moe_intermediate}, top {args.top_k}, "
          f"{args.dtype}, tokens {args.tokens}", flush=True)
    moe = time_moe(args)
    print_moe(moe)
    harness.write_json(out, "qwen3_omni_moe", {"memory_plan": plan, "moe": moe}, indent=2)
    plot(out, plan, moe)


if __name__ == "__main__":
    main()
