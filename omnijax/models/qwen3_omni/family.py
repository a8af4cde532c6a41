"""The Qwen3-Omni family (Qwen3-Omni-30B-A3B's thinker): the MoE decoder, the AuT audio and Qwen3-VL (DeepStack)
vision encoders, interleaved M-RoPE with audio-synchronised (possibly fractional) time positions."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flax import nnx

from omnijax.checkpoint import format as checkpoint
from omnijax.checkpoint.special_tokens import read_special_tokens
from omnijax.models import family as family_lib
from omnijax.models.config import token_id_fields
from omnijax.models.decoder import Decoder
from omnijax.models.model import Model, restore_module
from omnijax.models.qwen3_omni import audio as audio_lib
from omnijax.models.qwen3_omni import convert, frontend, thinker
from omnijax.models.qwen3_omni import vision as vision_lib
from omnijax.models.qwen3_omni.positions import Qwen3OmniConfig


def load(directory: Path, manifest: Mapping[str, Any], decoder: Decoder, dtype: str | None) -> Model:
    """A Qwen3-Omni thinker with the encoders its checkpoint holds, and its token ids and position rate."""
    encoders = {}
    try:
        if "audio" in manifest:
            encoders["audio"] = restore_module(
                directory, "audio", audio_lib.Qwen3AudioConfig.from_json(manifest["audio"]), dtype,
                lambda c: audio_lib.Qwen3AudioEncoder(c, rngs=nnx.Rngs(0)))
        if "vision" in manifest:
            encoders["vision"] = restore_module(
                directory, "vision", vision_lib.Qwen3VisionConfig.from_json(manifest["vision"]), dtype,
                lambda c: vision_lib.Qwen3VisionEncoder(c, rngs=nnx.Rngs(0)))
        ids = Qwen3OmniConfig.from_json(manifest.get("qwen3_omni", {}))
    except (TypeError, ValueError) as e:
        raise checkpoint.CheckpointFormatError(f"{directory / checkpoint.MANIFEST}: {e}") from e
    return Model(decoder, model_type="qwen3_omni", source=str(directory), omni=ids, **encoders)


def special_token_ids(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The thinker's placeholder and marker ids (the `qwen3_omni` entry; the release's where it is absent, as `load`
    reads it), named `qwen3_omni.<field>`."""
    return token_id_fields("qwen3_omni", Qwen3OmniConfig.from_json(manifest.get("qwen3_omni", {})))


def token_components(hf_config: Mapping[str, Any], directory: Path) -> dict[str, Any]:
    """The `qwen3_omni` entry converting this source writes (`convert.omni_ids`: the thinker config's ids, else its
    tokenizer's, else the release's)."""
    return {"qwen3_omni": convert.omni_ids(hf_config, read_special_tokens(directory)).to_json()}


FAMILY = family_lib.register(family_lib.Family(
    name="qwen3_omni",
    components={"qwen3_omni": ("audio", "vision", "qwen3_omni")},
    converter=convert,
    load=load,
    chat_units=frontend.Qwen3OmniUnits,
    frame_tokens=lambda samples: frontend.num_audio_tokens(samples) + 2,  # audio tokens and the two markers
    frame_unit=frontend.frame_unit,
    fractional_positions=True,
    thinker_inputs=thinker.multimodal_inputs,
    thinker_positions=thinker.rope_index,
    special_token_ids=special_token_ids,
    token_components=token_components,
))
