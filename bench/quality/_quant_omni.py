"""`quantized --omni`: accuracy of quantised weights and the int8 KV pool on a tiny random Qwen3-Omni thinker,
streamed a synthetic audiovisual session (issue 41 item 3, the Qwen3-Omni half of "measured accuracy deltas").

The model: a Qwen3-Omni thinker built with transformers from a small config (4 decoder layers, hidden 256, 8 experts
of which 2 are routed, layer 1 a dense MLP; the AuT audio encoder on 128 mel bins and the vision encoder with two
DeepStack levels), every decoder weight redrawn as N(0, `--omni-scale`), saved in the release's layout and converted
by `omnijax convert` once as float32 and once per quantised variant (`--quantize int8`, `int4 --group-size 32 / 128`:
every attention, dense MLP and expert projection quantised; the embedding, the head and both encoders stay float).
Random weights: the figures measure how far quantisation moves this model's outputs, not a trained model's quality
(SmolLM2's perplexity and pass-key deltas are the `--accuracy` run's).

The session (the same chunks for every variant: the encoders are float, so the media embeddings are computed once):
a 24-token system prompt, then `--omni-units` audiovisual units (2 s of 64x96 synthetic frames at 2 fps and a 2 s
tone each: 12 video and 26 audio tokens), each followed by a 6-token user question. It is streamed twice per
variant and retention policy (`--omni-policies`, bounded ones at `--omni-budget` cells):

- without answers, so every variant is fed exactly the same tokens: the last-position logits after every chunk
  (one per chunk) against float32's: top-1 agreement, KL(float || variant) in nats, the largest logit difference;
  and whether the policy evicted the same number of tokens after every chunk;
- with `--omni-answer` greedy answer tokens after every question: the share of answer tokens equal to float32's at
  the same place, and the answers equal whole (a variant's first different token changes what it feeds itself, so
  later tokens are compared as produced, not forced).

Variants: `int8`, `int4_g32`, `int4_g128` weights with a float KV pool; `int8_kv` float weights with
`StreamConfig(kv_dtype="int8")`; `int4_g32+int8_kv` both (the capacity table's 772-session setting). Writes
`quantized_omni.json`.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from bench import harness

VARIANTS = ("int8", "int4_g32", "int4_g128", "int8_kv", "int4_g32+int8_kv")
POLICIES = ("no_slide", "omnipick", "sink_window")
# the tiny thinker: every decoder input width (256, 512, 128) divides by 128, so int4 g128 applies everywhere
TEXT = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
            mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [12, 10, 10],
                             "interleaved": True})
AUDIO = dict(num_mel_bins=128, d_model=64, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=128,
             output_dim=256, downsample_hidden_size=8, n_window=50, n_window_infer=200)
VISION = dict(depth=2, hidden_size=64, num_heads=2, intermediate_size=128, out_hidden_size=256, patch_size=16,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
# media and chat-marker ids at the top of the tiny vocabulary (the converter reads them from config.json)
IDS = dict(audio_token_id=500, image_token_id=501, video_token_id=502, audio_start_token_id=503,
           audio_end_token_id=504, vision_start_token_id=505, vision_end_token_id=506, im_start_token_id=507,
           im_end_token_id=508, position_id_per_seconds=13)
FRAMES = dict(min_pixels=64 * 96)  # keep the 64x96 frames at their size: 2x3 merged tokens per temporal patch


def add_args(p) -> None:
    p.add_argument("--omni", action="store_true",
                   help="accuracy of quantised weights / int8 KV on a tiny random Qwen3-Omni, AV session")
    p.add_argument("--omni-variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--omni-policies", nargs="+", default=["no_slide", "omnipick"], choices=POLICIES)
    p.add_argument("--omni-units", type=int, default=24, help="--omni: audiovisual units in the session")
    p.add_argument("--omni-budget", type=int, default=256, help="--omni: cells a bounded policy holds")
    p.add_argument("--omni-answer", type=int, default=4, help="--omni: greedy tokens answering each question")
    p.add_argument("--omni-scale", type=float, default=0.1, help="--omni: std of the random decoder weights")
    p.add_argument("--omni-seed", type=int, default=0)


def check_args(args) -> None:
    for flag in ("omni_units", "omni_budget", "omni_answer"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not args.omni_scale > 0:
        raise SystemExit(f"--omni-scale must be > 0, got {args.omni_scale}")


def build_thinker(directory: Path, seed: int, scale: float) -> Path:
    """The tiny random thinker saved with `save_pretrained` into `directory` (module docstring)."""
    import torch
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeThinkerConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen3OmniMoeThinkerConfig(text_config=TEXT, audio_config=AUDIO, vision_config=VISION, **IDS)
    model = Qwen3OmniMoeThinkerForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("model.", "lm_head")):  # the decoder; the encoders keep their own init
                p.normal_(0.0, scale) if p.ndim > 1 else p.add_(torch.randn_like(p) * scale)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def convert(src: Path, work: Path, name: str) -> Path:
    """`src` converted as `name` ("float32" or a weight variant) into `work / name` (reused when there)."""
    from omnijax.convert import QuantizeOptions, convert_checkpoint

    options = {"float32": QuantizeOptions(), "int8": QuantizeOptions("int8"),
               "int4_g32": QuantizeOptions("int4", 32), "int4_g128": QuantizeOptions("int4", 128)}[name]
    dst = work / name
    if not (dst / "omnijax.json").is_file():
        convert_checkpoint(src, dst, progress=False, quantize=options, log=lambda _: None)
    return dst


def session_chunks(model, units: int, answer: int, seed: int):
    """The stacked session (module docstring): system, then `units` x (audiovisual unit, 6-token question)."""
    from omnijax.chunks.chunk import stack_chunks
    from omnijax.models.qwen3_omni import frontend as F

    rng = np.random.default_rng(seed)
    chunks = [F.system(model, rng.integers(0, 480, 24).tolist(), unit=0)]
    for k in range(units):
        frames = F.synthetic_frames(2.0, 2.0, 64, 96, seed=seed, start=2.0 * k)
        pcm = F.tone(2.0, 220.0 + 40.0 * (k % 7), seed=seed + k, start=2.0 * k)
        chunks.append(F.audiovisual_chunk(model, frames, pcm, unit=1 + 2 * k, **FRAMES))
        chunks.append(F.text(model, rng.integers(0, 480, 6).tolist(), unit=2 + 2 * k, answer_tokens=answer))
    return stack_chunks(chunks)


def without_answers(chunks):
    """The same chunks asking for no answer tokens."""
    import dataclasses

    return dataclasses.replace(chunks, answer_tokens=np.zeros_like(np.asarray(chunks.answer_tokens)))


def compare(ref_logits: np.ndarray, logits: np.ndarray) -> dict:
    """Top-1 agreement, KL(ref || other) (nats, float64) and the largest logit difference over `[N, V]` rows."""
    a, b = ref_logits.astype(np.float64), logits.astype(np.float64)

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    la, lb = log_softmax(a), log_softmax(b)
    kl = (np.exp(la) * (la - lb)).sum(-1)
    entropy = -(np.exp(la) * la).sum(-1)
    return dict(positions=len(a), top1=float(np.mean(a.argmax(-1) == b.argmax(-1))), kl_mean=float(kl.mean()),
                kl_max=float(kl.max()), max_abs_logit=float(np.abs(a - b).max()),
                ref_logit_std=float(a.std(-1).mean()), ref_entropy=float(entropy.mean()))


def answers_alike(ref_tokens: np.ndarray, tokens: np.ndarray) -> dict:
    """`[C, tau]` answer tokens (-1: none) against the reference's: equal tokens and whole answers."""
    asked = ref_tokens >= 0
    rows = asked.any(-1)
    return dict(answer_tokens=int(asked.sum()), tokens_equal=float(np.mean((ref_tokens == tokens)[asked])),
                answers=int(rows.sum()), answers_equal=int(np.all(ref_tokens == tokens, -1)[rows].sum()))


