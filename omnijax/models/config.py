"""Model configuration: frozen dataclasses with presets.

A `DecoderConfig` describes a Qwen2-family decoder (Qwen2, Qwen2.5-Omni thinker, Qwen3 with q/k norm, and the
Llama-3.x / Mistral decoders: no biases, 1D RoPE, optionally Llama-3 scaled). It holds only
static hyperparameters; weights live in the parameter pytree.

Every value is checked when a config is built (`check_values`: positive sizes, finite positive `rope_theta` and
`rms_norm_eps`, whole head groups, MoE counts, Llama-3 RoPE scaling); `validate_config` adds the token ids, which must
lie in the vocabulary: the decoder's eos / bos / pad ids and the family's special ids (multimodal placeholders,
modality and chat markers: `omnijax.models.family.Family.special_token_ids`, named with `token_id_fields`). The
converter (`omnijax.convert`, through each family's `config_from_hf`) and the loader
(`omnijax.models.registry.read_manifest`) both run `validate_config`, so a bad value in a Hugging Face `config.json`,
its tokenizer files or a converted checkpoint's manifest is refused by name before any tensor is read.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

from omnijax._checks import DTYPES, JsonConfig
from omnijax.errors import ConfigValueError
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
        check_values(self)

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


# ------------------------------------------------------------------------------------------------------ validation

# DecoderConfig field -> the Hugging Face config.json attribute it is read from, where the names differ.
HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
            "num_kv_heads": "num_key_value_heads", "eos_token_ids": "eos_token_id"}
# Token-id attributes of a Hugging Face decoder config (`hf_token_ids`).
HF_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
_LLAMA3_SCALING = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _name(field: str) -> str:
    """A field's name in messages, with its Hugging Face spelling where that differs."""
    return f"{field} ({HF_NAMES[field]})" if field in HF_NAMES else field


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(config: DecoderConfig, field: str, minimum: int) -> None:
    value = getattr(config, field)
    if not _is_int(value) or value < minimum:
        raise ConfigValueError(_name(field), value, f"an integer >= {minimum}")
    object.__setattr__(config, field, int(value))


def _check_positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ConfigValueError(name, value, "a finite number > 0")
    return float(value)


