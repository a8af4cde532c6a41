"""Qwen2.5-Omni thinker settings beyond the decoder: placeholder token ids and TMRoPE timing."""

from __future__ import annotations

import dataclasses
from typing import Any

from omnijax.config import JsonConfig


@dataclasses.dataclass(frozen=True)
class OmniConfig(JsonConfig):
    """Token ids of the multimodal placeholders and markers, and the TMRoPE time scale.

    Attributes:
        audio_token_id, image_token_id, video_token_id: placeholder ids replaced by encoder outputs.
        audio_start_token_id, audio_end_token_id: `<|audio_bos|>`, `<|audio_eos|>`.
        vision_start_token_id, vision_end_token_id: `<|vision_bos|>`, `<|vision_eos|>`.
        position_id_per_seconds: temporal position ids per second of media (25).
        seconds_per_chunk: audio-in-video interleaving chunk length in seconds (2).
    """

    audio_token_id: int = 151646
    image_token_id: int = 151655
    video_token_id: int = 151656
    audio_start_token_id: int = 151647
    audio_end_token_id: int = 151648
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    position_id_per_seconds: int = 25
    seconds_per_chunk: int = 2

    @classmethod
    def from_hf(cls, thinker_config: dict[str, Any]) -> "OmniConfig":
        """Reads the ids a Hugging Face thinker config sets (unset ones keep the release's values)."""
        spelling = {"audio_token_id": "audio_token_index", "image_token_id": "image_token_index",
                    "video_token_id": "video_token_index"}
        values = {}
        for field in dataclasses.fields(cls):
            for key in (field.name, spelling.get(field.name)):
                if key and thinker_config.get(key) is not None:
                    values[field.name] = int(thinker_config[key])
                    break
        return cls(**values)
