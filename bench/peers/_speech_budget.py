"""The full-size analytic budget of Qwen3-Omni-30B-A3B's spoken answer (issue 39 item 5), beside the report's cold-start
first packet of 234 ms and real-time factor 0.47: per stage, FLOPs and HBM bytes per generated audio second, at a
stated accelerator and efficiency, and the first packet and RTF they project for a first Code2Wav chunk of n frames.

Every stage's widths are the release's:
- thinker (the project's model notes, as in transformers 5.2.0 `qwen3_omni_moe`): 48 layers, hidden 2048, 32 / 4
  heads of 128, 128 experts top-8 of width 768;
- talker (the release config.json's `talker_config.text_config`, as
  `tests/models/qwen3_omni/test_talker.py::test_release_talker_config` pins it): 20 layers, hidden 1024, 16 / 2 heads
  of 128, 128 experts top-6 of width 384 plus a shared expert of 768 with its sigmoid gate, codec head 1024 x 3072,
  and the text projection (a ResizeMLP 2048 -> 2048 -> 1024) of the one thinker text row it reads a step;
- code predictor (`code_predictor_config`, same test): 5 dense layers, hidden 1024, 16 / 8 heads of 128, MLP 3072,
  15 heads of 1024 x 2048; a frame is 15 calls (codebooks 1..15), the first over 2 rows (talker state, codebook 0's
  embedding), each later one row, each call reading every layer's weights and its codebook's head;
- Code2Wav (`omnijax.models.qwen3_omni.code2wav.Code2WavConfig()`, the release's defaults: 8-layer pre-transformer of
  1024, 2 x 2 ConvNeXt upsampling, decoder 1536 channels, rates 8 / 5 / 4 / 3, 216 M parameters): FLOPs are XLA's
  count of omnijax's own `decode_frames` lowered in bf16 for one call of n frames on a started stream (no weights
  materialised: shapes only); bytes are XLA's bytes-accessed count of that unfused program (every op reads its
  operands from and writes its result to memory: an upper bound; the weights alone, read once a call, are the lower
  bound, both in `source`).
The report's own per-frame times (talker 140 tokens/s, code predictor 14 ms and codec 3 ms per 80 ms frame) sit
beside each row (`report_ms_per_frame`) and give the second projection, which reproduces the report's 0.47.

Conventions: one thinker text token per 80 ms frame (the talker reads one text row per step; with the report's
per-stage figures this reproduces its RTF 0.47 exactly: (1/75 + 1/140 + 0.014 + 0.003) / 0.08 = 0.47); batch one
(decode reads each token's active weights once: memory bound); bf16 weights and KV; the thinker's lm_head is left out
(its vocabulary is not in the notes: 2 x 2048 x V more FLOPs and bytes a token); every thinker layer is taken as MoE
(`mlp_only_layers` not stated); the talker's attention reads `context` cells as the thinker's does; kernel launches
and the host are not counted (the report's code predictor, 15 sequential small calls a frame, is where they weigh
most). The first packet is serial: the prompt's prefill, `text_before_talker` thinker tokens, n talker + code
predictor frames, Code2Wav of those n frames (one call); it and the RTF are projected twice: every stage at its
roofline, and every stage at the report's rates (the thinker at 75 tokens/s).
"""

from __future__ import annotations

import dataclasses
import functools

FRAME_S = 0.080  # Code2Wav: 1,920 samples a frame at 24 kHz
FRAMES_PER_S = 1 / FRAME_S
REPORT = dict(first_packet_ms=234.0, rtf=0.47, thinker_tok_s=75.0, talker_tok_s=140.0, mtp_ms_frame=14.0,
              codec_ms_frame=3.0)


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """Peak dense bf16 FLOP/s, HBM bytes/s and the fraction of each a batch-one decode reaches (stated, not
    measured)."""

    name: str
    flops: float
    hbm: float
    flop_eff: float = 0.4
    hbm_eff: float = 0.6


ACCELERATORS = {"H100": Accelerator("H100 SXM (989 TFLOP/s bf16 dense, 3.35 TB/s)", 989e12, 3.35e12),
                "H200": Accelerator("H200 (989 TFLOP/s bf16 dense, 4.8 TB/s)", 989e12, 4.8e12)}


