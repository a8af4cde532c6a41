"""Qwen2.5-Omni thinker LLM (and plain Qwen2 / Qwen3 LLMs) -> omnijax decoder conversion.

Three parts:
- `config_from_hf`: the Hugging Face config (full model or thinker only) -> `DecoderConfig`, refusing every
  attribute that would change the math in a way the decoder does not implement.
- `NAME_TABLE`: a declarative map from Hugging Face tensor names to paths of the decoder's pure-dict parameter tree
  (`omnijax/models/decoder.py`), plus the few prefixes that are skipped on purpose.
- `convert_params`: validates the whole checkpoint against the table (names and shapes, from the headers only), then
  fills pre-allocated memory-mapped output arrays tensor by tensor, so resident memory stays near the largest
  single tensor whatever the model size.

Tied embeddings are decided from the tensors present, not from the config alone: `lm_head.weight` present -> a
separate head is loaded (even if a `tie_word_embeddings` flag says tied); absent -> the head is tied to the
embedding, provided the config's flag says so (otherwise the tensor is reported missing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from omnijax.checkpoint import loop as streaming
from omnijax.checkpoint import name_tables as tables
from omnijax.checkpoint.name_tables import Component, Rule
from omnijax.checkpoint.safetensors import SafetensorsCheckpoint
from omnijax.checkpoint.special_tokens import read_special_tokens
from omnijax.errors import ConfigError, ConvertError, MissingTensorError, UnsupportedConfigError
from omnijax.models.config import DecoderConfig, default_head_dim, hf_token_ids, hf_value, validate_config
from omnijax.models.encoders import whisper as audio_lib
from omnijax.models.encoders.common import HF_PRETRAINED_CONFIG_ATTRIBUTES, linear_rules
from omnijax.models.qwen2_5_omni import vision as vision_lib
from omnijax.models.qwen2_5_omni import voices as voices_lib
from omnijax.models.qwen2_5_omni.config import OmniConfig
from omnijax.models.qwen2_5_omni.talker import TALKER_PREFIX, TalkerConfig
from omnijax.models.qwen2_5_omni.token2wav import Token2WavConfig, token2wav_components


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


def _parse_rope(rope: Mapping[str, Any], scope: str) -> tuple[float | None, tuple[int, ...] | None]:
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


def _check_math(text: Mapping[str, Any], scope: str, layout: HfLayout) -> None:
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
    _check_math(text, scope, layout)
    theta, section = None, None
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise ConfigError(f"{scope}.{key} must be an object, got {rope!r}")
        t, s = _parse_rope(rope, f"{scope}.{key}")
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


_L = "model.layers.{i}."
NAME_TABLE: tuple[Rule, ...] = (
    Rule("model.embed_tokens.weight", "embed", "V D"),
    Rule(_L + "input_layernorm.weight", "layers/input_norm", "D"),
    Rule(_L + "post_attention_layernorm.weight", "layers/post_norm", "D"),
    Rule(_L + "self_attn.q_proj.weight", "layers/q_proj", "D Q", transform="T"),
    Rule(_L + "self_attn.q_proj.bias", "layers/q_bias", "Q", when="qkv_bias"),
    Rule(_L + "self_attn.k_proj.weight", "layers/k_proj", "D K", transform="T"),
    Rule(_L + "self_attn.k_proj.bias", "layers/k_bias", "K", when="qkv_bias"),
    Rule(_L + "self_attn.v_proj.weight", "layers/v_proj", "D K", transform="T"),
    Rule(_L + "self_attn.v_proj.bias", "layers/v_bias", "K", when="qkv_bias"),
    Rule(_L + "self_attn.o_proj.weight", "layers/o_proj", "Q D", transform="T"),
    Rule(_L + "self_attn.q_norm.weight", "layers/q_norm", "d", when="qk_norm"),
    Rule(_L + "self_attn.k_norm.weight", "layers/k_norm", "d", when="qk_norm"),
    Rule(_L + "mlp.gate_proj.weight", "layers/gate_proj", "D I", transform="T", layers="dense", when="dense_mlp"),
    Rule(_L + "mlp.up_proj.weight", "layers/up_proj", "D I", transform="T", layers="dense", when="dense_mlp"),
    Rule(_L + "mlp.down_proj.weight", "layers/down_proj", "I D", transform="T", layers="dense", when="dense_mlp"),
    # Qwen3-MoE layers (`DecoderConfig.sparse_layers`): the router and each expert's SwiGLU, stacked [Lm, E, ...].
    Rule(_L + "mlp.gate.weight", "layers/router", "D E", transform="T", layers="sparse", when="moe"),
    *(Rule(_L + f"mlp.experts.{{e}}.{name}_proj.weight", f"layers/expert_{name}", dims, transform="T",
           layers="sparse", when="moe") for name, dims in (("gate", "D Ie"), ("up", "D Ie"), ("down", "Ie D"))),
    Rule("model.norm.weight", "final_norm", "D"),
    Rule("lm_head.weight", "lm_head", "D V", transform="T", when="untied"),
)
THINKER_PREFIX = "thinker."
# Speech output (talker LM and token-to-waveform vocoder): converted from a full release with audio output
# (`speech_configs`), skipped (and logged) from a config that sets enable_audio_output false.
SPEECH_OUTPUT_PREFIXES = ("talker.", "token2wav.")


def _unused_tensors() -> tuple[str, ...]:
    """Tensors present in releases that the model never reads."""
    return tuple("audio_tower." + name for name in audio_lib.UNUSED_HF_TENSORS)


def _thinker_config(hf_config: Mapping[str, Any]) -> Mapping[str, Any]:
    return hf_config.get("thinker_config", {}) if hf_config.get("model_type") == "qwen2_5_omni" else hf_config


def encoder_components(hf_config: Mapping[str, Any], dtype: str) -> dict[str, tuple[Component, dict]]:
    """The encoder components a Qwen2.5-Omni config declares: name -> (component, JSON config)."""
    if model_type_for(hf_config) != "qwen2_5_omni":
        return {}
    return read_encoders(_thinker_config(hf_config), dtype, (
        ("audio", "audio_config", audio_lib.AudioConfig, audio_lib.audio_component),
        ("vision", "vision_config", vision_lib.VisionConfig, vision_lib.vision_component)))


def read_encoders(thinker: Mapping[str, Any], dtype: str,
                  encoders: Iterable[tuple[str, str, Any, Callable[[Any], Any]]]) -> dict[str, tuple[Any, dict]]:
    """The encoders a thinker config declares: for each `(name, config key, config class, tables)` whose key is
    set, name -> (`tables(config)`, the config as JSON); inconsistent values become `ConfigError`s naming the key."""
    out = {}
    for name, key, config_cls, tables_of in encoders:
        if thinker.get(key) is None:
            continue
        try:
            config = config_cls.from_hf(thinker[key], dtype=dtype)
        except ConvertError:
            raise
        except ValueError as e:  # inconsistent values
            raise ConfigError(f"{key}: {e}") from e
        out[name] = (tables_of(config), config.to_json())
    return out


def decoder_component(config: DecoderConfig) -> Component:
    """The decoder's conversion table with its sizes (`Component.name` "decoder")."""
    c = config
    dims = {"V": c.vocab_size, "D": c.hidden_size, "I": c.intermediate_size, "d": c.head_dim,
            "Q": c.num_heads * c.head_dim, "K": c.num_kv_heads * c.head_dim, "E": c.num_experts,
            "Ie": c.moe_intermediate_size}
    sparse = c.sparse_layers
    layer_sets = {"dense": tuple(i for i, s in enumerate(sparse) if not s),
                  "sparse": tuple(i for i, s in enumerate(sparse) if s)}
    flags = {"qkv_bias": c.qkv_bias, "qk_norm": c.qk_norm, "untied": not c.tie_embeddings,
             "dense_mlp": bool(layer_sets["dense"]), "moe": bool(layer_sets["sparse"])}
    return Component(name="decoder", prefix="", rules=NAME_TABLE, dims=dims, num_layers=c.num_layers, flags=flags,
                     layer_sets=layer_sets, num_experts=c.num_experts)


