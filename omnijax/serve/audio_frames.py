"""PCM frames as engine input: one frame of 16 kHz int16 audio -> an audio unit chunk of the model's family
(`Family.frame_unit`: Qwen2.5-Omni 25 audio tokens per second; Qwen3-Omni the AuT encoder's 13 per 100 mel
frames)."""

from __future__ import annotations

import numpy as np
from flax import nnx

from omnijax.chunks.chunk import Chunk, pad_chunk
from omnijax.models.family import Family, OmniModel, family_of
from omnijax.models.registry import family_for


def _hearing_family(model: OmniModel | None) -> Family:
    """The family whose frames `model` hears; Qwen2.5-Omni's for None (a count asked before a model exists)."""
    family = family_for("qwen2_5_omni") if model is None else family_of(model)
    if family is None or family.frame_tokens is None or family.frame_unit is None:
        name = "a bare decoder" if family is None else f"the {family.name} family"
        raise ValueError(f"{name} does not hear PCM frames; serve a Qwen2.5-Omni or Qwen3-Omni checkpoint")
    return family


def frame_tokens(samples: int, model: OmniModel | None = None) -> int:
    """Chunk tokens of one frame of `samples` PCM samples: its audio tokens plus the two markers (Qwen2.5-Omni's
    count when no `model` is given)."""
    return _hearing_family(model).frame_tokens(samples)


class AudioFrameEncoder:
    """PCM frame -> audio unit chunk: the family's features -> the model's audio encoder -> its unit layout, padded
    to T.

    Args:
        model: a loaded model with an audio encoder, of a family that hears frames.
        chunk_tokens: the engine's padded per-tick length T.
        answer_tokens: greedy tokens asked after every frame.
    """

    def __init__(self, model: OmniModel, *, chunk_tokens: int, answer_tokens: int):
        if model.audio is None:
            raise ValueError("the checkpoint has no audio encoder: omnijax-serve needs an audio_config and its "
                             "thinker.audio_tower.* tensors")
        self.family = _hearing_family(model)
        self.model, self.chunk_tokens, self.answer_tokens = model, chunk_tokens, answer_tokens
        self._split = nnx.split(model.audio)  # split once: the encoders accept (graphdef, params)

    def encode(self, pcm: np.ndarray, unit: int) -> Chunk:
        """`[samples]` int16 PCM -> a batch-1 `Chunk` of length `chunk_tokens`."""
        audio = np.asarray(pcm, np.float32) / 32768.0
        chunk = self.family.frame_unit(self.model, self._split, audio, unit, self.answer_tokens)
        return pad_chunk(chunk, self.chunk_tokens)
