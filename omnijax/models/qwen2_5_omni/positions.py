"""TMRoPE positions of Qwen2.5-Omni, segment by segment with a carried cursor (host side, pure numpy).

Transformers computes the 3-axis positions of a whole prompt at once (`get_rope_index`). A stream instead builds one
segment at a time: each function here returns a `Segment` whose `positions` (`[3, n]`: temporal, height, width) are
relative to the segment's start and whose `advance` is how far the cursor moves, so that

    cursor = 0
    for seg in segments: absolute = seg.positions + cursor; cursor += seg.advance

reproduces `get_rope_index` of the concatenated token sequence position for position.

Rules (as transformers 5.2 implements them):
- text: t = h = w = i.
- audio `<|audio_bos|> A×n <|audio_eos|>`: consecutive like text (bos 0, tokens 1..n, eos n + 1).
- image / video `<|vision_bos|> grid <|vision_eos|>`: bos 0, grid base 1; token (k, r, c) of the merged grid gets
  (base + tid(k), base + r, base + c); eos = max + 1. Images: tid(k) = k * 25. Videos: tid(k) =
  trunc(float32(float32(k * second_per_grid) * 25)), the float32 arithmetic of transformers.
- audio in video `<|vision_bos|><|audio_bos|> V0 A0 V1 A1 … <|audio_eos|><|vision_eos|>`: both bos markers at 0,
  base 1, video as above and audio base + i, split into chunks of `seconds_per_chunk * 25` temporal units by
  `chunk_ranges` and interleaved V0 A0 V1 A1 …; both eos markers at (max of the LAST chunk) + 1, which is not always
  the maximum of the segment (see `audio_in_video_positions`).
- after any segment the next one starts at (max of its last piece) + 1; for every segment but an audio-in-video one
  whose last chunk is not its maximum, that is the segment's max + 1.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

POSITION_ID_PER_SECONDS = 25
SECONDS_PER_CHUNK = 2
SPATIAL_MERGE_SIZE = 2

# Roles of the tokens of an audio-in-video segment (`AudioVideoSegment.roles`).
ROLE_VISION_BOS, ROLE_AUDIO_BOS, ROLE_VIDEO, ROLE_AUDIO, ROLE_AUDIO_EOS, ROLE_VISION_EOS = range(6)


class Segment(NamedTuple):
    """Positions of one segment: `positions` `[3, n]` int32 relative to its start; `advance`: cursor step."""

    positions: np.ndarray
    advance: int


class AudioVideoSegment(NamedTuple):
    """An audio-in-video segment: positions `[3, n]`, cursor `advance`, `roles` `[n]` int8 (`ROLE_*` per token)."""

    positions: np.ndarray
    advance: int
    roles: np.ndarray


def audio_token_count(feature_length: int) -> int:
    """Audio tokens of `feature_length` mel frames (transformers' formula): ((L - 1) // 2 + 1 - 2) // 2 + 1."""
    return int(((int(feature_length) - 1) // 2 + 1 - 2) // 2 + 1)


def vision_token_count(grid_thw: Sequence[int], spatial_merge_size: int = SPATIAL_MERGE_SIZE) -> int:
    """LLM tokens of a vision grid `(t, h, w)` in patches: t * h * w / merge²."""
    t, h, w = _grid(grid_thw, spatial_merge_size)
    return t * (h // spatial_merge_size) * (w // spatial_merge_size)


def image_temporal_ids(grid_t: int, position_id_per_seconds: int = POSITION_ID_PER_SECONDS) -> np.ndarray:
    """Temporal ids of an image's temporal patches: k * position_id_per_seconds (integer arithmetic). `[grid_t]`."""
    return np.arange(int(grid_t), dtype=np.int64) * int(position_id_per_seconds)


def video_temporal_ids(grid_t: int, second_per_grid: float,
                       position_id_per_seconds: float = POSITION_ID_PER_SECONDS) -> np.ndarray:
    """Temporal ids of a video's temporal patches, `[grid_t]` int64.

    floor(k * second_per_grid * position_id_per_seconds) evaluated as transformers does: in float32, the product
    `k * second_per_grid` rounded first, then the factor, then truncated (second_per_grid 0.7, k 6 gives 104, not the
    exact 105).
    """
    if not (np.isfinite(second_per_grid) and second_per_grid > 0):
        raise ValueError(f"second_per_grid must be a positive number of seconds, got {second_per_grid!r}")
    k = np.arange(int(grid_t), dtype=np.float32)
    values = (k * np.float32(second_per_grid)) * np.float32(position_id_per_seconds)
    return values.astype(np.int64)


def grid_positions(grid_thw: Sequence[int], temporal_ids: np.ndarray,
                   spatial_merge_size: int = SPATIAL_MERGE_SIZE) -> np.ndarray:
    """(t, h, w) of every token of a merged vision grid relative to its base, in token order (k, r, c). `[3, n]`.

    Token (k, r, c) gets (temporal_ids[k], r, c): height and width do not grow with time.
    """
    t, h, w = _grid(grid_thw, spatial_merge_size)
    rows, cols = h // spatial_merge_size, w // spatial_merge_size
    temporal_ids = np.asarray(temporal_ids, np.int64)
    if temporal_ids.shape != (t,):
        raise ValueError(f"temporal_ids must have shape ({t},), got {temporal_ids.shape}")
    tt = np.repeat(temporal_ids, rows * cols)
    hh = np.tile(np.repeat(np.arange(rows, dtype=np.int64), cols), t)
    ww = np.tile(np.arange(cols, dtype=np.int64), t * rows)
    return np.stack([tt, hh, ww])


def chunk_ranges(values: Sequence[float], tokens_per_chunk: int) -> list[tuple[int, int]]:
    """Transformers' `get_chunked_index`: (start, end) token ranges of successive temporal chunks.

    Walks the tokens once with a chunk counter c (starting at 1): a token whose value is >= c * tokens_per_chunk
    closes the current range and increments c by ONE. A value that jumps over several chunk boundaries (video temporal
    steps above `tokens_per_chunk`, i.e. second_per_grid > seconds_per_chunk) therefore closes one range per token,
    not one per boundary: ids [0, 0, 100, 100, 100] with 50 per chunk give [(0, 2), (2, 3), (3, 5)]. The last range
    is always emitted, so an empty input yields [(0, 0)].
    """
    ranges, start, current = [], 0, 1
    for i, v in enumerate(values):
        if v >= current * tokens_per_chunk:
            ranges.append((start, i))
            start, current = i, current + 1
    ranges.append((start, len(values)))
    return ranges


def text_positions(num_tokens: int) -> Segment:
    """`num_tokens` text tokens: t = h = w = i; advance `num_tokens`."""
    n = _count(num_tokens, "num_tokens", minimum=0)
    return Segment(np.broadcast_to(np.arange(n, dtype=np.int32), (3, n)).copy(), n)


def audio_positions(num_audio_tokens: int) -> Segment:
    """`<|audio_bos|> A×n <|audio_eos|>`: positions 0 .. n + 1 on all axes; advance n + 2."""
    n = _count(num_audio_tokens, "num_audio_tokens")
    return text_positions(n + 2)


def image_positions(grid_thw: Sequence[int], *, spatial_merge_size: int = SPATIAL_MERGE_SIZE,
                    position_id_per_seconds: int = POSITION_ID_PER_SECONDS) -> Segment:
    """`<|vision_bos|> image <|vision_eos|>` for an image grid `(t, h, w)` in patches (t is 1 for a still image)."""
    tids = image_temporal_ids(_grid(grid_thw, spatial_merge_size)[0], position_id_per_seconds)
    return _marked_grid(grid_positions(grid_thw, tids, spatial_merge_size))


def video_positions(grid_thw: Sequence[int], second_per_grid: float, *,
                    spatial_merge_size: int = SPATIAL_MERGE_SIZE,
                    position_id_per_seconds: float = POSITION_ID_PER_SECONDS) -> Segment:
    """`<|vision_bos|> video <|vision_eos|>` (video without its audio) for a grid `(t, h, w)` in patches."""
    tids = video_temporal_ids(_grid(grid_thw, spatial_merge_size)[0], second_per_grid, position_id_per_seconds)
    return _marked_grid(grid_positions(grid_thw, tids, spatial_merge_size))


def audio_in_video_positions(grid_thw: Sequence[int], num_audio_tokens: int, second_per_grid: float, *,
                             spatial_merge_size: int = SPATIAL_MERGE_SIZE,
                             position_id_per_seconds: float = POSITION_ID_PER_SECONDS,
                             seconds_per_chunk: float = SECONDS_PER_CHUNK) -> AudioVideoSegment:
    """`<|vision_bos|><|audio_bos|> V0 A0 V1 A1 … <|audio_eos|><|vision_eos|>`: one video with its audio.

    Positions follow `get_rope_index`; the token order (`roles`) follows the processor
    (`replace_multimodal_special_tokens`), exactly as the two are combined in transformers:
    - positions: video temporal ids in float32 and truncated (`video_temporal_ids`), chunked by `chunk_ranges`;
    - token order: the processor chunks the same ids in float64 WITHOUT truncation (k * second_per_grid * 25). The
      two chunkings agree except when a product lands within rounding of a chunk boundary (e.g. second_per_grid
      1.5555555555555554, grid_t 10: k = 9 gives 349.99999… in one and 350 in the other). Transformers then pairs
      the processor's token order with get_rope_index's positions, and so does this function.
    - eos: both eos markers sit at (max of the last interleaved chunk) + 1, and the cursor advances past them. When
      the last chunk is an audio chunk whose top (base + audio length - 1) lies below an earlier video chunk's
      top (its temporal id or its merged grid height/width), the eos markers do not hold the segment's maximum
      position and `advance` is smaller than max + 1.

    Returns:
        `AudioVideoSegment` with `positions` `[3, 4 + video + audio]`, `advance`, `roles` `[n]` (`ROLE_*`).
    """
    n_audio = _count(num_audio_tokens, "num_audio_tokens")
    t = _grid(grid_thw, spatial_merge_size)[0]
    tokens_per_chunk = int(position_id_per_seconds * seconds_per_chunk)
    base = 1
    # get_rope_index side: integer positions, chunked on the truncated temporal ids
    video = grid_positions(grid_thw, video_temporal_ids(t, second_per_grid, position_id_per_seconds),
                           spatial_merge_size) + base
    audio = np.broadcast_to(np.arange(n_audio, dtype=np.int64), (3, n_audio)) + base
    pieces = _interleave(chunk_ranges(video[0] - base, tokens_per_chunk),
                         chunk_ranges(np.arange(n_audio), tokens_per_chunk))
    body = [(video if kind == ROLE_VIDEO else audio)[:, s:e] for kind, s, e in pieces]
    eos = int(body[-1].max()) + 1
    positions = np.concatenate([np.zeros((3, 2), np.int64), *body, np.full((3, 2), eos, np.int64)], axis=1)
    # processor side: token order from float64 temporal values
    rows = (grid_thw[1] // spatial_merge_size) * (grid_thw[2] // spatial_merge_size)
    processor_values = np.repeat(np.arange(t), rows) * float(second_per_grid) * position_id_per_seconds
    order = _interleave(chunk_ranges(processor_values, tokens_per_chunk),
                        chunk_ranges(np.arange(n_audio), tokens_per_chunk))
    roles = np.concatenate([[ROLE_VISION_BOS, ROLE_AUDIO_BOS], *[np.full(e - s, kind) for kind, s, e in order],
                            [ROLE_AUDIO_EOS, ROLE_VISION_EOS]]).astype(np.int8)
    return AudioVideoSegment(positions.astype(np.int32), eos + 1, roles)


def place(segments: Sequence[Segment], start: int = 0) -> tuple[np.ndarray, int]:
    """Absolute positions `[3, N]` of consecutive segments from cursor `start`, and the cursor after them."""
    out, cursor = [], int(start)
    for seg in segments:
        out.append(np.asarray(seg.positions, np.int64) + cursor)
        cursor += int(seg.advance)
    pos = np.concatenate(out, axis=1) if out else np.zeros((3, 0), np.int64)
    return pos.astype(np.int32), cursor


def _interleave(video_ranges, audio_ranges) -> list[tuple[int, int, int]]:
    """V0 A0 V1 A1 … as (kind, start, end); the longer list's tail follows; empty ranges are dropped."""
    out = []
    for j in range(max(len(video_ranges), len(audio_ranges))):
        if j < len(video_ranges):
            out.append((ROLE_VIDEO, *video_ranges[j]))
        if j < len(audio_ranges):
            out.append((ROLE_AUDIO, *audio_ranges[j]))
    return [(k, s, e) for k, s, e in out if e > s]


def _marked_grid(grid: np.ndarray) -> Segment:
    """bos at 0, the grid from base 1, eos at max + 1."""
    grid = grid + 1
    eos = int(grid.max()) + 1
    positions = np.concatenate([np.zeros((3, 1), np.int64), grid, np.full((3, 1), eos, np.int64)], axis=1)
    return Segment(positions.astype(np.int32), eos + 1)


def _grid(grid_thw: Sequence[int], spatial_merge_size: int) -> tuple[int, int, int]:
    g = np.asarray(grid_thw).reshape(-1)
    if g.shape != (3,) or (g < 1).any():
        raise ValueError(f"grid_thw must be three positive ints (t, h, w), got {grid_thw!r}")
    t, h, w = (int(x) for x in g)
    if h % spatial_merge_size or w % spatial_merge_size:
        raise ValueError(f"grid height and width must be multiples of the merge size {spatial_merge_size}, "
                         f"got {grid_thw!r}")
    return t, h, w


def _count(value: int, name: str, minimum: int = 1) -> int:
    n = int(value)
    if n != value or n < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return n
