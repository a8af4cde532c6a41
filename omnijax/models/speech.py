"""What the families' speech outputs share: a spoken answer (`Utterance`), the thinker states a talker reads at a
media unit (`MediaRows`), a talker's paged cache, and the check that a checkpoint holds every component of its speech
output or none."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from omnijax.checkpoint import format as checkpoint
from omnijax.chunks.chunk import Chunk
from omnijax.kv import paged as paged_lib
from omnijax.media.audio import pcm16
from omnijax.models.config import DecoderConfig

__all__ = ["MediaRows", "Utterance", "has_speech_components", "media_rows", "talker_cache", "token_ids"]


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


@dataclasses.dataclass(frozen=True)
class MediaRows:
    """The thinker states a talker reads at one media unit's placeholders, kept from the step that fed the unit
    (`omnijax.streaming.step.chunk_step(..., tap=layer)`): Qwen3-Omni's talker reads transformers'
    `hidden_states[accept_hidden_layer]` at the audio / image placeholders of user turns.

    Attributes:
        positions: `[n]` indices, into the thinker ids handed to the talker, of the unit's placeholders, in order.
        rows: `[n, Dt]` the states at those placeholders (the thinker's compute dtype).
        layer: the `hidden_states` index the rows are (checked against the talker's).
        grid: an image's grid `(t, h, w)` in patches (the talker's own positions need it); None for audio.
        layout: a video or audiovisual unit's TMRoPE positions `[3, n]` over all of its tokens (markers included),
            relative to its first token, as the unit was fed (Qwen2.5-Omni reruns its thinker and lays its talker's
            positions out with them); None for other units.
    """

    positions: np.ndarray
    rows: np.ndarray
    layer: int
    grid: tuple[int, int, int] | None = None
    layout: np.ndarray | None = None

    def __post_init__(self):
        positions, rows = np.asarray(self.positions), np.asarray(self.rows)
        if positions.ndim != 1 or not np.issubdtype(positions.dtype, np.integer):
            raise ValueError(f"MediaRows.positions must be 1-D integer indices, got shape {positions.shape} dtype "
                             f"{positions.dtype}")
        if rows.ndim != 2 or rows.shape[0] != positions.shape[0]:
            raise ValueError(f"MediaRows.rows must be [n, D] with n = {positions.shape[0]} positions, got shape "
                             f"{rows.shape}")
        if self.grid is not None and (len(self.grid) != 3 or min(self.grid) < 1):
            raise ValueError(f"MediaRows.grid must be (t, h, w) >= 1, got {self.grid!r}")
        layout = None if self.layout is None else np.asarray(self.layout)
        if layout is not None and (layout.ndim != 2 or layout.shape[0] != 3 or not layout.shape[1]
                                   or not np.issubdtype(layout.dtype, np.integer)):
            raise ValueError(f"MediaRows.layout must be [3, n] integer positions, got shape {layout.shape}")

    @property
    def nbytes(self) -> int:
        """Bytes the rows hold (`n * Dt * itemsize`)."""
        return int(np.asarray(self.rows).nbytes)


def media_rows(chunk: Chunk, tapped: Any, layer: int, start: int, omni: Any,
               spatial_merge_size: int | None = None) -> MediaRows:
    """A fed media unit's `MediaRows`: the rows of `tapped [1, T', D]` (the step's `hidden_states[layer]` of the
    chunk, maybe padded past `chunk`'s length) at its placeholders, placed from `start` (the unit's first token in the
    ids handed to the talker); an image's patch grid from its placeholders' position extents (`(t, h, w)` ids times
    the merge size for h and w: `spatial_merge_size`, else `omni.spatial_merge_size`, Qwen3-Omni's); a video's
    (or audiovisual unit's) positions over all of its tokens, relative to its first (`MediaRows.layout`). `omni`: the
    family's token ids (`placeholder_ids`, `image_token_id`, `video_token_id`)."""
    valid = np.asarray(chunk.valid, bool)[0]
    ids = np.asarray(chunk.token_ids)[0][valid]
    holes = np.isin(ids, sorted(omni.placeholder_ids))
    rows = np.asarray(tapped[0, :valid.shape[0]])[valid][holes]
    grid = None
    if np.isin(omni.image_token_id, ids[holes]):
        pos = np.asarray(chunk.positions)[:, 0, :valid.shape[0]][:, valid][:, holes]  # [3, n] (t, h, w)
        m = omni.spatial_merge_size if spatial_merge_size is None else int(spatial_merge_size)
        grid = (len(np.unique(pos[0])), int(np.ptp(pos[1]) + 1) * m, int(np.ptp(pos[2]) + 1) * m)
    layout = None
    if np.isin(getattr(omni, "video_token_id", -1), ids[holes]):
        pos = np.asarray(chunk.positions)[:, 0, :valid.shape[0]][:, valid]  # [3, n] every token of the unit
        layout = (pos - pos[:, :1]).astype(np.int32)
    return MediaRows(positions=start + np.flatnonzero(holes), rows=rows, layer=layer, grid=grid, layout=layout)


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
