"""What the families' speech outputs share: a spoken answer (`Utterance`), a talker's paged cache, and the check
that a checkpoint holds every component of its speech output or none."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from omnijax.checkpoint import format as checkpoint
from omnijax.kv import paged as paged_lib
from omnijax.media.audio import pcm16
from omnijax.models.config import DecoderConfig

__all__ = ["Utterance", "has_speech_components", "talker_cache", "token_ids"]


@dataclasses.dataclass(frozen=True)
class Utterance:
    """A spoken answer.

    Attributes:
        pcm: `[samples]` float32 waveform in [-1, 1] at `sample_rate`.
        codes: the codec tokens the vocoder decoded: `[frames]` for Qwen2.5-Omni's Token2Wav (the talker's tokens
            but the last), `[Q, frames]` for Qwen3-Omni's Code2Wav (every codebook).
        talker_tokens: `[n]` the talker's (first-codebook) tokens, its end-of-speech token included when reached.
        sample_rate: samples per second.
    """

    pcm: np.ndarray
    codes: np.ndarray
    talker_tokens: np.ndarray
    sample_rate: int = 24_000

    def pcm16(self) -> np.ndarray:
        """The waveform as int16 PCM (rounded, clipped to the int16 range: `omnijax.media.audio.pcm16`)."""
        return pcm16(self.pcm)


def talker_cache(decoder: DecoderConfig, batch: int, tokens: int, page_size: int = 64) -> paged_lib.PagedKV:
    """An empty paged cache holding `tokens` talker tokens for each of `batch` sequences (3 position axes: the
    talkers use the thinker's multimodal rotary positions)."""
    pages = -(-tokens // page_size)
    return paged_lib.init(num_layers=decoder.num_layers, num_kv_heads=decoder.num_kv_heads, head_dim=decoder.head_dim,
                          num_pages=batch * pages, page_size=page_size, batch=batch, max_pages=pages,
                          position_axes=3, dtype=decoder.jnp_dtype)


def has_speech_components(directory: Path, manifest: Mapping[str, Any], names: Sequence[str]) -> bool:
    """Whether the checkpoint at `directory` holds a speech output: True when its manifest has every one of
    `names`, False when it has none (a thinker-only checkpoint).

    Raises:
        CheckpointFormatError: some of `names` but not all (naming both sets).
    """
    present = [name for name in names if name in manifest]
    if present and len(present) != len(names):
        raise checkpoint.CheckpointFormatError(
            f"{directory / checkpoint.MANIFEST}: speech output entries {present} without "
            f"{sorted(set(names) - set(present))} (a speech checkpoint has all of {tuple(names)})")
    return bool(present)


def token_ids(name: str, ids: Any, vocab: int) -> np.ndarray:
    """`ids` as `[n]` int64 token ids, checked: 1-D, integer, each in `[0, vocab)`.

    Raises:
        ValueError: naming `name` and what is wrong.
    """
    arr = np.asarray(ids)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must be a 1-D sequence of integer token ids, got shape {arr.shape} dtype "
                         f"{arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= vocab):
        raise ValueError(f"{name} must lie in [0, {vocab}), got range [{arr.min()}, {arr.max()}]")
    return arr.astype(np.int64)
