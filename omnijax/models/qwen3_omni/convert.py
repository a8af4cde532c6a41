"""Qwen3-Omni (Qwen3-Omni-30B-A3B and its family) thinker and speech output -> omnijax conversion.

Accepted checkpoints: the full model (`model_type` "qwen3_omni_moe": tensors under `thinker.`, speech output under
`talker.` and `code2wav.`) or the thinker alone ("qwen3_omni_moe_thinker"), single-file or sharded. A full model's
speech output (talker with its code predictor, Code2Wav: `talker.talker_components`, `code2wav.code2wav_component`)
becomes the checkpoint's "talker" and "code2wav" components, with their configs and the thinker-side ids it reads
(the manifest's "speech" entry, `speech.SpeechTokens`), validated with the thinker's tables from the headers before
any tensor is read; a full config with `enable_audio_output` false converts the thinker only (speech tensors, if
any, skipped with a message).

The thinker's LLM is a Qwen3-MoE decoder (`omnijax.models.decoder` with experts): q/k RMSNorm, no attention biases,
interleaved mrope, MoE layers where `mlp_only_layers` / `decoder_sparse_step` say so, each expert's tensors
(`mlp.experts.{e}.{gate,up,down}_proj.weight`, one per expert as releases save them) stacked `[Lm, E, ...]`. The
encoders (Qwen3-VL vision with DeepStack mergers, the AuT audio encoder) are converted when the config declares
them; the placeholder ids and the position rate go into the manifest's "qwen3_omni" entry.

A config attribute that changes the math in a way omnijax does not implement (another router, shared experts, RoPE
scaling, sliding windows, attention biases) is refused before any tensor is read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from omnijax.checkpoint import loop as streaming
from omnijax.checkpoint.name_tables import Component
from omnijax.checkpoint.safetensors import SafetensorsCheckpoint
from omnijax.checkpoint.special_tokens import read_special_tokens
from omnijax.errors import ConfigError, MissingTensorError, UnsupportedConfigError
from omnijax.models.config import DecoderConfig, default_head_dim, hf_token_ids, hf_value, validate_config
from omnijax.models.encoders.common import HF_PRETRAINED_CONFIG_ATTRIBUTES
from omnijax.models.qwen2_5_omni import convert as shared
from omnijax.models.qwen3_omni import audio as audio_lib
from omnijax.models.qwen3_omni import speech as speech_lib
from omnijax.models.qwen3_omni import vision as vision_lib
from omnijax.models.qwen3_omni.code2wav import code2wav_component
from omnijax.models.qwen3_omni.config import Qwen3OmniConfig
from omnijax.models.qwen3_omni.talker import talker_components

OMNIJAX_MODEL_TYPES = {"qwen3_omni_moe": "qwen3_omni", "qwen3_omni_moe_thinker": "qwen3_omni"}
HF_MODEL_TYPES = tuple(OMNIJAX_MODEL_TYPES)
THINKER_PREFIX = "thinker."
SPEECH_OUTPUT_PREFIXES = ("talker.", "code2wav.")
IM_END_TOKEN_ID = shared.IM_END_TOKEN_ID

# Text-config attributes that do not change the forward (training-only or bookkeeping), and those the decoder reads.
_INERT = {"output_router_logits", "router_aux_loss_coef", "initializer_range", "use_cache", "attention_dropout",
          "max_position_embeddings", "model_type", "pad_token_id", "bos_token_id", "eos_token_id", "torch_dtype",
          "dtype", "transformers_version", "architectures", "tie_word_embeddings", "max_window_layers",
          "use_sliding_window", "sliding_window", "layer_types", "hidden_act", "attention_bias", "mlp_bias",
          "rope_scaling", "rope_theta", "rope_parameters"}
_READ = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "rms_norm_eps", "num_experts", "num_experts_per_tok",
         "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step", "use_qk_norm"}
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "mrope_section", "interleaved", "mrope_interleaved"}


def model_type_for(hf_config: Mapping[str, Any]) -> str:
    """The omnijax model type of a parsed Hugging Face config."""
    return OMNIJAX_MODEL_TYPES[hf_config.get("model_type")]


def thinker_config(hf_config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The thinker's config of a full or thinker-only config."""
    if hf_config.get("model_type") == "qwen3_omni_moe":
        thinker = hf_config.get("thinker_config")
        if not isinstance(thinker, dict):
            raise ConfigError("qwen3_omni_moe config has no 'thinker_config' object")
        return thinker
    return hf_config


def _scope(hf_config: Mapping[str, Any]) -> str:
    return "thinker_config.text_config" if hf_config.get("model_type") == "qwen3_omni_moe" else "text_config"


