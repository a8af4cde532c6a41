"""Model configuration: frozen dataclasses with presets.

A `DecoderConfig` describes a Qwen2-family decoder (Qwen2, Qwen2.5-Omni thinker, Qwen3 with q/k norm, and the
Llama-3.x / Mistral decoders: no biases, 1D RoPE, optionally Llama-3 scaled). It holds only
static hyperparameters; weights live in the parameter pytree.
"""

from __future__ import annotations

import dataclasses

from omnijax._checks import DTYPES, JsonConfig
from omnijax.kv.rope import ScaledTheta


@dataclasses.dataclass(frozen=True)
class DecoderConfig(JsonConfig):
    """Static hyperparameters of a Qwen2-family (also Llama / Mistral) decoder.

    Attributes:
        vocab_size: rows of the embedding table (and columns of the lm head).
        hidden_size: model width D.
        intermediate_size: SwiGLU width I.
        num_layers: decoder layers L.
        num_heads: query heads H.
        num_kv_heads: key/value heads (GQA groups), divides `num_heads`.
        head_dim: per-head width; even.
        rope_theta: RoPE base.
        mrope_section: rotary frequency split over the (t, h, w) position axes; `None` for plain 1D RoPE. The sum must
            equal `head_dim // 2`.
        rms_norm_eps: RMSNorm epsilon.
        qkv_bias: q/k/v projections carry a bias (Qwen2); o_proj never does.
        qk_norm: per-head RMSNorm on queries and keys before RoPE (Qwen3).
        tie_embeddings: the lm head reuses the embedding table.
        dtype: compute dtype name ("float32" or "bfloat16"); parameters are stored in it too.
        eos_token_ids: tokens that end a greedy answer.
        mrope_interleaved: the mrope axes take frequencies in turn (t, h, w, t, h, w, ...; Qwen3-Omni / Qwen3-VL)
            instead of in three contiguous sections (Qwen2.5-Omni); see `omnijax.kv.rope.axis_of_frequency`.
        num_experts: routed experts E of the MoE layers (Qwen3-MoE); 0 = every layer has the dense SwiGLU MLP.
        num_experts_per_tok: experts k each token is routed to.
        moe_intermediate_size: SwiGLU width of one expert.
        norm_topk_prob: renormalise the k chosen router probabilities to sum to one.
        mlp_only_layers: layers that keep the dense MLP although `num_experts > 0`.
        decoder_sparse_step: with experts, layer i is MoE when `(i + 1) % decoder_sparse_step == 0` (and not in
            `mlp_only_layers`), as Hugging Face's Qwen3-MoE decides.
        rope_scaling: Llama-3 RoPE scaling (`rope_type` "llama3") as `(factor, low_freq_factor, high_freq_factor,
            original_max_position_embeddings)`; `None` = unscaled. Plain 1D RoPE only (see `rope_base`).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1e6
    mrope_section: tuple[int, int, int] | None = None
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = True
    qk_norm: bool = False
    tie_embeddings: bool = False
    dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    mrope_interleaved: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    rope_scaling: tuple[float, float, float, float] | None = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"DecoderConfig.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.mrope_section is not None:
            section = tuple(int(s) for s in self.mrope_section)
            if len(section) != 3 or sum(section) != self.head_dim // 2:
                raise ValueError(
                    f"mrope_section {section} must have 3 entries summing to head_dim // 2 = {self.head_dim // 2}")
            object.__setattr__(self, "mrope_section", section)
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        object.__setattr__(self, "mlp_only_layers", tuple(sorted(int(i) for i in self.mlp_only_layers)))
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok must lie in [1, num_experts={self.num_experts}], got "
                                 f"{self.num_experts_per_tok}")
            if self.moe_intermediate_size < 1:
                raise ValueError(f"moe_intermediate_size must be >= 1 with experts, got {self.moe_intermediate_size}")
            if self.decoder_sparse_step < 1:
                raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
            bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(f"mlp_only_layers {bad} are not layers of a {self.num_layers}-layer decoder")
        if self.mrope_interleaved and self.mrope_section is None:
            raise ValueError("mrope_interleaved needs an mrope_section")
        if self.rope_scaling is not None:
            self._check_rope_scaling()

    def _check_rope_scaling(self) -> None:
        scaling = tuple(float(v) for v in self.rope_scaling)
        if len(scaling) != 4:
            raise ValueError(f"rope_scaling must be (factor, low_freq_factor, high_freq_factor, "
                             f"original_max_position_embeddings), got {self.rope_scaling!r}")
        factor, low, high, original = scaling
        if min(scaling) <= 0 or low >= high:
            raise ValueError(f"rope_scaling {scaling} needs positive values and low_freq_factor < high_freq_factor")
        if self.mrope_section is not None:
            raise ValueError("rope_scaling (Llama-3) applies to plain 1D RoPE; drop the mrope_section or the scaling")
        object.__setattr__(self, "rope_scaling", scaling)

    @property
    def rope_base(self) -> float | ScaledTheta:
        """What the RoPE functions take as `theta`: `rope_theta`, or an `omnijax.kv.rope.ScaledTheta` with the
        Llama-3 scaling when `rope_scaling` is set (`omnijax.kv.rope.inverse_frequencies`)."""
        if self.rope_scaling is None:
            return self.rope_theta
        return ScaledTheta(float(self.rope_theta), *self.rope_scaling)

    @property
    def position_axes(self) -> int:
        """Number of position components per token: 3 for mrope (t, h, w), 1 for plain RoPE."""
        return 1 if self.mrope_section is None else 3

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Per layer: True where the MLP is the mixture of experts (Hugging Face's Qwen3-MoE rule)."""
        if not self.num_experts:
            return (False,) * self.num_layers
        return tuple(i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
                     for i in range(self.num_layers))


# Presets. Real sizes come from the published checkpoints; `tiny` variants are for tests and the demo.
QWEN2_5_OMNI_7B = DecoderConfig(
    vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4,
    head_dim=128, rope_theta=1e6, mrope_section=(16, 24, 24), qkv_bias=True, tie_embeddings=False,
    eos_token_ids=(151645,))
QWEN2_5_OMNI_3B = QWEN2_5_OMNI_7B.replace(
    vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_layers=36, num_heads=16, num_kv_heads=2)
QWEN3_8B = DecoderConfig(
    vocab_size=151748, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8,
    head_dim=128, rope_theta=1e6, mrope_section=None, qkv_bias=False, qk_norm=True, tie_embeddings=False)
# The thinker LLM of Qwen3-Omni-30B-A3B: 48 Qwen3-MoE layers (128 experts, 8 per token), interleaved mrope.
QWEN3_OMNI_30B_A3B = DecoderConfig(
    vocab_size=152064, hidden_size=2048, intermediate_size=768, num_layers=48, num_heads=32, num_kv_heads=4,
    head_dim=128, rope_theta=1e6, mrope_section=(24, 20, 20), mrope_interleaved=True, qkv_bias=False, qk_norm=True,
    tie_embeddings=False, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    eos_token_ids=(151645,))
TINY_OMNI = DecoderConfig(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    rope_theta=1e6, mrope_section=(2, 3, 3), qkv_bias=True, tie_embeddings=False)

PRESETS = {
    "qwen2_5_omni_7b": QWEN2_5_OMNI_7B,
    "qwen2_5_omni_3b": QWEN2_5_OMNI_3B,
    "qwen3_omni_30b_a3b": QWEN3_OMNI_30B_A3B,
    "qwen3_8b": QWEN3_8B,
    "tiny_omni": TINY_OMNI,
}
