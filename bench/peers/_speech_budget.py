"""The full-size analytic budget of Qwen3-Omni-30B-A3B's spoken answer (issue 39 item 5), beside the report's cold-start
first packet of 234 ms and real-time factor 0.47: per stage, FLOPs and HBM bytes per generated audio second, at a
stated accelerator and efficiency, and the first packet and RTF they project for a first Code2Wav chunk of n frames.

Only shapes that can be read offline are used: the thinker's (the project's model notes, as in transformers
5.2.0 `qwen3_omni_moe`: 48 layers, hidden 2048, 32 / 4 heads of 128, 128 experts top-8 of width 768). The talker's,
the code predictor's and Code2Wav's released widths are not in those notes and no released config is readable here
(transformers' default configs are not the release), so those rows carry no FLOPs or bytes: they use the report's
own measured per-frame times (talker 140 tokens/s, code predictor 14 ms and codec 3 ms per 80 ms frame) and say so
in `source`.

Conventions: one thinker text token per 80 ms frame (the talker reads one text row per step; with the report's
per-stage figures this reproduces its RTF 0.47 exactly: (1/75 + 1/140 + 0.014 + 0.003) / 0.08 = 0.47); batch one
(decode reads each token's active weights once: memory bound); bf16 weights and KV; the thinker's lm_head is left out
(its vocabulary is not in the notes: 2 x 2048 x V more FLOPs and bytes a token); every thinker layer is taken as MoE
(`mlp_only_layers` not stated). The first packet is serial: the prompt's prefill, `text_before_talker` thinker
tokens, n talker + code predictor frames, Code2Wav of those n frames; it and the RTF are projected twice, the thinker
at its roofline and at the report's 75 tokens/s (which gives the report's 0.47).
"""

from __future__ import annotations

import dataclasses

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


def seconds(flops: float, nbytes: float, acc: Accelerator) -> float:
    """Roofline time: the larger of compute at `flop_eff` of peak and traffic at `hbm_eff` of bandwidth."""
    return max(flops / (acc.flops * acc.flop_eff), nbytes / (acc.hbm * acc.hbm_eff))


def budget(acc: Accelerator, *, prompt_tokens: int = 100, context: int = 1000, first_chunks=(2, 4, 8),
           text_before_talker: int = 1) -> dict:
    """Per-stage rows (per audio second) and the projected first packet / RTF per first chunk.

    Args:
        acc: the accelerator and its stated efficiencies.
        prompt_tokens: the question's prompt (cold start: prefilled before the first text token).
        context: the thinker's cache length while it decodes (attention reads).
        first_chunks: Code2Wav first-call sizes in frames.
        text_before_talker: thinker tokens decoded before the talker starts.
    """
    th = Thinker()
    f_tok, b_tok = th.decode(context)
    thinker_s = seconds(f_tok, b_tok, acc)
    f_pre, b_pre = th.prefill(prompt_tokens)
    prefill_s = seconds(f_pre, b_pre, acc)
    per_frame = {"thinker": thinker_s, "talker": 1 / REPORT["talker_tok_s"],
                 "code predictor": REPORT["mtp_ms_frame"] / 1e3, "vocoder": REPORT["codec_ms_frame"] / 1e3}
    rows = [dict(stage="thinker", flops_per_audio_s=f_tok * FRAMES_PER_S, bytes_per_audio_s=b_tok * FRAMES_PER_S,
                 ms_per_frame=thinker_s * 1e3, rtf=thinker_s / FRAME_S,
                 source=f"released thinker shapes, roofline on {acc.name} at {acc.flop_eff:.0%} FLOP/s / "
                        f"{acc.hbm_eff:.0%} HBM; {th.active_params / 1e9:.2f} B active weights a token (lm_head "
                        f"excluded), context {context}; report: {1e3 / REPORT['thinker_tok_s']:.1f} ms (75 tok/s)")]
    unknown = "released shapes not readable offline: the report's measured"
    rows += [dict(stage="talker", flops_per_audio_s=None, bytes_per_audio_s=None,
                  ms_per_frame=per_frame["talker"] * 1e3, rtf=per_frame["talker"] / FRAME_S,
                  source=f"{unknown} 140 tok/s"),
             dict(stage="code predictor", flops_per_audio_s=None, bytes_per_audio_s=None,
                  ms_per_frame=per_frame["code predictor"] * 1e3, rtf=per_frame["code predictor"] / FRAME_S,
                  source=f"{unknown} 14 ms a frame"),
             dict(stage="vocoder", flops_per_audio_s=None, bytes_per_audio_s=None,
                  ms_per_frame=per_frame["vocoder"] * 1e3, rtf=per_frame["vocoder"] / FRAME_S,
                  source=f"{unknown} 3 ms a frame")]
    sweep = []
    for thinker, t_tok in (("roofline", thinker_s), ("report's 75 tok/s", 1 / REPORT["thinker_tok_s"])):
        rtf = (sum(per_frame.values()) - thinker_s + t_tok) / FRAME_S
        for n in first_chunks:  # prefill, the first text tokens, n talker + predictor frames, Code2Wav of n frames
            first = (prefill_s + text_before_talker * t_tok
                     + n * (per_frame["talker"] + per_frame["code predictor"]) + n * per_frame["vocoder"])
            sweep.append(dict(thinker=thinker, first_chunk=n, first_packet_ms=first * 1e3, rtf=rtf))
    rtf = sum(per_frame.values()) / FRAME_S
    return dict(accelerator=dataclasses.asdict(acc), prompt_tokens=prompt_tokens, context=context,
                text_before_talker=text_before_talker, prefill_ms=prefill_s * 1e3,
                prefill_flops=f_pre, prefill_bytes=b_pre, stages=rows, rtf=rtf, sweep=sweep, report=REPORT)
