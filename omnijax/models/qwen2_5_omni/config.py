"""Qwen2.5-Omni thinker settings beyond the decoder: special-token ids and TMRoPE timing.

The defaults are the release's ids; a converted checkpoint stores the ids its own config and tokenizer declare
(`from_hf`), and every chunk builder (`omnijax.models.qwen2_5_omni.layout`, the frontend, the server's frame encoder,
the evaluation harness) takes them from the loaded model's `omni` config.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Mapping

from omnijax._checks import JsonConfig
from omnijax.errors import ConfigValueError


@dataclasses.dataclass(frozen=True)
class OmniConfig(JsonConfig):
    """Token ids of the multimodal placeholders, modality and chat markers, and the TMRoPE time scale.

    Attributes:
        audio_token_id, image_token_id, video_token_id: placeholder ids replaced by encoder outputs.
        audio_start_token_id, audio_end_token_id: `<|audio_bos|>`, `<|audio_eos|>`.
        vision_start_token_id, vision_end_token_id: `<|vision_bos|>`, `<|vision_eos|>`.
        im_start_token_id, im_end_token_id: the chat markers `<|im_start|>`, `<|im_end|>`.
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
    im_start_token_id: int = 151644
    im_end_token_id: int = 151645
    position_id_per_seconds: int = 25
    seconds_per_chunk: int = 2

    @classmethod
    def from_hf(cls, thinker_config: Mapping[str, Any],
                special_tokens: Mapping[str, int] | None = None) -> "OmniConfig":
        """The ids a Hugging Face thinker config sets, else those its tokenizer declares (`special_tokens`: token
        text -> id, e.g. from `omnijax.checkpoint.special_tokens.read_special_tokens`), else the release's.

        The config wins over the tokenizer: transformers' thinker places features and TMRoPE positions by the
        config's ids (`audio_token_index`, `vision_start_token_id`, ...).

        Raises:
            ConfigValueError: a config id that is not an integer (named by its key; the vocabulary range is checked
                with the decoder config, `omnijax.models.config.validate_config`).
        """
        values = {}
        for field in dataclasses.fields(cls):
            for key in (field.name, HF_NAMES.get(field.name)):
                if key and thinker_config.get(key) is not None:
                    value = thinker_config[key]
                    if field.name.endswith("_token_id") and (isinstance(value, bool) or
                                                             not isinstance(value, numbers.Integral)):
                        raise ConfigValueError(key, value, "an integer token id")
                    values[field.name] = int(value)
                    break
            else:
                text = TOKEN_TEXT.get(field.name)
                if text is not None and special_tokens and text in special_tokens:
                    values[field.name] = int(special_tokens[text])
        return cls(**values)

    @property
    def placeholder_ids(self) -> frozenset[int]:
        """`<|AUDIO|>`, `<|IMAGE|>`, `<|VIDEO|>`: the ids encoder features replace."""
        return frozenset({self.audio_token_id, self.image_token_id, self.video_token_id})

    @property
    def boundary_ids(self) -> frozenset[int]:
        """Chat and modality markers (BOUNDARY spans)."""
        return frozenset({self.im_start_token_id, self.im_end_token_id, self.audio_start_token_id,
                          self.audio_end_token_id, self.vision_start_token_id, self.vision_end_token_id})


# Fields a Hugging Face thinker config spells differently (it reads both spellings).
HF_NAMES = {"audio_token_id": "audio_token_index", "image_token_id": "image_token_index",
            "video_token_id": "video_token_index"}
# The tokenizer's text of each id field.
TOKEN_TEXT = {
    "audio_token_id": "<|AUDIO|>", "image_token_id": "<|IMAGE|>", "video_token_id": "<|VIDEO|>",
    "audio_start_token_id": "<|audio_bos|>", "audio_end_token_id": "<|audio_eos|>",
    "vision_start_token_id": "<|vision_bos|>", "vision_end_token_id": "<|vision_eos|>",
    "im_start_token_id": "<|im_start|>", "im_end_token_id": "<|im_end|>",
}