def quantized_leaves(model) -> list:
    """Every `QuantizedWeight` the loaded model holds."""
    from flax import nnx

    from omnijax.kernels.quant import QuantizedWeight

    values = [p[...] for _, p in nnx.iter_graph(model.decoder) if isinstance(p, nnx.Param)]
    return [v for v in values if isinstance(v, QuantizedWeight)]


def run(args, out: Path) -> None:
    """`--omni` (module docstring)."""
    check_args(args)
    import omnijax
    from bench.quality._stream import policy_at

    work = Path(args.work) / f"quant-omni-s{args.omni_seed}-{args.omni_scale:g}"
    src = work / "hf"
    if not (src / "config.json").is_file():
        print(f"building the tiny Qwen3-Omni thinker into {src}", flush=True)
        build_thinker(src, args.omni_seed, args.omni_scale)
    weights = sorted({v.split("+")[0] for v in args.omni_variants if v != "int8_kv"} | {"float32"})
    models = {name: omnijax.load(convert(src, work, name)) for name in weights}
    base = models["float32"]
    for name, model in models.items():
        held = quantized_leaves(model)
        if (name != "float32") != bool(held):
            raise SystemExit(f"{name}: expected {'quantised' if name != 'float32' else 'no quantised'} weights, "
                             f"found {len(held)}")
        print(f"  {name}: {len(held)} quantised weights ({sorted({type(q.scheme).__name__ for q in held})})",
              flush=True)
    with_answers = session_chunks(base, args.omni_units, args.omni_answer, args.omni_seed)
    forced = without_answers(with_answers)
    C, _, T = np.asarray(with_answers.token_ids).shape
    fed = int(np.asarray(with_answers.valid).sum())
    print(f"session: {C} chunks, {fed} tokens (padded to {T}), answers of {args.omni_answer} tokens", flush=True)

    def streamed(name: str, policy_name: str, chunks):
        weights_name, _, kv = name.partition("+")
        kv_dtype = "int8" if name == "int8_kv" or kv == "int8_kv" else "float"
        model = models["float32" if name == "int8_kv" else weights_name]
        policy = policy_at(policy_name, args.omni_budget)
        started = time.perf_counter()
        # both streams of a variant share one program: only the chunks' answer_tokens (data) differ
        result = omnijax.stream(model, chunks, policy=policy, page_size=16, max_answer_tokens=args.omni_answer,
                                kv_dtype=kv_dtype)
        logits = np.asarray(result.logits[:, 0])
        tokens = np.asarray(result.tokens[:, 0])
        evicted = np.asarray(result.stats.evicted[:, 0])
        return logits, tokens, evicted, time.perf_counter() - started

    header = dict(model="tiny random Qwen3-Omni thinker", text_config=TEXT, scale=args.omni_scale,
                  seed=args.omni_seed, units=args.omni_units, chunks=C, tokens=fed, answer=args.omni_answer,
                  budget=args.omni_budget, random_weights=True)
    rows, results = [], {}
    for policy_name in args.omni_policies:
        ref_forced = streamed("float32", policy_name, forced)
        ref_answers = streamed("float32", policy_name, with_answers)
        results[policy_name] = {"float32": dict(evicted=int(ref_forced[2].sum()), seconds=ref_forced[3])}
        for name in args.omni_variants:
            got = streamed(name, policy_name, forced)
            answered = streamed(name, policy_name, with_answers)
            row = dict(policy=policy_name, variant=name, **compare(ref_forced[0], got[0]),
                       same_evictions=bool(np.array_equal(ref_forced[2], got[2])), evicted=int(got[2].sum()),
                       **answers_alike(ref_answers[1], answered[1]))
            results[policy_name][name] = dict(row, seconds=got[3] + answered[3])
            rows.append(row)
            print(f"  {policy_name} {name}: top-1 {row['top1']:.3f}, KL {row['kl_mean']:.2e} (max "
                  f"{row['kl_max']:.2e}), |d logit| {row['max_abs_logit']:.3f}, evictions "
                  f"{'same' if row['same_evictions'] else 'DIFFER'}, answers {row['answers_equal']}/{row['answers']}",
                  flush=True)
        harness.write_json(out, "quantized_omni", dict(header, table=rows, results=results))  # each policy's rows
    print(f"\ntiny random Qwen3-Omni thinker, {C} chunks / {fed} tokens, last-position logits per chunk vs float32")
    harness.print_table(rows, [("policy", "policy", ""), ("variant", "variant", ""), ("top-1", "top1", ".3f"),
                               ("KL mean", "kl_mean", ".2e"), ("KL max", "kl_max", ".2e"),
                               ("|d logit|", "max_abs_logit", ".3f"), ("logit std", "ref_logit_std", ".2f"),
                               ("same evict", "same_evictions", ""), ("tokens =", "tokens_equal", ".3f"),
                               ("answers =", "answers_equal", "d"), ("of", "answers", "d")])
    plot(rows, out)


