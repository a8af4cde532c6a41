"""Llama (Llama-2/3.x, including Llama-3 RoPE scaling) and Mistral (7B v0.1-v0.3 without a sliding window) ->
omnijax decoder conversion.

Both are the shared decoder (`omnijax.models.decoder`) without attention biases and q/k norm, with plain 1D RoPE, and
convert through the plain Qwen2 path: the same name table (`omnijax.models.qwen2_5_omni.convert.NAME_TABLE`, whose bias
and q/k-norm rules are switched off by the config) and the same streaming tensor conversion. This module holds what
differs: reading the config. It is a whitelist: every attribute is either read, inert (training-only or bookkeeping), or
checked to hold the value the decoder implements; anything else set to a non-empty value is refused, naming the
attribute, before any tensor is read (`convert_checkpoint` builds the config first).

Config mapping (top-level attributes of a "llama" / "mistral" `config.json`):

    vocab_size, hidden_size, intermediate_size -> same names      num_hidden_layers -> num_layers
    num_attention_heads -> num_heads     num_key_value_heads -> num_kv_heads (default: num_heads)
    head_dim -> head_dim (default hidden_size // num_attention_heads)       rms_norm_eps -> rms_norm_eps
    rope_parameters / rope_scaling + rope_theta -> rope_theta, rope_scaling (llama3: factor, low_freq_factor,
        high_freq_factor, original_max_position_embeddings)
    tie_word_embeddings -> tie_embeddings (settled by whether `lm_head.weight` is present)
    eos_token_id -> eos_token_ids (a `generation_config.json` eos_token_id wins, see `convert_checkpoint`)
    refused unless inert: attention_bias / mlp_bias true, sliding_window / use_sliding_window set, hidden_act other
        than SiLU, partial_rotary_factor != 1, a rope_type other than "default" / "llama3"
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from omnijax.checkpoint import loop as streaming
from omnijax.checkpoint.safetensors import SafetensorsCheckpoint
from omnijax.errors import ConfigError, MissingTensorError, UnsupportedConfigError
from omnijax.models.config import DecoderConfig, default_head_dim, hf_token_ids, hf_value, validate_config
from omnijax.models.encoders.common import HF_PRETRAINED_CONFIG_ATTRIBUTES
from omnijax.models.qwen2_5_omni import convert as shared

OMNIJAX_MODEL_TYPES = {"llama": "llama", "mistral": "mistral"}
HF_MODEL_TYPES = tuple(OMNIJAX_MODEL_TYPES)
DEFAULT_ROPE_THETA = 10000.0  # LlamaConfig's and MistralConfig's default

# Attributes the decoder reads, and those that do not change the forward.
_READ = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
         "tie_word_embeddings", "eos_token_id"}
# pretraining_tp splits the projections into slices whose results are summed: the same math.
_INERT = {"max_position_embeddings", "initializer_range", "use_cache", "attention_dropout", "pretraining_tp",
          "output_router_logits", "bos_token_id", "pad_token_id"}
# Attributes checked below to hold the value the decoder implements.
_CHECKED = {"hidden_act", "attention_bias", "mlp_bias", "sliding_window", "use_sliding_window",
            "partial_rotary_factor", "layer_types"}
_ROPE_KEYS = {"default": {"rope_type", "type", "rope_theta"},
              "llama3": {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"}}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def model_type_for(hf_config: Mapping[str, Any]) -> str:
    """The omnijax model type of a parsed Hugging Face config ("llama" or "mistral")."""
    return OMNIJAX_MODEL_TYPES[hf_config.get("model_type")]


def _check_math(hf: Mapping[str, Any]) -> None:
    """Refuses every attribute that changes the math in a way the decoder does not implement."""
    for key, value in hf.items():
        if key not in _READ | _INERT | _CHECKED | HF_PRETRAINED_CONFIG_ATTRIBUTES and \
                value not in (None, False, 0, [], {}, ""):
            raise UnsupportedConfigError(f"config.{key}", value, "not implemented by the Llama/Mistral decoder; "
                                         "remove it from config.json if it does not change the forward")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedConfigError("config.hidden_act", act, "only the SiLU-gated MLP is implemented")
    if hf.get("attention_bias"):
        raise UnsupportedConfigError("config.attention_bias", hf["attention_bias"],
                                     "q/k/v/o projection biases are not implemented for Llama/Mistral")
    if hf.get("mlp_bias"):
        raise UnsupportedConfigError("config.mlp_bias", hf["mlp_bias"], "MLP biases are not implemented")
    if hf.get("sliding_window") is not None:
        raise UnsupportedConfigError("config.sliding_window", hf["sliding_window"],
                                     "sliding-window attention is not implemented (Mistral-7B v0.2 and later set "
                                     "sliding_window: null)")
    if hf.get("use_sliding_window"):
        raise UnsupportedConfigError("config.use_sliding_window", hf["use_sliding_window"],
                                     "sliding-window attention is not implemented")
    if hf.get("partial_rotary_factor", 1.0) not in (None, 1.0):
        raise UnsupportedConfigError("config.partial_rotary_factor", hf["partial_rotary_factor"],
                                     "partial rotary embeddings are not implemented")
    for i, kind in enumerate(hf.get("layer_types") or ()):
        if kind != "full_attention":
            raise UnsupportedConfigError(f"config.layer_types[{i}]", kind, "only full attention is implemented")


def _rope(hf: Mapping[str, Any]) -> tuple[float, tuple[float, float, float, float] | None]:
    """`(theta, llama3 scaling or None)` from `rope_parameters` (or the legacy `rope_scaling`) and `rope_theta`."""
    key = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
    rope = hf.get(key) or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"config.{key} must be an object, got {rope!r}")
    legacy = hf.get("rope_scaling")
    if key == "rope_parameters" and isinstance(legacy, dict):
        clash = sorted(k for k in legacy if k in rope and legacy[k] != rope[k])
        if clash:
            raise ConfigError(f"config.rope_parameters and config.rope_scaling disagree on {clash}")
    kind_key = "rope_type" if "rope_type" in rope else "type"
    kind = rope.get(kind_key, "default")
    if kind not in _ROPE_KEYS:
        raise UnsupportedConfigError(f"config.{key}.{kind_key}", kind,
                                     f"only the {sorted(_ROPE_KEYS)} RoPE types are implemented")
    for name, value in rope.items():
        if name not in _ROPE_KEYS[kind]:
            raise UnsupportedConfigError(f"config.{key}.{name}", value, f"not part of {kind!r} RoPE as implemented")
    theta = rope.get("rope_theta", hf.get("rope_theta"))
    if rope.get("rope_theta") is not None and hf.get("rope_theta") is not None and \
            repr(rope["rope_theta"]) != repr(hf["rope_theta"]) and rope["rope_theta"] != hf["rope_theta"]:
        raise ConfigError(f"config.{key}.rope_theta={theta!r} disagrees with config.rope_theta={hf['rope_theta']!r}")
    theta = DEFAULT_ROPE_THETA if theta is None else theta  # its range: `omnijax.models.config.check_values`
    if kind == "default":
        return theta, None
    missing = [name for name in _LLAMA3_KEYS if rope.get(name) is None]
    if missing:
        raise ConfigError(f"config.{key} with rope_type 'llama3' lacks {missing}")
    try:
        factor, low, high, original = (float(rope[name]) for name in _LLAMA3_KEYS)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.{key}: llama3 RoPE values must be numbers, got {rope!r}") from e
    return theta, (factor, low, high, original)  # ranges: `omnijax.models.config.check_values`


def _eos_ids(hf: Mapping[str, Any]) -> tuple[int, ...]:
    """The config's end-of-answer ids (their range is checked with the config's, `validate_config`)."""
    eos = hf.get("eos_token_id")
    ids = [] if eos is None else [eos] if isinstance(eos, int) else eos
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"config.eos_token_id must be an int or a list of ints, got {eos!r}")
    return tuple(ids)


def config_from_hf(hf_config: Mapping[str, Any], *, dtype: str = "float32") -> DecoderConfig:
    """Builds the decoder config of a Llama or Mistral checkpoint (mapping in the module docstring).

    Args:
        hf_config: a parsed `config.json` with `model_type` "llama" or "mistral" (top-level settings). RoPE settings
            may use the current `rope_parameters` dict or the legacy `rope_scaling` dict plus `rope_theta`.
        dtype: parameter and compute dtype of the converted model ("float32" or "bfloat16").

    Returns:
        The `DecoderConfig` (no q/k/v bias, no q/k norm, 1D RoPE). `tie_embeddings` reflects the config's flag
        only; `convert_params` settles it from the tensors present.

    Raises:
        UnsupportedConfigError: an attribute changes the math in a way the decoder does not implement (named).
        ConfigError: a required attribute is missing or the values are inconsistent.
    """
    if hf_config.get("model_type") not in OMNIJAX_MODEL_TYPES:
        raise ConfigError(f"model_type {hf_config.get('model_type')!r} is not one of {HF_MODEL_TYPES}")
    _check_math(hf_config)
    theta, scaling = _rope(hf_config)
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if hf_config.get(k) is None]
    if missing:
        raise ConfigError(f"config lacks required attribute(s) {missing}")
    eos = _eos_ids(hf_config)
    heads, hidden = hf_config["num_attention_heads"], hf_config["hidden_size"]
    try:
        return validate_config(DecoderConfig(
            vocab_size=hf_config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf_config["intermediate_size"],
            num_layers=hf_config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf_value(hf_config, "num_key_value_heads", heads),
            head_dim=hf_value(hf_config, "head_dim", default_head_dim(hidden, heads)),
            rope_theta=theta,
            rope_scaling=scaling,
            mrope_section=None,
            rms_norm_eps=hf_config.get("rms_norm_eps", 1e-6),
            qkv_bias=False,
            qk_norm=False,
            tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            dtype=dtype,
            eos_token_ids=eos,
        ), hf_token_ids(hf_config))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config: {e}") from e


def convert_params(ckpt: SafetensorsCheckpoint, hf_config: Mapping[str, Any], *, dtype: str, staging_dir: Path,
                   progress: bool = True, log: Callable[[str], None] = streaming.stderr
                   ) -> tuple[DecoderConfig, dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Converts a Llama / Mistral checkpoint's weights into memory-mapped arrays in the decoder's layout.

    Args:
        ckpt: the validated source checkpoint (single file or sharded).
        hf_config: its parsed `config.json`.
        dtype: target dtype, "float32" or "bfloat16".
        staging_dir: directory for the output arrays' memory-mapped files (created; the caller deletes it).
        progress: show a tqdm bar over tensors on stderr.
        log: receives the one-line summaries of skipped tensors.

    Returns:
        `(config, params, source_info, extras)` as `omnijax.models.qwen2_5_omni.convert.convert_params` returns them;
        `extras` is empty (no encoders).

    Raises:
        MissingTensorError: no `lm_head.weight` while the config does not tie embeddings (or another tensor of the
            table is missing); UnexpectedTensorError / ShapeMismatchError: the tensors do not match the config.
    """
    config = config_from_hf(hf_config, dtype=dtype)
    has_head = "lm_head.weight" in ckpt.names()
    if not has_head and not config.tie_embeddings:
        raise MissingTensorError("checkpoint lacks tensor 'lm_head.weight' and the config does not tie embeddings "
                                 "(tie_word_embeddings is false)")
    config = config.replace(tie_embeddings=not has_head)
    trees, plan, source_dtypes = streaming.convert_components(
        ckpt, [shared.decoder_component(config)], dtype=dtype, staging_dir=staging_dir, progress=progress)
    streaming.log_skipped(plan.skipped, (), log)
    source_info = {
        "tensors_converted": len(plan.assign),
        "source_dtypes": dict(sorted(source_dtypes.items())),
        "skipped": plan.skipped,
        "encoders_converted": [],
        "lm_head": "tied to embed" if config.tie_embeddings else "lm_head.weight",
    }
    return config, trees["decoder"], source_info, {}