def _check_text(text: Mapping[str, Any], scope: str) -> None:
    """Refuses every text-config attribute that would change the math and is not implemented."""
    for key, value in text.items():
        if key not in _INERT | _READ | HF_PRETRAINED_CONFIG_ATTRIBUTES and value not in (None, False, 0, [], {}, ""):
            raise UnsupportedConfigError(f"{scope}.{key}", value, "not implemented by the Qwen3-MoE decoder")
    if text.get("use_qk_norm", True) is not True:
        raise UnsupportedConfigError(f"{scope}.use_qk_norm", text["use_qk_norm"],
                                     "Qwen3 attention always normalises q and k")
    act = text.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedConfigError(f"{scope}.hidden_act", act, "only the SiLU-gated MLP and experts are implemented")
    for key, what in (("attention_bias", "attention biases"), ("mlp_bias", "MLP biases"),
                      ("use_sliding_window", "sliding-window attention")):
        if text.get(key):
            raise UnsupportedConfigError(f"{scope}.{key}", text[key], f"{what} are not implemented")
    if text.get("sliding_window") is not None and text.get("use_sliding_window"):
        raise UnsupportedConfigError(f"{scope}.sliding_window", text["sliding_window"], "not implemented")
    for i, kind in enumerate(text.get("layer_types") or ()):
        if kind != "full_attention":
            raise UnsupportedConfigError(f"{scope}.layer_types[{i}]", kind, "only full attention is implemented")


def _rope(text: Mapping[str, Any], scope: str) -> tuple[float, tuple[int, int, int]]:
    """`(theta, mrope_section)`; the interleaved layout is what the reference applies whatever its flag says."""
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{scope}.rope_parameters must be an object, got {rope!r}")
    for key, value in rope.items():
        if key not in _ROPE_KEYS:
            raise UnsupportedConfigError(f"{scope}.rope_parameters.{key}", value,
                                         "RoPE scaling parameters are not implemented")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise UnsupportedConfigError(f"{scope}.rope_parameters.rope_type", kind,
                                     "only default (interleaved multimodal) RoPE is implemented")
    theta = rope.get("rope_theta", text.get("rope_theta"))
    if theta is None:
        raise ConfigError(f"{scope} sets no rope_theta")
    section = rope.get("mrope_section", [24, 20, 20])
    if not isinstance(section, list):
        raise ConfigError(f"{scope}.rope_parameters.mrope_section must be a list of 3 integers, got {section!r}")
    return theta, tuple(section)  # their ranges: `omnijax.models.config.check_values`


def config_from_hf(hf_config: Mapping[str, Any], *, dtype: str = "float32") -> DecoderConfig:
    """The decoder config of a Qwen3-Omni thinker; a full config's speech output settings (talker, Code2Wav, their
    ids: `speech.speech_configs`) are checked too, so that the converter's first step refuses them.

    Raises:
        UnsupportedConfigError: an attribute changes the math in a way the decoder does not implement.
        ConfigError: a required attribute is missing or the values are inconsistent.
    """
    config = _decoder_config(hf_config, dtype)
    if speech_lib.has_speech_output(hf_config):
        speech_lib.speech_configs(hf_config, config.hidden_size, dtype)
    return config


def _decoder_config(hf_config: Mapping[str, Any], dtype: str) -> DecoderConfig:
    scope = _scope(hf_config)
    text = thinker_config(hf_config).get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"config has no '{scope}' object")
    _check_text(text, scope)
    theta, section = _rope(text, scope)
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
               if text.get(k) is None]
    if missing:
        raise ConfigError(f"{scope} lacks required attribute(s) {missing}")
    heads, vocab, hidden = text["num_attention_heads"], text["vocab_size"], text["hidden_size"]
    experts = text.get("num_experts") or 0
    try:
        return validate_config(DecoderConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=text.get("intermediate_size") or 0,
            num_layers=text["num_hidden_layers"], num_heads=heads,
            num_kv_heads=hf_value(text, "num_key_value_heads", heads),
            head_dim=hf_value(text, "head_dim", default_head_dim(hidden, heads)), rope_theta=theta,
            mrope_section=section, mrope_interleaved=True, rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            qkv_bias=False, qk_norm=True, tie_embeddings=bool(text.get("tie_word_embeddings", False)), dtype=dtype,
            eos_token_ids=shared.default_eos(vocab),
            num_experts=experts, num_experts_per_tok=hf_value(text, "num_experts_per_tok", 0) if experts else 0,
            moe_intermediate_size=hf_value(text, "moe_intermediate_size", 0) if experts else 0,
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            mlp_only_layers=tuple(text.get("mlp_only_layers") or ()),
            decoder_sparse_step=hf_value(text, "decoder_sparse_step", 1)), hf_token_ids(text))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{scope}: {e}") from e


def speech_components(hf_config: Mapping[str, Any], config: DecoderConfig, dtype: str
                      ) -> tuple[tuple, dict[str, tuple[dict, None]]] | None:
    """The speech output's conversion tables (talker, code predictor, Code2Wav) and its config entries, or None
    without speech output."""
    if not speech_lib.has_speech_output(hf_config):
        return None
    talker, code2wav, tokens = speech_lib.speech_configs(hf_config, config.hidden_size, dtype)
    return (*talker_components(talker), code2wav_component(code2wav)), {
        "talker": (talker.to_json(), None), "code2wav": (code2wav.to_json(), None), "speech": (tokens.to_json(), None)}