@dataclasses.dataclass(frozen=True)
class Thinker:
    """Qwen3-Omni-30B-A3B thinker text decoder shapes (the released ones)."""

    layers: int = 48
    hidden: int = 2048
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    experts: int = 128
    top_k: int = 8
    expert_width: int = 768
    bytes_per_param: int = 2

    @property
    def attention_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_width

    @property
    def active_params(self) -> int:
        """Weights one decoded token multiplies (lm_head and embedding left out)."""
        return self.layers * (self.attention_params + self.top_k * self.expert_params + self.hidden * self.experts)

    def kv_bytes(self, tokens: int) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * self.bytes_per_param * tokens

    def decode(self, context: int) -> tuple[float, float]:
        """(FLOPs, bytes) of one decoded token after `context` tokens: weights + attention over the cache."""
        attn = 4 * self.layers * self.heads * self.head_dim * context
        return 2 * self.active_params + attn, self.active_params * self.bytes_per_param + self.kv_bytes(context)

    def prefill(self, tokens: int) -> tuple[float, float]:
        """(FLOPs, bytes) of a `tokens`-long prompt: every token's active weights; the experts read are those any
        token routes to (uniform routing: 128 x (1 - (1 - 8/128)^T) of them a layer)."""
        touched = self.experts * (1 - (1 - self.top_k / self.experts) ** tokens)
        attn = 2 * self.layers * self.heads * self.head_dim * tokens * tokens
        weights = self.layers * (self.attention_params + touched * self.expert_params + self.hidden * self.experts)
        return 2 * self.active_params * tokens + attn, weights * self.bytes_per_param + self.kv_bytes(tokens)


@dataclasses.dataclass(frozen=True)
class Talker:
    """Qwen3-Omni-30B-A3B talker shapes (the release's `talker_config`; module docstring)."""

    layers: int = 20
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 2
    head_dim: int = 128
    experts: int = 128
    top_k: int = 6
    expert_width: int = 384
    shared_width: int = 768
    vocab: int = 3072
    thinker_hidden: int = 2048
    projection: int = 2048
    bytes_per_param: int = 2

    @property
    def active_params(self) -> int:
        """Weights one talker step multiplies: every layer's attention, router, top-k experts and shared expert (and
        its gate), the codec head, and the text projection of the thinker row the step reads."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        layer = (self.hidden * (q + 2 * kv) + q * self.hidden + self.hidden * self.experts
                 + self.top_k * 3 * self.hidden * self.expert_width + 3 * self.hidden * self.shared_width + self.hidden)
        return (self.layers * layer + self.hidden * self.vocab
                + self.thinker_hidden * self.projection + self.projection * self.hidden)

    def decode(self, context: int) -> tuple[float, float]:
        """(FLOPs, bytes) of one talker step (one codec frame's first codebook) after `context` cells."""
        attn = 4 * self.layers * self.heads * self.head_dim * context
        kv = self.layers * self.kv_heads * self.head_dim * 2 * self.bytes_per_param * context
        return 2 * self.active_params + attn, self.active_params * self.bytes_per_param + kv


@dataclasses.dataclass(frozen=True)
class CodePredictor:
    """Qwen3-Omni-30B-A3B code predictor shapes (the release's `code_predictor_config`; module docstring)."""

    layers: int = 5
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    mlp_width: int = 3072
    vocab: int = 2048
    groups: int = 16
    bytes_per_param: int = 2

    @property
    def layer_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.layers * (self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.mlp_width)

    def frame(self) -> tuple[float, float]:
        """(FLOPs, bytes) of one frame's residual codebooks: `groups - 1` calls, the first over 2 rows, then one row
        each (`groups` rows in all), each call reading every layer's weights and one head."""
        calls, rows = self.groups - 1, self.groups
        head = self.hidden * self.vocab
        attn = sum(4 * self.layers * self.heads * self.head_dim * ctx for ctx in range(2, rows + 1))
        flops = 2 * self.layer_params * rows + 2 * head * calls + attn
        kv = self.layers * self.kv_heads * self.head_dim * 2 * self.bytes_per_param * rows
        return flops, calls * (self.layer_params + head) * self.bytes_per_param + kv


@functools.lru_cache(maxsize=None)
def code2wav_call(frames: int) -> dict:
    """XLA's counts for one Code2Wav call of `frames` frames on a started stream, release widths, bf16: `flops`,
    `bytes` (unfused bytes accessed: an upper bound), `weight_bytes` (every parameter once: the lower bound),
    `params`. Shapes only: nothing is allocated or run."""
    import jax  # the counts lower omnijax's own decode (jax, flax: the package's dependencies)
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from omnijax.models.qwen3_omni import code2wav_decode as cd
    from omnijax.models.qwen3_omni.code2wav import Code2Wav, Code2WavConfig

    c = Code2WavConfig(dtype="bfloat16")
    params = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Code2Wav(c, rngs=nnx.Rngs(0)))))

    def call(p, codes, state):
        return cd.decode_frames(p, c, codes, state)

    one = jax.ShapeDtypeStruct((1, c.num_quantizers, 1), jnp.int32)
    started = jax.eval_shape(lambda p, k: call(p, k, cd.init_state(c))[1], params, one)
    codes = jax.ShapeDtypeStruct((1, c.num_quantizers, frames), jnp.int32)
    cost = jax.jit(call).lower(params, codes, started).cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    n = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    return dict(flops=float(cost["flops"]), bytes=float(cost["bytes accessed"]), weight_bytes=2.0 * n, params=n)


def seconds(flops: float, nbytes: float, acc: Accelerator) -> float:
    """Roofline time: the larger of compute at `flop_eff` of peak and traffic at `hbm_eff` of bandwidth."""
    return max(flops / (acc.flops * acc.flop_eff), nbytes / (acc.hbm * acc.hbm_eff))