def plot(rows: list[dict], out: Path) -> None:
    """KL(float || variant) per variant and policy (log scale), top-1 agreement annotated."""
    plt = harness.pyplot()
    policies = sorted({r["policy"] for r in rows}, key=[r["policy"] for r in rows].index)
    variants = sorted({r["variant"] for r in rows}, key=[r["variant"] for r in rows].index)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(policies))
    for i, policy in enumerate(policies):
        got = {r["variant"]: r for r in rows if r["policy"] == policy}
        xs = [j + i * width for j, v in enumerate(variants) if v in got]
        ys = [max(got[v]["kl_mean"], 1e-12) for v in variants if v in got]
        ax.bar(xs, ys, width, label=policy)
        for x, v in zip(xs, [v for v in variants if v in got]):
            ax.annotate(f"{got[v]['top1']:.2f}", (x, max(got[v]['kl_mean'], 1e-12)), ha="center", va="bottom",
                        fontsize=7)
    ax.set_xticks([j + width * (len(policies) - 1) / 2 for j in range(len(variants))], variants)
    ax.set_yscale("log")
    ax.set_ylabel("mean KL(float32 || variant), nats")
    ax.set_title("tiny random Qwen3-Omni, AV session: quantisation vs float32 (labels: top-1 agreement)")
    ax.legend()
    harness.save_png(fig, out, "quantized_omni")
