"""Qwen2.5-Omni Talker (`talker.*` of the full release): config and parameters, in Flax NNX; the math is in
`talker_forward`, the conversion table and the config reader in `convert` (`talker_component`,
`talker_config_from_hf`).

transformers 5.2.0's `Qwen2_5OmniTalkerForConditionalGeneration` is a Qwen2 decoder over codec tokens:

- its input rows live at the *thinker's* width Dt (`embedding_size`): the thinker's final-normed hidden state plus
  its embedding of each prompt / answer token, plus (where the reference adds them) the talker's own codec embedding
  `embed_tokens [V, Dt]` of the codec pad / bos / generated tokens;
- `thinker_to_talker_proj` (a Linear with bias, Dt -> D) takes every input row to the talker's width;
- the decoder layers are the thinker's (q/k/v biases, no q/k norm, 3-axis TMRoPE split by `mrope_section`, not
  interleaved; the SwiGLU MLP), then the final RMSNorm and `codec_head [D, V]` (no bias) give the codec logits.

Parameters (the shared decoder's layer layout, `omnijax.models.decoder.DecoderLayers`, stacked `[L, ...]`):

    codec_embedding [V, Dt]   proj [Dt, D]   proj_bias [D]   layers   final_norm [D]   codec_head [D, V]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from flax import nnx

from omnijax._checks import JsonConfig, check_config_fields
from omnijax.models.config import DecoderConfig
from omnijax.models.decoder import DecoderLayers
from omnijax.models.encoders.common import ConfigAttributeError, module_from_pure_dict
from omnijax.models.layers import new_param

__all__ = ["TALKER_PREFIX", "Talker", "TalkerConfig", "TalkerConfigError", "talker_from_params"]

TALKER_PREFIX = "talker."


class TalkerConfigError(ConfigAttributeError):
    """Inconsistent talker settings. Attributes: `attribute`, `value`."""

    subject = "Qwen2.5-Omni talker config"


@dataclasses.dataclass(frozen=True)
class TalkerConfig(JsonConfig):
    """Static hyperparameters of the Qwen2.5-Omni talker (transformers' `Qwen2_5OmniTalkerConfig`).

    Attributes:
        decoder: the Qwen2 decoder over the codec vocabulary (`vocab_size` codec ids; TMRoPE; untied head).
        embedding_size: width Dt of the input rows (the thinker's hidden size).
        codec_bos_id, codec_eos_id, codec_pad_id, codec_mask_id: the codec's start / end / pad / mask ids
            (`tts_codec_*_token_id`).
        text_bos_id, text_eos_id, text_pad_id: thinker-vocabulary ids whose thinker embeddings close (`eos`) and pad
            (`pad`) the answer's rows (`tts_text_*_token_id`; each voice brings its own start token).
        audio_token_id, image_token_id, video_token_id: the thinker's placeholders (the reference zeroes their
            embedding rows and gives them TMRoPE positions).
        audio_start_token_id, vision_start_token_id: the markers the talker's own `get_rope_index` finds media
            groups by (a placeholder run not behind its marker is numbered as text, as the reference does).
        spatial_merge_size, position_id_per_seconds: the talker's TMRoPE layout of an image group (its own config
            values, the thinker's in the release).
        dtype: compute and parameter dtype name.
    """

    decoder: DecoderConfig
    embedding_size: int
    codec_bos_id: int = 8293
    codec_eos_id: int = 8294
    codec_pad_id: int = 8292
    codec_mask_id: int = 8296
    text_bos_id: int = 151860
    text_eos_id: int = 151861
    text_pad_id: int = 151859
    audio_token_id: int = 151646
    image_token_id: int = 151655
    video_token_id: int = 151656
    audio_start_token_id: int = 151647
    vision_start_token_id: int = 151652
    spatial_merge_size: int = 2
    position_id_per_seconds: int = 25
    dtype: str = "float32"

    def __post_init__(self):
        check_config_fields(self, TalkerConfigError, positive=("embedding_size", "spatial_merge_size",
                                                                    "position_id_per_seconds"))
        if self.decoder.mrope_section is None or self.decoder.mrope_interleaved:
            raise TalkerConfigError("rope_parameters.mrope_section", self.decoder.mrope_section,
                                    "the talker uses 3-axis TMRoPE (not interleaved): an mrope_section is required")
        if self.decoder.tie_embeddings or self.decoder.num_experts:
            raise TalkerConfigError("decoder", self.decoder.to_json(), "the talker is a dense decoder with an "
                                    "untied codec head")
        for name in ("codec_bos_id", "codec_eos_id", "codec_pad_id", "codec_mask_id"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.decoder.vocab_size:
                raise TalkerConfigError(name, value, f"must be a codec id in [0, {self.decoder.vocab_size})")
        for name in ("text_bos_id", "text_eos_id", "text_pad_id", "audio_token_id", "image_token_id",
                     "video_token_id", "audio_start_token_id", "vision_start_token_id"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TalkerConfigError(name, value, "must be a non-negative thinker token id")

    @property
    def stop_ids(self) -> tuple[int, int]:
        """The codec ids that end the speech: transformers' `generate` passes `[8292, 8294]` (the release's codec
        pad and end ids) as the talker's eos unless told otherwise."""
        return self.codec_pad_id, self.codec_eos_id

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "decoder": self.decoder.to_json()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "TalkerConfig":
        data = dict(data)
        decoder = DecoderConfig.from_json(data.pop("decoder"))
        return dataclasses.replace(super().from_json(data | {"decoder": decoder}), decoder=decoder)


class Talker(nnx.Module):
    """Qwen2.5-Omni talker parameters (module docstring); the math is in `talker_forward`."""

    def __init__(self, config: TalkerConfig, *, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        c, dt, Dt = config.decoder, config.jnp_dtype, config.embedding_size
        self.config = config
        self.codec_embedding = new_param((c.vocab_size, Dt), dt, rngs)
        self.proj = new_param((Dt, c.hidden_size), dt, rngs)
        self.proj_bias = new_param((c.hidden_size,), dt, rngs, zeros=True)
        self.layers = DecoderLayers(c, rngs=rngs)
        self.final_norm = new_param((c.hidden_size,), dt, rngs, ones=True)
        self.codec_head = new_param((c.hidden_size, c.vocab_size), dt, rngs)


def talker_from_params(config: TalkerConfig, params: Mapping[str, Any]) -> Talker:
    """A `Talker` holding a pure-dict tree (the "talker" tree of `convert.talker_component`)."""
    return module_from_pure_dict(lambda: Talker(config, rngs=nnx.Rngs(0)), params, config.jnp_dtype,
                                 what="talker parameter", missing_error=KeyError)