def check_values(config: DecoderConfig) -> None:
    """Refuses a `DecoderConfig` value no decoder can run with; runs whenever a config is built.

    Sizes and counts are integers >= 1 (`head_dim` >= 2 and even; `intermediate_size` may be 0 only when every layer
    is a mixture of experts), `num_kv_heads` divides `num_heads`, `rope_theta` and `rms_norm_eps` are finite and
    positive, MoE counts are consistent (`1 <= num_experts_per_tok <= num_experts`), Llama-3 RoPE scaling values are
    finite and positive with `low_freq_factor < high_freq_factor`. Integral values are stored as `int`.

    Raises:
        ConfigValueError: (a `ValueError`) naming the field, its Hugging Face name where it differs, the bad value
            and the allowed range.
    """
    c = config
    if c.dtype not in DTYPES:
        raise ConfigValueError("dtype", c.dtype, f"one of {sorted(DTYPES)}")
    for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "decoder_sparse_step"):
        _check_int(c, field, 1)
    _check_int(c, "head_dim", 2)
    for field in ("intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        _check_int(c, field, 0)
    object.__setattr__(c, "rope_theta", _check_positive("rope_theta", c.rope_theta))
    object.__setattr__(c, "rms_norm_eps", _check_positive("rms_norm_eps", c.rms_norm_eps))
    if c.num_heads % c.num_kv_heads:
        raise ConfigValueError(_name("num_kv_heads"), c.num_kv_heads,
                               f"a divisor of num_heads (num_attention_heads) = {c.num_heads}")
    if c.head_dim % 2:
        raise ConfigValueError("head_dim", c.head_dim, "even (RoPE rotates pairs)")
    if c.mrope_section is not None:
        section = tuple(c.mrope_section) if isinstance(c.mrope_section, (tuple, list)) else ()
        if len(section) != 3 or not all(_is_int(s) and s >= 0 for s in section) or sum(section) != c.head_dim // 2:
            raise ConfigValueError("mrope_section", c.mrope_section, f"3 integers >= 0 summing to head_dim // 2 = "
                                   f"{c.head_dim // 2}")
        object.__setattr__(c, "mrope_section", tuple(int(s) for s in section))
    if not all(_is_int(t) for t in c.eos_token_ids):
        raise ConfigValueError(_name("eos_token_ids"), c.eos_token_ids, "integers")
    object.__setattr__(c, "eos_token_ids", tuple(int(t) for t in c.eos_token_ids))
    if not all(_is_int(i) for i in c.mlp_only_layers):
        raise ConfigValueError("mlp_only_layers", c.mlp_only_layers, "layer indices (integers)")
    object.__setattr__(c, "mlp_only_layers", tuple(sorted(int(i) for i in c.mlp_only_layers)))
    if c.num_experts:
        if not 1 <= c.num_experts_per_tok <= c.num_experts:
            raise ConfigValueError("num_experts_per_tok", c.num_experts_per_tok, f"in [1, num_experts = "
                                   f"{c.num_experts}]")
        if c.moe_intermediate_size < 1:
            raise ConfigValueError("moe_intermediate_size", c.moe_intermediate_size, ">= 1 with experts")
        bad = [i for i in c.mlp_only_layers if not 0 <= i < c.num_layers]
        if bad:
            raise ConfigValueError("mlp_only_layers", list(c.mlp_only_layers),
                                   f"layers of the {c.num_layers}-layer decoder, in [0, {c.num_layers})")
    if c.intermediate_size < 1 and not all(c.sparse_layers):
        raise ConfigValueError("intermediate_size", c.intermediate_size, ">= 1 (the decoder has dense MLP layers)")
    if c.mrope_interleaved and c.mrope_section is None:
        raise ValueError("mrope_interleaved needs an mrope_section")
    if c.rope_scaling is not None:
        _check_rope_scaling(c)


def _check_rope_scaling(config: DecoderConfig) -> None:
    scaling = config.rope_scaling
    if scaling is None or len(scaling) != 4:
        raise ConfigValueError("rope_scaling", scaling, f"the 4 llama3 values {_LLAMA3_SCALING}")
    values = tuple(_check_positive(f"rope_scaling.{name}", v) for name, v in zip(_LLAMA3_SCALING, scaling))
    _, low, high, _ = values
    if low >= high:
        raise ConfigValueError("rope_scaling.low_freq_factor", low, f"below high_freq_factor = {high} (llama3 RoPE "
                               "needs low_freq_factor < high_freq_factor)")
    if config.mrope_section is not None:
        raise ValueError("rope_scaling (Llama-3) applies to plain 1D RoPE; drop the mrope_section or the scaling")
    object.__setattr__(config, "rope_scaling", values)


def check_token_ids(ids: Mapping[str, Any], vocab_size: int) -> None:
    """Refuses token ids outside the vocabulary `[0, vocab_size)`.

    Args:
        ids: attribute name (as messages should name it, e.g. "config.bos_token_id") -> an id or a list of ids;
            None values are skipped.
        vocab_size: rows of the embedding table.

    Raises:
        ConfigValueError: naming the attribute, the bad id and the range.
    """
    for name, value in ids.items():
        if value is None:
            continue
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if not _is_int(v) or not 0 <= v < vocab_size:
                raise ConfigValueError(name, value, f"a token id (or list of them) in [0, vocab_size = {vocab_size}), "
                                       "inside the vocabulary")


def token_id_fields(component: str, ids: Any, hf_names: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The `*_token_id` fields of a family's dataclass of special ids (e.g. `OmniConfig`), for `validate_config`.

    Args:
        component: the manifest entry holding them (e.g. "omni"); names are `component.field`.
        ids: the dataclass instance.
        hf_names: field -> its Hugging Face attribute where the spelling differs, shown in parentheses.

    Returns:
        name -> id, e.g. `{"omni.audio_token_id (audio_token_index)": 151646, ...}`.
    """
    spelled = hf_names or {}
    return {f"{component}.{f.name}" + (f" ({spelled[f.name]})" if f.name in spelled else ""): getattr(ids, f.name)
            for f in dataclasses.fields(ids) if f.name.endswith("_token_id")}


def default_head_dim(hidden_size: Any, num_heads: Any) -> int:
    """`hidden_size // num_heads`, the head width a Hugging Face config implies when it sets no `head_dim`; 0 when
    either is not a positive integer (the config's own check then names the bad one)."""
    if _is_int(hidden_size) and _is_int(num_heads) and hidden_size > 0 and num_heads > 0:
        return int(hidden_size) // int(num_heads)
    return 0


def hf_value(section: Mapping[str, Any], key: str, default: Any) -> Any:
    """`section[key]`, or `default` where the key is absent or null: unlike `section.get(key) or default`, a 0 stays
    0, so the config's check refuses it instead of quietly taking the default."""
    value = section.get(key)
    return default if value is None else value


def hf_token_ids(section: Mapping[str, Any]) -> dict[str, Any]:
    """The `bos_token_id` / `eos_token_id` / `pad_token_id` a Hugging Face config section sets (for
    `validate_config`; the caller's error names the section)."""
    return {key: section[key] for key in HF_TOKEN_ID_KEYS if section.get(key) is not None}


def validate_config(config: DecoderConfig, token_ids: Mapping[str, Any] | None = None) -> DecoderConfig:
    """Every value check of a decoder config, as the converter and the loader run it: the values a config is built
    with (`check_values`), and its `eos_token_ids` plus `token_ids` (e.g. a Hugging Face config's bos / pad ids,
    `hf_token_ids`, and the family's special ids, `omnijax.models.family.Family.special_token_ids`) inside the
    vocabulary.

    Args:
        config: the decoder config.
        token_ids: further token ids, name -> id or list of ids (see `check_token_ids`).

    Returns:
        `config`, unchanged.

    Raises:
        ConfigValueError: (a `ValueError`) naming the field, the bad value and the allowed range.
    """
    check_values(config)
    check_token_ids({**(token_ids or {}), _name("eos_token_ids"): list(config.eos_token_ids)}, config.vocab_size)
    return config


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