def decoder_component(config: DecoderConfig) -> Component:
    """The decoder's conversion table (the shared Qwen-family table with its MoE rules)."""
    return shared.decoder_component(config)


def encoder_components(hf_config: Mapping[str, Any], dtype: str) -> dict[str, tuple[tuple[Component, ...], dict]]:
    """The encoders the thinker config declares: name -> (their conversion tables, JSON config). The vision
    encoder has two tables (its blocks, and the DeepStack mergers stacked by level)."""

    return shared.read_encoders(thinker_config(hf_config), dtype, (
        ("audio", "audio_config", audio_lib.Qwen3AudioConfig, lambda c: (audio_lib.audio_component(c),)),
        ("vision", "vision_config", vision_lib.Qwen3VisionConfig, vision_lib.vision_components)))


# The tokenizer's text of the ids a thinker config may leave out (the config wins where it sets them).
TOKEN_TEXT = {"audio_token_id": "<|audio_pad|>", "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
              "audio_start_token_id": "<|audio_start|>", "audio_end_token_id": "<|audio_end|>",
              "im_start_token_id": "<|im_start|>", "im_end_token_id": "<|im_end|>",
              "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}


def omni_ids(hf_config: Mapping[str, Any], special: Mapping[str, int] | None = None) -> Qwen3OmniConfig:
    """The thinker's placeholder and marker ids and position rate (`Qwen3OmniConfig`): the config's, else the
    tokenizer's (`special`: token text -> id), else the release's."""

    thinker = thinker_config(hf_config)
    ids = Qwen3OmniConfig.from_hf(thinker)
    found = {field: special[text] for field, text in TOKEN_TEXT.items()
             if thinker.get(field) is None and special and text in special}
    try:
        return ids.replace(**found)
    except ValueError as e:
        raise ConfigError(f"thinker token ids: {e}") from e


def convert_params(ckpt: SafetensorsCheckpoint, hf_config: Mapping[str, Any], *, dtype: str, staging_dir: Path,
                   progress: bool = True, log: Callable[[str], None] = streaming.stderr
                   ) -> tuple[DecoderConfig, dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Converts the thinker's weights into memory-mapped arrays (see
    `omnijax.models.qwen2_5_omni.convert.convert_params`).

    Returns:
        `(config, params, source_info, extras)`; extras hold the encoders and the "qwen3_omni" ids and rates.
    """

    config = config_from_hf(hf_config, dtype=dtype)
    special = read_special_tokens(ckpt.directory)
    ids = omni_ids(hf_config, special)
    im_end = ids.im_end_token_id
    config = config.replace(eos_token_ids=(im_end,) if 0 <= im_end < config.vocab_size else ())
    names = ckpt.names()
    has_head = any(n.removeprefix(THINKER_PREFIX) == "lm_head.weight" for n in names)
    if not has_head and not config.tie_embeddings:
        raise MissingTensorError("checkpoint lacks tensor 'lm_head.weight' and the config does not tie embeddings")
    config = config.replace(tie_embeddings=not has_head)
    encoders = encoder_components(hf_config, dtype)
    speech = speech_components(hf_config, config, dtype)
    for prefix in SPEECH_OUTPUT_PREFIXES if speech is not None else ():
        if not any(n.startswith(prefix) for n in names):
            raise MissingTensorError(f"the config enables audio output (enable_audio_output, the default) but the "
                                     f"checkpoint has no {prefix}* tensors; a release without speech output sets "
                                     "enable_audio_output false")
    components = [decoder_component(config)] + [c for tables, _ in encoders.values() for c in tables]
    components += list(speech[0]) if speech is not None else []
    trees, plan, source_dtypes = streaming.convert_components(
        ckpt, components, dtype=dtype, staging_dir=staging_dir, strip_prefix=THINKER_PREFIX,
        skip_prefixes=() if speech is not None else SPEECH_OUTPUT_PREFIXES, progress=progress)
    if plan.skipped:
        counts = ", ".join(f"{p}: {n}" for p, n in sorted(plan.skipped.items()))
        log(f"skipped {sum(plan.skipped.values())} speech-output tensors ({counts}): the config sets "
            "enable_audio_output false, so the speech output is not converted")
    source_info = {"tensors_converted": len(plan.assign), "source_dtypes": dict(sorted(source_dtypes.items())),
                   "skipped": plan.skipped, "encoders_converted": sorted(encoders),
                   "speech_output": speech is not None,
                   "lm_head": "tied to embed" if config.tie_embeddings else "lm_head.weight"}
    extras = {name: (encoder_config, vision_lib.vision_tree(trees) if name == "vision" else trees[name])
              for name, (_, encoder_config) in encoders.items()}
    extras["qwen3_omni"] = (ids.to_json(), None)
    if speech is not None:
        entries = speech[1]
        extras["talker"] = (entries["talker"][0], {**trees["talker"], "code_predictor": trees["code_predictor"]})
        extras["code2wav"] = (entries["code2wav"][0], trees["code2wav"])
        extras["speech"] = entries["speech"]
    return config, trees["decoder"], source_info, extras
