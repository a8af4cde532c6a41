"""MiniCPM-o 4.5 checkpoints (`model_type` "minicpmo"): the Qwen3 LLM under `llm.`, the SigLIP vision encoder
(`vpm.`) and resampler (`resampler.`), the Whisper audio encoder (`apm.`) and its projector
(`audio_projection_layer.`); the speech-output model (`tts.`) is skipped with a message.

The LLM is the foundation decoder in Qwen3 mode (q/k RMSNorm, no attention biases, 1D RoPE), read with the same
name table as the Qwen checkpoints (`convert.qwen2_5_omni.NAME_TABLE`) under the `llm.` prefix.
"""

from __future__ import annotations

from typing import Any, Mapping

from convert import qwen2_5_omni as qwen
from convert.errors import ConfigError
from convert.tables import Component
from omnijax.config import DecoderConfig

HF_MODEL_TYPES = ("minicpmo",)
LLM_PREFIX = "llm."
SPEECH_OUTPUT_PREFIXES = ("tts.",)
IM_END = "<|im_end|>"


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
    config = qwen.config_from_hf(llm, dtype=dtype)
    eos = hf_config.get("eos_token_id")
    eos = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return config.replace(eos_token_ids=tuple(e for e in eos if e < config.vocab_size))


def decoder_component(config: DecoderConfig) -> Component:
    """The LLM's conversion table under `llm.`."""
    base = qwen.decoder_component(config)
    return Component(name="decoder", prefix=LLM_PREFIX, rules=base.rules, dims=base.dims,
                     num_layers=base.num_layers, flags=base.flags)
