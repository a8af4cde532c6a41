"""Reading a Hugging Face config of the Qwen2.5-Omni family's decoders (the Qwen2.5-Omni thinker, plain Qwen2 / Qwen3
LLMs): `config_from_hf` -> `DecoderConfig`, refusing every attribute that would change the math in a way the
decoder does not implement; the layouts of the model types it reads (`HF_LAYOUTS`).

`omnijax.models.qwen2_5_omni.convert` (the converter) re-exports these names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from omnijax.errors import ConfigError, ConvertError, UnsupportedConfigError
from omnijax.models.config import DecoderConfig, default_head_dim, hf_token_ids, hf_value, validate_config
from omnijax.models.encoders.common import HF_PRETRAINED_CONFIG_ATTRIBUTES
from omnijax.models.qwen2_5_omni.talker import TalkerConfig
from omnijax.models.qwen2_5_omni.token2wav import Token2WavConfig


@dataclasses.dataclass(frozen=True)
class HfLayout:
    """What one Hugging Face `model_type` this converter reads means for it.

    Attributes:
        model_type: the omnijax model type written to the manifest (a component key of this family's `Family`).
        thinker_key: where the thinker's settings are: under this key of the config (the full model), the config
            itself (""), or None for a plain LLM whose settings are top-level.
        tmrope: the decoder needs a 3-axis `mrope_section` (the Qwen2.5-Omni thinker).
        qk_norm: Qwen3 layers: q/k norm and no attention biases (else Qwen2's q/k/v biases).
        strict_biases: an `attention_bias` other than true is refused (the thinker: its biases are fixed).
    """

    model_type: str
    thinker_key: str | None
    tmrope: bool = False
    qk_norm: bool = False
    strict_biases: bool = False


# Hugging Face model_type -> its layout. Plain Qwen2/Qwen3 LLM checkpoints share the decoder and the name table
# (Qwen3: q/k norm, no attention biases; both: 1D RoPE unless an mrope_section is set).
HF_LAYOUTS = {
    "qwen2_5_omni": HfLayout("qwen2_5_omni", "thinker_config", tmrope=True, strict_biases=True),
    "qwen2_5_omni_thinker": HfLayout("qwen2_5_omni", "", tmrope=True, strict_biases=True),
    "qwen2": HfLayout("qwen2", None),
    "qwen3": HfLayout("qwen3", None, qk_norm=True),
}
OMNIJAX_MODEL_TYPES = {hf: layout.model_type for hf, layout in HF_LAYOUTS.items()}
HF_MODEL_TYPES = tuple(HF_LAYOUTS)
IM_END_TOKEN_ID = 151645  # <|im_end|> of the release: the end of an answer unless the checkpoint says otherwise

# ---------------------------------------------------------------------------------------------------------- config


def layout_of(hf_config: Mapping[str, Any]) -> HfLayout:
    """The `HfLayout` of a parsed Hugging Face config; ConfigError naming the model types read otherwise."""
    layout = HF_LAYOUTS.get(str(hf_config.get("model_type")))
    if layout is None:
        raise ConfigError(f"model_type {hf_config.get('model_type')!r} is not one of {HF_MODEL_TYPES}")
    return layout


def _text_config(hf: Mapping[str, Any]) -> tuple[dict, str, bool | None]:
    """Returns `(text_config, its dotted scope, tie flag)` of a full or thinker-only config."""
    key = layout_of(hf).thinker_key
    if key is None:
        return dict(hf), "config", hf.get("tie_word_embeddings")
    thinker, scope = (hf.get(key), key) if key else (hf, "")
    if not isinstance(thinker, dict):
        raise ConfigError(f"{hf.get('model_type')} config has no '{key}' object")
    text = thinker.get("text_config")
    text_scope = f"{scope}.text_config" if scope else "text_config"
    if not isinstance(text, dict):
        raise ConfigError(f"config has no '{text_scope}' object")
    # The thinker's own flag is the one transformers applies; the text config's is a fallback.
    tie = thinker.get("tie_word_embeddings", text.get("tie_word_embeddings"))
    return text, text_scope, tie


_ROPE_KEYS = {"rope_type", "type", "rope_theta", "mrope_section", "factor", "mrope_interleaved",
              "partial_rotary_factor"}


def parse_rope(rope: Mapping[str, Any], scope: str) -> tuple[float | None, tuple[int, ...] | None]:
    """Validates a `rope_parameters` / legacy `rope_scaling` dict; returns `(theta or None, mrope_section)`."""
    for key, value in rope.items():
        if key not in _ROPE_KEYS:
            raise UnsupportedConfigError(f"{scope}.{key}", value, "RoPE scaling parameters are not implemented")
    for key in ("rope_type", "type"):
        if rope.get(key, "default") not in ("default", "mrope"):
            raise UnsupportedConfigError(f"{scope}.{key}", rope[key], "only 'default' and 'mrope' RoPE are implemented")
    if rope.get("factor", 1.0) != 1.0:
        raise UnsupportedConfigError(f"{scope}.factor", rope["factor"], "RoPE scaling is not implemented")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedConfigError(f"{scope}.partial_rotary_factor", rope["partial_rotary_factor"],
                                     "partial rotary embeddings are not implemented")
    if rope.get("mrope_interleaved"):
        raise UnsupportedConfigError(f"{scope}.mrope_interleaved", rope["mrope_interleaved"],
                                     "interleaved mrope (Qwen3-Omni) is not implemented")
    section = rope.get("mrope_section")
    if section is not None and not isinstance(section, list):
        raise ConfigError(f"{scope}.mrope_section must be a list of 3 integers, got {section!r}")
    return rope.get("rope_theta"), (None if section is None else tuple(section))  # ranges: `validate_config`


def model_type_for(hf_config: Mapping[str, Any]) -> str:
    """The omnijax model type of a parsed Hugging Face config."""
    return layout_of(hf_config).model_type


def check_math(text: Mapping[str, Any], scope: str, layout: HfLayout) -> None:
    """Refuses attributes that change the decoder's math and are not implemented."""
    act = text.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedConfigError(f"{scope}.hidden_act", act, "only the SiLU-gated MLP is implemented")
    if text.get("use_sliding_window"):
        raise UnsupportedConfigError(f"{scope}.use_sliding_window", text["use_sliding_window"],
                                     "sliding-window attention is not implemented")
    for i, kind in enumerate(text.get("layer_types") or ()):
        if kind != "full_attention":
            raise UnsupportedConfigError(f"{scope}.layer_types[{i}]", kind, "only full attention is implemented")
    if layout.qk_norm:
        if text.get("attention_bias"):
            raise UnsupportedConfigError(f"{scope}.attention_bias", text["attention_bias"],
                                         "Qwen3 attention biases (including o_proj) are not implemented")
    elif layout.strict_biases and "attention_bias" in text and text["attention_bias"] is not True:
        raise UnsupportedConfigError(f"{scope}.attention_bias", text["attention_bias"],
                                     "Qwen2 attention has q/k/v biases; other layouts are not implemented")
    if text.get("mlp_bias"):
        raise UnsupportedConfigError(f"{scope}.mlp_bias", text["mlp_bias"], "MLP biases are not implemented")
    if text.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedConfigError(f"{scope}.partial_rotary_factor", text["partial_rotary_factor"],
                                     "partial rotary embeddings are not implemented")
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "logits_scaling", "embedding_multiplier"):
        if text.get(key) is not None:
            raise UnsupportedConfigError(f"{scope}.{key}", text[key], "not implemented by the Qwen2 decoder")


def config_from_hf(hf_config: Mapping[str, Any], *, dtype: str = "float32") -> DecoderConfig:
    """Builds the decoder config of a Qwen2.5-Omni thinker (or of a plain Qwen2 / Qwen3 LLM).

    Args:
        hf_config: a parsed `config.json`: the full model (`model_type` "qwen2_5_omni", text settings under
            `thinker_config.text_config`), the thinker alone ("qwen2_5_omni_thinker", under `text_config`), or a
            plain "qwen2" / "qwen3" LLM (top-level settings; 1D RoPE, Qwen3 with q/k norm and no biases).
            RoPE settings may use the current `rope_parameters` dict or the legacy `rope_scaling` dict plus a
            `rope_theta` attribute.
        dtype: parameter and compute dtype of the converted model ("float32" or "bfloat16").

    Returns:
        The `DecoderConfig`. `tie_embeddings` reflects the config's flag only; `convert_params` settles it from the
        tensors present.

    Raises:
        UnsupportedConfigError: an attribute changes the math in a way the decoder does not implement (the talker's
            and Token2Wav's of a full release with audio output included: `speech_configs`).
        ConfigError: a required attribute is missing or the values are inconsistent.
    """
    text, scope, tie = _text_config(hf_config)
    layout = layout_of(hf_config)
    check_math(text, scope, layout)
    theta, section = None, None
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise ConfigError(f"{scope}.{key} must be an object, got {rope!r}")
        t, s = parse_rope(rope, f"{scope}.{key}")
        if (theta is not None and t is not None and t != theta) or (section and s and s != section):
            raise ConfigError(f"{scope}.rope_parameters and {scope}.rope_scaling disagree")
        theta, section = theta if theta is not None else t, section or s
    if theta is None:
        theta = text.get("rope_theta")
    if theta is None:
        raise ConfigError(f"{scope} sets no rope_theta (neither in rope_parameters nor as an attribute)")
    if section is None and layout.tmrope:
        raise ConfigError(f"{scope} sets no mrope_section: the Qwen2.5-Omni thinker needs 3-axis TMRoPE")

    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if text.get(k) is None]
    if missing:
        raise ConfigError(f"{scope} lacks required attribute(s) {missing}")
    heads, vocab = text["num_attention_heads"], text["vocab_size"]
    try:
        config = validate_config(DecoderConfig(
            vocab_size=vocab,
            hidden_size=text["hidden_size"],
            intermediate_size=text["intermediate_size"],
            num_layers=text["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf_value(text, "num_key_value_heads", heads),
            head_dim=hf_value(text, "head_dim", default_head_dim(text["hidden_size"], heads)),
            rope_theta=theta,
            mrope_section=section,
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            qkv_bias=not layout.qk_norm,
            qk_norm=layout.qk_norm,
            tie_embeddings=bool(tie),
            dtype=dtype,
            eos_token_ids=default_eos(vocab),
        ), hf_token_ids(text))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{scope}: {e}") from e
    if has_speech_output(hf_config):  # the speech output's settings too, so the converter's first step refuses them
        speech_configs(hf_config, config.hidden_size, dtype)
    return config


def default_eos(vocab_size: Any) -> tuple[int, ...]:
    """The release's `<|im_end|>` as the end of an answer, when a vocabulary of `vocab_size` holds it."""
    return (IM_END_TOKEN_ID,) if isinstance(vocab_size, int) and vocab_size > IM_END_TOKEN_ID else ()


# ------------------------------------------------------------------------------------------------------ name table


# -------------------------------------------------------------------------------------------------- speech output

# Talker config attributes with no effect on what omnijax computes: training / bookkeeping, the end markers and the
# audio-in-video chunking (its `get_rope_index` never reads the end markers; `speech.speak` refuses videos).
_TALKER_INERT = HF_PRETRAINED_CONFIG_ATTRIBUTES | frozenset("""
    max_position_embeddings use_cache attention_dropout sliding_window max_window_layers
    seconds_per_chunk audio_end_token_id vision_end_token_id
""".split())
_TALKER_READ = frozenset("""
    vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim
    hidden_act rms_norm_eps rope_parameters rope_scaling rope_theta use_sliding_window layer_types embedding_size
    attention_bias mlp_bias tts_text_start_token_id tts_text_end_token_id tts_text_pad_token_id
    tts_codec_start_token_id tts_codec_end_token_id tts_codec_pad_token_id tts_codec_mask_token_id
    audio_token_index image_token_index video_token_index audio_start_token_id vision_start_token_id
    spatial_merge_size position_id_per_seconds
""".split())
_TALKER_IDS = {"codec_bos_id": "tts_codec_start_token_id", "codec_eos_id": "tts_codec_end_token_id",
               "codec_pad_id": "tts_codec_pad_token_id", "codec_mask_id": "tts_codec_mask_token_id",
               "text_bos_id": "tts_text_start_token_id", "text_eos_id": "tts_text_end_token_id",
               "text_pad_id": "tts_text_pad_token_id", "audio_token_id": "audio_token_index",
               "image_token_id": "image_token_index", "video_token_id": "video_token_index",
               "audio_start_token_id": "audio_start_token_id", "vision_start_token_id": "vision_start_token_id",
               "spatial_merge_size": "spatial_merge_size", "position_id_per_seconds": "position_id_per_seconds"}


def has_speech_output(hf_config: Mapping[str, Any]) -> bool:
    """A full Qwen2.5-Omni config with audio output: `enable_audio_output` true, or not set (transformers' default)
    beside a `talker_config` or `token2wav_config`. A full config with neither of those and no
    `enable_audio_output` (a hand-written thinker config in the full layout) has none, like thinker-only configs and
    plain LLMs; its `talker.*` / `token2wav.*` tensors, if any, are skipped with a message."""
    if hf_config.get("model_type") != "qwen2_5_omni" or hf_config.get("enable_audio_output", True) is False:
        return False
    return "enable_audio_output" in hf_config or any(key in hf_config for key in ("talker_config", "token2wav_config"))


def talker_config_from_hf(talker: Mapping[str, Any], *, dtype: str = "float32") -> TalkerConfig:
    """The `TalkerConfig` of a Hugging Face `Qwen2_5OmniTalkerConfig` (a dict), refusing what the decoder lacks.

    Raises:
        UnsupportedConfigError: an attribute not understood, or one that changes the math unimplemented.
        ConfigError: missing or inconsistent values.
    """
    scope = "talker_config"
    unknown = sorted(k for k in talker if k not in _TALKER_READ and k not in _TALKER_INERT)
    if unknown:
        raise UnsupportedConfigError(f"{scope}.{unknown[0]}", talker[unknown[0]],
                                     f"not understood by the omnijax talker (refusing to guess its effect); unknown "
                                     f"attributes: {unknown}")
    if talker.get("tie_word_embeddings"):
        raise UnsupportedConfigError(f"{scope}.tie_word_embeddings", True, "the talker's codec head is its own tensor")
    check_math(talker, scope, HfLayout("qwen2_5_omni", "", tmrope=True, strict_biases=True))
    rope = talker.get("rope_parameters") or talker.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{scope}.rope_parameters must be an object, got {rope!r}")
    theta, section = parse_rope(rope, f"{scope}.rope_parameters")
    theta = theta if theta is not None else talker.get("rope_theta", 1e6)
    if section is None:
        raise ConfigError(f"{scope} sets no rope_parameters.mrope_section: the talker's attention needs 3-axis TMRoPE")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "embedding_size") if talker.get(k) is None]
    if missing:
        raise ConfigError(f"{scope} lacks required attribute(s) {missing}")
    heads, hidden = talker["num_attention_heads"], talker["hidden_size"]
    ids = {field: talker[key] for field, key in _TALKER_IDS.items() if talker.get(key) is not None}
    try:
        decoder = validate_config(DecoderConfig(
            vocab_size=talker["vocab_size"], hidden_size=hidden, intermediate_size=talker["intermediate_size"],
            num_layers=talker["num_hidden_layers"], num_heads=heads,
            num_kv_heads=hf_value(talker, "num_key_value_heads", heads),
            head_dim=hf_value(talker, "head_dim", default_head_dim(hidden, heads)), rope_theta=theta,
            mrope_section=section, rms_norm_eps=talker.get("rms_norm_eps", 1e-6), qkv_bias=True, qk_norm=False,
            tie_embeddings=False, dtype=dtype))
        return TalkerConfig(decoder=decoder, embedding_size=talker["embedding_size"], dtype=dtype, **ids)
    except ConvertError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{scope}: {e}") from e


def speech_configs(hf_config: Mapping[str, Any], thinker_hidden_size: int, dtype: str
                   ) -> tuple[TalkerConfig, Token2WavConfig]:
    """The talker's and Token2Wav's configs of a full release with audio output, checked against the thinker.

    Raises:
        UnsupportedConfigError / ConfigError: as `talker_config_from_hf`, `Token2WavConfig.from_hf`, or a talker
            whose input width is not the thinker's, or whose codec ids exceed the DiT's codec table.
    """
    for key in ("talker_config", "token2wav_config"):
        if not isinstance(hf_config.get(key), dict):
            raise ConfigError(f"config enables audio output (enable_audio_output) but has no {key!r} object")
    talker = talker_config_from_hf(hf_config["talker_config"], dtype=dtype)
    try:
        token2wav = Token2WavConfig.from_hf(hf_config["token2wav_config"], dtype=dtype)
    except ConvertError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"token2wav_config: {e}") from e
    if talker.embedding_size != thinker_hidden_size:
        raise UnsupportedConfigError("talker_config.embedding_size", talker.embedding_size,
                                     f"must equal the thinker's hidden_size={thinker_hidden_size} (the talker reads "
                                     "the thinker's rows)")
    return talker, token2wav