def budget(acc: Accelerator, *, prompt_tokens: int = 100, context: int = 1000, first_chunks=(2, 4, 8),
           chunk: int = 25, text_before_talker: int = 1) -> dict:
    """Per-stage rows (per audio second, the report's figure beside each) and the projected first packet / RTF per
    first chunk, every stage at its roofline and every stage at the report's rates (`sweep[i]["thinker"]` names
    which).

    Args:
        acc: the accelerator and its stated efficiencies.
        prompt_tokens: the question's prompt (cold start: prefilled before the first text token).
        context: the thinker's cache length while it decodes (attention reads).
        first_chunks: Code2Wav first-call sizes in frames.
        chunk: Code2Wav's later calls, frames (its per-frame row: one such call / `chunk`).
        text_before_talker: thinker tokens decoded before the talker starts.
    """
    th, tk, cp = Thinker(), Talker(), CodePredictor()
    f_tok, b_tok = th.decode(context)
    thinker_s = seconds(f_tok, b_tok, acc)
    f_pre, b_pre = th.prefill(prompt_tokens)
    prefill_s = seconds(f_pre, b_pre, acc)
    f_talk, b_talk = tk.decode(context)
    f_mtp, b_mtp = cp.frame()
    voc = code2wav_call(chunk)
    f_voc, b_voc = voc["flops"] / chunk, voc["bytes"] / chunk
    per_frame = {"thinker": thinker_s, "talker": seconds(f_talk, b_talk, acc),
                 "code predictor": seconds(f_mtp, b_mtp, acc), "vocoder": seconds(f_voc, b_voc, acc)}
    reported = {"thinker": 1 / REPORT["thinker_tok_s"], "talker": 1 / REPORT["talker_tok_s"],
                "code predictor": REPORT["mtp_ms_frame"] / 1e3, "vocoder": REPORT["codec_ms_frame"] / 1e3}
    roof = f"roofline on {acc.name} at {acc.flop_eff:.0%} FLOP/s / {acc.hbm_eff:.0%} HBM"
    sources = {
        "thinker": f"released thinker shapes, {roof}; {th.active_params / 1e9:.2f} B active weights a token "
                   f"(lm_head excluded), context {context}; report: 75 tok/s",
        "talker": f"released talker widths (test_release_talker_config), {roof}; {tk.active_params / 1e6:.0f} M "
                  f"active weights a step (top-6 + shared expert, codec head, text projection), context {context}; "
                  f"report: 140 tok/s",
        "code predictor": f"released code predictor widths, {roof}; 15 calls a frame, each reading "
                          f"{(cp.layer_params + cp.hidden * cp.vocab) / 1e6:.0f} M weights; report: 14 ms a frame",
        "vocoder": f"Code2WavConfig() (release), {voc['params'] / 1e6:.0f} M params; XLA's count of decode_frames, "
                   f"one call of {chunk} frames, {roof}; bytes unfused (upper bound; weights once a call: "
                   f"{voc['weight_bytes'] / chunk / 1e6:.0f} MB a frame); report: 3 ms a frame"}
    costs = {"thinker": (f_tok, b_tok), "talker": (f_talk, b_talk), "code predictor": (f_mtp, b_mtp),
             "vocoder": (f_voc, b_voc)}
    rows = [dict(stage=stage, flops_per_audio_s=costs[stage][0] * FRAMES_PER_S,
                 bytes_per_audio_s=costs[stage][1] * FRAMES_PER_S, ms_per_frame=per_frame[stage] * 1e3,
                 rtf=per_frame[stage] / FRAME_S, report_ms_per_frame=reported[stage] * 1e3,
                 report_rtf=reported[stage] / FRAME_S, source=sources[stage]) for stage in per_frame]
    sweep = []
    for label, rates in (("roofline", per_frame), ("report's rates", reported)):
        rtf = sum(rates.values()) / FRAME_S
        for n in first_chunks:  # prefill, the first text tokens, n talker + predictor frames, Code2Wav of n frames
            first_call = seconds(code2wav_call(n)["flops"], code2wav_call(n)["bytes"], acc) if label == "roofline" \
                else n * rates["vocoder"]
            first = (prefill_s + text_before_talker * rates["thinker"]
                     + n * (rates["talker"] + rates["code predictor"]) + first_call)
            sweep.append(dict(thinker=label, first_chunk=n, first_packet_ms=first * 1e3, rtf=rtf))
    rtf = sum(per_frame.values()) / FRAME_S
    return dict(accelerator=dataclasses.asdict(acc), prompt_tokens=prompt_tokens, context=context, chunk=chunk,
                text_before_talker=text_before_talker, prefill_ms=prefill_s * 1e3,
                prefill_flops=f_pre, prefill_bytes=b_pre, stages=rows, rtf=rtf, sweep=sweep, report=REPORT)
