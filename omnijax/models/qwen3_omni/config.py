"""The Qwen3-Omni thinker's modality token ids and M-RoPE timing (`Qwen3OmniConfig`), as a checkpoint records them."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Union

import numpy as np

from omnijax._checks import JsonConfig


def count_field(value: Any, name: str, minimum: int = 1) -> int:
    """`value` as an int >= `minimum`; anything else (a bool, a fraction, a smaller number) refused naming `name`."""
    if isinstance(value, (bool, np.bool_)) or int(value) != value or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class Qwen3OmniConfig(JsonConfig):
    """Token ids of the modality groups and the M-RoPE timing of the Qwen3-Omni thinker.

    Defaults are the Qwen3-Omni-30B-A3B release's thinker config (transformers' own class defaults differ: audio
    151646, audio_start 151647, 25 ids per second).

    Attributes:
        audio_token_id, image_token_id, video_token_id: placeholders (`<|audio_pad|>`, `<|image_pad|>`,
            `<|video_pad|>`) replaced by encoder outputs.
        vision_start_token_id, vision_end_token_id: `<|vision_start|>`, `<|vision_end|>`.
        audio_start_token_id, audio_end_token_id: `<|audio_start|>`, `<|audio_end|>`.
        im_start_token_id, im_end_token_id: the chat markers `<|im_start|>`, `<|im_end|>` (BOUNDARY spans).
        position_id_per_seconds: temporal ids per second of media (13).
        spatial_merge_size: patches merged per side into one LLM token (2).
    """

    audio_token_id: int = 151675
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    audio_start_token_id: int = 151669
    audio_end_token_id: int = 151670
    im_start_token_id: int = 151644
    im_end_token_id: int = 151645
    position_id_per_seconds: Union[int, float] = 13
    spatial_merge_size: int = 2

    def __post_init__(self):
        ids = [getattr(self, f.name) for f in dataclasses.fields(self) if f.name.endswith("_token_id")]
        if len(set(ids)) != len(ids):
            raise ValueError(f"Qwen3OmniConfig token ids must be distinct, got {ids}")
        if not self.position_id_per_seconds > 0:
            raise ValueError(f"position_id_per_seconds must be positive, got {self.position_id_per_seconds!r}")
        count_field(self.spatial_merge_size, "spatial_merge_size", minimum=1)

    @classmethod
    def from_hf(cls, thinker_config: Mapping[str, Any]) -> "Qwen3OmniConfig":
        """Reads a Hugging Face thinker config dict (or a full config holding `thinker_config`); keys it lacks keep
        the release defaults. `spatial_merge_size` comes from `vision_config`. A token id or merge size that is not
        a whole number (e.g. 151675.5) is refused naming the key, not truncated."""
        cfg = thinker_config.get("thinker_config") or thinker_config
        values = {f.name: cfg[f.name] for f in dataclasses.fields(cls)
                  if f.name != "spatial_merge_size" and cfg.get(f.name) is not None}
        merge = (cfg.get("vision_config") or {}).get("spatial_merge_size", cfg.get("spatial_merge_size"))
        if merge is not None:
            values["spatial_merge_size"] = merge
        return cls(**{k: v if k == "position_id_per_seconds" else count_field(v, f"thinker config {k}", minimum=0)
                      for k, v in values.items()})

    @property
    def placeholder_ids(self) -> frozenset[int]:
        """The ids encoder features replace: audio, image and video placeholders."""
        return frozenset({self.audio_token_id, self.image_token_id, self.video_token_id})

    @property
    def boundary_ids(self) -> frozenset[int]:
        """Start and end markers of the modality groups and the chat markers."""
        return frozenset({self.vision_start_token_id, self.vision_end_token_id, self.audio_start_token_id,
                          self.audio_end_token_id, self.im_start_token_id, self.im_end_token_id})