def param_shapes(config: DecoderConfig) -> dict[str, Any]:
    """The decoder's pure-dict parameter tree as nested dicts of shape tuples (layer params lead with `L`)."""
    return tables.param_shapes(decoder_component(config))


# -------------------------------------------------------------------------------------------------- speech output

# Talker config attributes with no effect on what omnijax computes: training / bookkeeping, and the multimodal
# position settings (`speech.speak` refuses prompts with placeholders, whose positions they would set).
_TALKER_INERT = HF_PRETRAINED_CONFIG_ATTRIBUTES | frozenset("""
    max_position_embeddings use_cache attention_dropout sliding_window max_window_layers position_id_per_seconds
    seconds_per_chunk audio_start_token_id audio_end_token_id vision_start_token_id vision_end_token_id
    spatial_merge_size
""".split())
_TALKER_READ = frozenset("""
    vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim
    hidden_act rms_norm_eps rope_parameters rope_scaling rope_theta use_sliding_window layer_types embedding_size
    attention_bias mlp_bias tts_text_start_token_id tts_text_end_token_id tts_text_pad_token_id
    tts_codec_start_token_id tts_codec_end_token_id tts_codec_pad_token_id tts_codec_mask_token_id
    audio_token_index image_token_index video_token_index
""".split())
_TALKER_IDS = {"codec_bos_id": "tts_codec_start_token_id", "codec_eos_id": "tts_codec_end_token_id",
               "codec_pad_id": "tts_codec_pad_token_id", "codec_mask_id": "tts_codec_mask_token_id",
               "text_bos_id": "tts_text_start_token_id", "text_eos_id": "tts_text_end_token_id",
               "text_pad_id": "tts_text_pad_token_id", "audio_token_id": "audio_token_index",
               "image_token_id": "image_token_index", "video_token_id": "video_token_index"}


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
    _check_math(talker, scope, HfLayout("qwen2_5_omni", "", tmrope=True, strict_biases=True))
    rope = talker.get("rope_parameters") or talker.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{scope}.rope_parameters must be an object, got {rope!r}")
    theta, section = _parse_rope(rope, f"{scope}.rope_parameters")
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


