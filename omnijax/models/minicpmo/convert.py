"""MiniCPM-o 4.5 checkpoints (`model_type` "minicpmo"): the Qwen3 LLM under `llm.`, the SigLIP vision encoder
(`vpm.`) and resampler (`resampler.`), the Whisper audio encoder (`apm.`) and its projector
(`audio_projection_layer.`); the speech-output model (`tts.`) is skipped with a message.

The LLM is the foundation decoder in Qwen3 mode (q/k RMSNorm, no attention biases, 1D RoPE), read with the same
name table as the Qwen checkpoints (`omnijax.models.qwen2_5_omni.convert.NAME_TABLE`) under the `llm.` prefix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from omnijax.checkpoint import loop as streaming
from omnijax.checkpoint.name_tables import Component
from omnijax.checkpoint.safetensors import SafetensorsCheckpoint
from omnijax.checkpoint.special_tokens import read_special_tokens
from omnijax.errors import ConfigError, ConvertError, MissingTensorError
from omnijax.models.config import DecoderConfig
from omnijax.models.minicpmo import audio as audio_lib
from omnijax.models.minicpmo import vision as vision_lib
from omnijax.models.minicpmo.model import special_token_texts
from omnijax.models.qwen2_5_omni import convert as qwen

HF_MODEL_TYPES = ("minicpmo",)
LLM_PREFIX = "llm."
SPEECH_OUTPUT_PREFIXES = ("tts.",)


def model_type_for(hf_config: Mapping[str, Any]) -> str:
    return "minicpmo"


def config_from_hf(hf_config: Mapping[str, Any], *, dtype: str = "float32") -> DecoderConfig:
    """The LLM's `DecoderConfig` from a MiniCPM-o 4.5 `config.json` (its LLM settings sit at the top level).

    Raises:
        UnsupportedConfigError: an attribute changes the math in a way the decoder does not implement.
        ConfigError: a required attribute is missing or inconsistent.
    """
    if hf_config.get("model_type") not in HF_MODEL_TYPES:
        raise ConfigError(f"model_type {hf_config.get('model_type')!r} is not MiniCPM-o ({HF_MODEL_TYPES})")
    llm = {k: v for k, v in hf_config.items() if not isinstance(v, dict) or k in ("rope_scaling", "rope_parameters")}
    llm["model_type"] = "qwen3"
    config = qwen.config_from_hf(llm, dtype=dtype)  # checks the values, bos / eos / pad ids included
    eos = hf_config.get("eos_token_id")
    return config.replace(eos_token_ids=() if eos is None else tuple(eos if isinstance(eos, list) else [eos]))


def decoder_component(config: DecoderConfig) -> Component:
    """The LLM's conversion table under `llm.`."""
    return dataclasses.replace(qwen.decoder_component(config), name="decoder", prefix=LLM_PREFIX)


def encoder_components(hf_config: Mapping[str, Any], dtype: str) -> dict[str, tuple[Component, dict]]:
    """The encoder parts a MiniCPM-o config declares: component name -> (component, JSON config)."""
    out = {}
    try:
        if hf_config.get("init_vision", True):
            vision = vision_lib.VisionConfig.from_hf(hf_config, dtype=dtype)
            for component in vision_lib.vision_components(vision):
                out[component.name] = (component, vision.to_json())
        if hf_config.get("init_audio", True):
            audio = audio_lib.AudioConfig.from_hf(hf_config, dtype=dtype)
            for component in audio_lib.audio_components(audio):
                out[component.name] = (component, audio.to_json())
    except ConvertError:
        raise
    except ValueError as e:  # inconsistent sizes
        raise ConfigError(str(e)) from e
    return out


def convert_params(ckpt: SafetensorsCheckpoint, hf_config: Mapping[str, Any], *, dtype: str, staging_dir: Path,
                   progress: bool = True, log: Callable[[str], None] = streaming.stderr
                   ) -> tuple[DecoderConfig, dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Converts a MiniCPM-o 4.5 checkpoint: the LLM, the vision encoder and resampler, the audio encoder and
    projector (the converter's contract: see `omnijax.models.qwen2_5_omni.convert.convert_params`)."""
    config = config_from_hf(hf_config, dtype=dtype)
    if LLM_PREFIX + "lm_head.weight" not in ckpt.names():
        if not config.tie_embeddings:
            raise MissingTensorError("checkpoint lacks tensor 'llm.lm_head.weight' and the config does not tie "
                                     "embeddings")
    else:
        config = config.replace(tie_embeddings=False)
    encoders = encoder_components(hf_config, dtype)
    components = [decoder_component(config)] + [component for component, _ in encoders.values()]
    trees, plan, source_dtypes = streaming.convert_components(
        ckpt, components, dtype=dtype, staging_dir=staging_dir, skip_prefixes=SPEECH_OUTPUT_PREFIXES,
        progress=progress)
    streaming.log_skipped(plan.skipped, SPEECH_OUTPUT_PREFIXES, log)
    source_info = {"tensors_converted": len(plan.assign), "source_dtypes": dict(sorted(source_dtypes.items())),
                   "skipped": plan.skipped, "encoders_converted": sorted(encoders),
                   "lm_head": "tied to embed" if config.tie_embeddings else "llm.lm_head.weight"}
    extras = {name: (encoder_config, trees[name]) for name, (_, encoder_config) in encoders.items()}
    # The tokenizer's ids of the unit and duplex markers (MiniCPM-o's config.json holds none of them).
    special = read_special_tokens(ckpt.directory)
    declared = {text: special[text] for text in special_token_texts() if text in special}
    if declared:
        extras["special_tokens"] = (declared, None)
    return config, trees["decoder"], source_info, extras