def talker_component(config: TalkerConfig) -> Component:
    """The talker's conversion table (prefix `talker.`, tree "talker"): the thinker's layer rules (`NAME_TABLE`),
    the codec embedding at the thinker's width, `thinker_to_talker_proj` and the codec head (transposed)."""
    c = config.decoder
    rules = [r for r in NAME_TABLE if r.hf_name not in ("model.embed_tokens.weight", "lm_head.weight")]
    rules += [Rule("model.embed_tokens.weight", "codec_embedding", "V Dt"),
              *linear_rules("thinker_to_talker_proj", "proj", "proj_bias", "Dt D"),
              *linear_rules("codec_head", "codec_head", None, "D V")]
    base = decoder_component(c)
    return Component(name="talker", prefix=TALKER_PREFIX, rules=tuple(rules),
                     dims={**base.dims, "Dt": config.embedding_size}, num_layers=c.num_layers, flags=base.flags,
                     layer_sets=base.layer_sets)


# ------------------------------------------------------------------------------------------------------ conversion


def convert_params(ckpt: SafetensorsCheckpoint, hf_config: Mapping[str, Any], *, dtype: str, staging_dir: Path,
                   progress: bool = True, log: Callable[[str], None] = streaming.stderr
                   ) -> tuple[DecoderConfig, dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Converts the thinker LLM's weights into memory-mapped arrays in the decoder's layout.

    Args:
        ckpt: the validated source checkpoint.
        hf_config: its parsed `config.json`.
        dtype: target dtype, "float32" or "bfloat16" (float32 sources cast with round-to-nearest-even).
        staging_dir: directory for the output arrays' memory-mapped files (created; the caller deletes it).
        progress: show a tqdm bar over tensors on stderr.
        log: receives the one-line summaries of skipped tensors.

    Returns:
        `(config, params, source_info, extras)`: the final `DecoderConfig`, the decoder's pure-dict tree of
        `np.memmap` arrays, a JSON-serialisable summary for the manifest, and the other checkpoint components as
        name -> (JSON config, tree or None): the encoders, and the thinker's token ids and TMRoPE timing ("omni").
    """
    config = config_from_hf(hf_config, dtype=dtype)
    # Special ids: the thinker config's, else the tokenizer's added tokens, else the release's. The answer ends at
    # the checkpoint's <|im_end|> (a generation_config.json eos_token_id, read by `convert_checkpoint`, wins).
    special = read_special_tokens(ckpt.directory)
    omni = OmniConfig.from_hf(_thinker_config(hf_config), special) if model_type_for(hf_config) == "qwen2_5_omni" \
        else None
    im_end = omni.im_end_token_id if omni is not None else special.get("<|im_end|>", IM_END_TOKEN_ID)
    config = config.replace(eos_token_ids=(im_end,) if 0 <= im_end < config.vocab_size else ())
    names = ckpt.names()
    has_head = any(n.removeprefix(THINKER_PREFIX) == "lm_head.weight" for n in names)
    if not has_head and not config.tie_embeddings:
        raise MissingTensorError("checkpoint lacks tensor 'lm_head.weight' and the config does not tie embeddings")
    config = config.replace(tie_embeddings=not has_head)
    encoders = encoder_components(hf_config, dtype)
    components = [decoder_component(config)] + [component for component, _ in encoders.values()]
    speech = speech_configs(hf_config, config.hidden_size, dtype) if has_speech_output(hf_config) else None
    voices = voices_lib.read_release_voices(ckpt.directory) if speech is not None else None
    if speech is not None:
        for prefix in SPEECH_OUTPUT_PREFIXES:
            if not any(n.startswith(prefix) for n in names):
                raise MissingTensorError(f"the config enables audio output (enable_audio_output, the default) but "
                                         f"the checkpoint has no {prefix}* tensors; a release without speech output "
                                         "sets enable_audio_output false")
        components += [talker_component(speech[0]), *token2wav_components(speech[1])]
    skipped_speech = () if speech is not None else SPEECH_OUTPUT_PREFIXES
    trees, plan, source_dtypes = streaming.convert_components(
        ckpt, components, dtype=dtype, staging_dir=staging_dir, strip_prefix=THINKER_PREFIX,
        skip_prefixes=skipped_speech + _unused_tensors(), progress=progress)
    streaming.log_skipped(plan.skipped, skipped_speech, log)
    source_info = {
        "tensors_converted": len(plan.assign),
        "source_dtypes": dict(sorted(source_dtypes.items())),
        "skipped": plan.skipped,
        "encoders_converted": sorted(encoders),
        "speech_output": speech is not None,
        "lm_head": "tied to embed" if config.tie_embeddings else "lm_head.weight",
    }
    extras = {name: (encoder_config, trees[name]) for name, (_, encoder_config) in encoders.items()}
    if omni is not None:
        extras["omni"] = (omni.to_json(), None)
    if speech is not None and voices is not None:
        talker, token2wav = speech
        extras["talker"] = (talker.to_json(), trees["talker"])
        extras["token2wav"] = ({"dit": token2wav.dit.to_json(), "bigvgan": token2wav.bigvgan.to_json()},
                               {"dit": trees["dit"], "bigvgan": trees["bigvgan"]})
        extras["speech"] = voices_lib.voices_to_component(voices)
    return config, trees["decoder"], source_info, extras
