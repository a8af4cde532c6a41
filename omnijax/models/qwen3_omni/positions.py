"""Qwen3-Omni multimodal (M-RoPE) position ids in pure numpy, whole prompt or unit by unit for streaming.

Mirrors `get_rope_index` of transformers 5.2.0 (`Qwen3OmniMoePreTrainedModelForConditionalGeneration`). Positions
are `[3, ...]` (temporal, height, width) and FLOAT: a video's temporal id is `k * second_per_grid *
position_id_per_seconds`, fractional whenever `second_per_grid` is (fps 3 gives 2/3 s per grid, 8.666… ids per
grid), and everything after a fractional group inherits the fraction. The reference computes in float32, so
every value here is float32 built with the same operations in the same order (bit-exact).

A prompt is text runs and modality groups, each group `<start> body <end>`:
- text: t = h = w = next id, consecutive.
- audio `<|audio_start|> <|AUDIO|>×n <|audio_end|>`: consecutive like text; n = `audio_token_count(mel_frames)`.
- image / video `<|vision_start|> <|IMAGE|>/<|VIDEO|>×n <|vision_end|>`: merged-grid token (k, r, c) gets
  (s + t_index[k], s + r, s + c) with s the id after `<|vision_start|>`; t_index = k * position_id_per_seconds for
  images (one "second" per temporal patch), float32(float32(k * second_per_grid) * position_id_per_seconds) for
  videos.
- audio in video (`use_audio_in_video=True`) `<|vision_start|><|audio_start|> body <|audio_end|><|vision_end|>`:
  the two start markers take two consecutive ids, then the video tokens (as above) and the audio tokens (s + i)
  both start at the same s and are merged token by token by temporal id, video first on ties; whichever stream is
  left over is appended as a tail. The body's token order in the prompt must follow that merge (the processor
  writes it so; `StreamPositions` returns the ids to write).
- end markers of a group start at (max of the LAST piece appended) + 1 and the next unit starts after them. The
  last piece is the whole body, except for audio in video where it is the leftover tail: an audio tail that ends
  below the video's height/width ids makes the next ids smaller than the group's maximum.

Two paths, as in the reference: with `image_grid_thw` and `video_grid_thw` both None the TEXT path is used even
when the prompt holds audio groups: positions = cumsum(attention_mask) - 1, padding 1 (audio groups get the same
consecutive ids either way). Otherwise padding gets 0 and each row's unpadded tokens are placed as above. Grids,
audio lengths and seconds per grid are consumed in order of appearance over the batch, row after row.

Streaming (`StreamPositions`): a unit is either a text piece (any number of tokens, split anywhere) or one whole
modality group including its start and end markers. Feeding a prompt unit by unit gives exactly the one-shot
positions: the cursor keeps the float32 base of the current text run plus an integer offset into it, because the
reference adds a whole run's index to its base in one float32 addition.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence, Union

import numpy as np
import numpy.typing as npt

from omnijax.models.qwen3_omni.config import Qwen3OmniConfig, count_field

_F32 = np.float32


# --- validation ------------------------------------------------------------------------------------------------------

def _count(value, name: str, minimum: int = 1) -> int:
    return count_field(value, name, minimum)


def _grid(grid_thw: Sequence[int], spatial_merge_size: int) -> tuple[int, int, int]:
    if len(grid_thw) != 3:
        raise ValueError(f"a vision grid is (t, h, w), got {tuple(grid_thw)}")
    t, h, w = (_count(v, "grid size") for v in grid_thw)
    if h % spatial_merge_size or w % spatial_merge_size:
        raise ValueError(f"grid {tuple(grid_thw)}: h and w must be multiples of spatial_merge_size "
                         f"{spatial_merge_size}")
    return t, h, w


def _rows(grids, name: str) -> np.ndarray:
    arr = np.asarray(grids if grids is not None else np.zeros((0, 3), np.int64))
    if arr.size == 0:
        return np.zeros((0, 3), np.int64)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError(f"{name} must be [N, 3], got shape {arr.shape}")
    return arr


# --- counts and per-piece positions ----------------------------------------------------------------------------------

def audio_token_count(mel_frames: int) -> int:
    """LLM tokens of an audio clip of `mel_frames` frames: 13 per full 100 frames, plus the three stride-2 convs'
    output of the remainder."""
    frames = _count(mel_frames, "mel_frames", minimum=0)
    rest = (frames % 100 - 1) // 2 + 1
    return ((rest - 1) // 2 + 1 - 1) // 2 + 1 + frames // 100 * 13


def vision_token_count(grid_thw: Sequence[int], spatial_merge_size: int = 2) -> int:
    """LLM tokens of a vision grid `(t, h, w)` in patches: t * (h / merge) * (w / merge)."""
    t, h, w = _grid(grid_thw, spatial_merge_size)
    return t * (h // spatial_merge_size) * (w // spatial_merge_size)


def image_t_index(grid_t: int, position_id_per_seconds: float = 13) -> np.ndarray:
    """Temporal ids of an image's temporal patches, k * position_id_per_seconds. `[grid_t]` float32."""
    return np.arange(_count(grid_t, "grid_t"), dtype=_F32) * _F32(position_id_per_seconds)


def video_t_index(grid_t: int, second_per_grid: float, position_id_per_seconds: float = 13) -> np.ndarray:
    """Temporal ids of a video's temporal patches, `[grid_t]` float32: (k * second_per_grid) rounded to float32,
    then times position_id_per_seconds rounded again (the reference's order; second_per_grid is itself rounded to
    float32 first)."""
    if not (np.isfinite(second_per_grid) and second_per_grid > 0):
        raise ValueError(f"second_per_grid must be a positive number of seconds, got {second_per_grid!r}")
    k = np.arange(_count(grid_t, "grid_t"), dtype=_F32)
    return (k * _F32(second_per_grid)) * _F32(position_id_per_seconds)


def text_positions(n: int, start: float = 0.0, offset: int = 0) -> np.ndarray:
    """`n` consecutive ids on all three axes: start + (offset + i), one float32 addition each. `[3, n]` float32.

    With the default start 0 they are relative ids; `offset` continues a run whose first `offset` tokens are placed.
    """
    n = _count(n, "n", minimum=0)
    ids = _F32(start) + (offset + np.arange(n)).astype(_F32)  # [n]
    return np.broadcast_to(ids, (3, n)).copy()


def audio_positions(n_tokens: int, start: float = 0.0) -> np.ndarray:
    """Body of an audio group: `n_tokens` consecutive ids from `start`. `[3, n_tokens]` float32."""
    return text_positions(_count(n_tokens, "n_tokens"), start)


def vision_positions(grid_thw: Sequence[int], t_index: Sequence[float] | np.ndarray, *, spatial_merge_size: int = 2,
                     start: float = 0.0) -> np.ndarray:
    """Body of an image or video group: token (k, r, c) of the merged grid, in that order, gets
    (start + t_index[k], start + r, start + c). `[3, t * h/merge * w/merge]` float32."""
    t, h, w = _grid(grid_thw, spatial_merge_size)
    rows, cols = h // spatial_merge_size, w // spatial_merge_size
    t_index = np.asarray(t_index, _F32)
    if t_index.shape != (t,):
        raise ValueError(f"t_index must have shape ({t},) for grid {tuple(grid_thw)}, got {t_index.shape}")
    tt = np.repeat(t_index, rows * cols)
    hh = np.tile(np.repeat(np.arange(rows), cols), t).astype(_F32)
    ww = np.tile(np.arange(cols), t * rows).astype(_F32)
    return np.stack([tt, hh, ww]) + _F32(start)  # [3, n]


class AudioVideoPositions(NamedTuple):
    """Body of an audio-in-video group in merged order.

    Attributes:
        positions: `[3, n_video + n_audio]` float32.
        is_video: `[n_video + n_audio]` bool, True where the token is a video token (audio otherwise); video and
            audio embeddings go to their slots in their own order.
        last_max: max of the last piece appended (the leftover tail); the end markers start at last_max + 1.
    """

    positions: np.ndarray
    is_video: np.ndarray
    last_max: float


def audio_in_video_positions(video_grid: Sequence[int], audio_tokens: int, second_per_grid: float, *,
                             spatial_merge_size: int = 2, position_id_per_seconds: float = 13,
                             start: float = 0.0) -> AudioVideoPositions:
    """Merges a video's and its audio's positions, both starting at `start`, by temporal id, video first on ties.

    The order is decided on the float32 ABSOLUTE ids (as the reference does), so pass the real start; with the
    default 0 the result is relative and its order can only differ where float32 rounding at large ids creates or
    breaks a tie.
    """
    t = _grid(video_grid, spatial_merge_size)[0]
    video = vision_positions(video_grid, video_t_index(t, second_per_grid, position_id_per_seconds),
                             spatial_merge_size=spatial_merge_size, start=start)  # [3, nv]
    audio = audio_positions(audio_tokens, start)  # [3, na]
    nv, na = video.shape[1], audio.shape[1]
    # A two-pointer merge of two non-decreasing streams (take video while its t <= the next audio id): video token v
    # lands after the audio ids < its t, audio token a after the video tokens with t <= its id.
    v_slot = np.arange(nv) + np.searchsorted(audio[0], video[0], side="left")
    a_slot = np.arange(na) + np.searchsorted(video[0], audio[0], side="right")
    positions = np.empty((3, nv + na), _F32)
    positions[:, v_slot] = video
    positions[:, a_slot] = audio
    is_video = np.zeros(nv + na, bool)
    is_video[v_slot] = True
    if v_slot[-1] > a_slot[-1]:  # the video outlasts the audio: its tail (after the last audio token) is last
        last_max = video[:, v_slot > a_slot[-1]].max()
    else:
        last_max = audio[0, a_slot > v_slot[-1]].max()
    return AudioVideoPositions(positions, is_video, float(last_max))


# --- units and the streaming cursor ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TextRun:
    """`n` text tokens (a streaming unit may be any piece of a run)."""
    n: int


@dataclasses.dataclass(frozen=True)
class AudioGroup:
    """`<|audio_start|> <|AUDIO|>×tokens <|audio_end|>`; `tokens` = `audio_token_count(mel_frames)`."""
    tokens: int


@dataclasses.dataclass(frozen=True)
class ImageGroup:
    """`<|vision_start|> <|IMAGE|>×n <|vision_end|>` of a grid `(t, h, w)` in patches."""
    grid_thw: tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class VideoGroup:
    """`<|vision_start|> <|VIDEO|>×n <|vision_end|>`; `second_per_grid` seconds per temporal patch."""
    grid_thw: tuple[int, int, int]
    second_per_grid: float


@dataclasses.dataclass(frozen=True)
class AudioInVideoGroup:
    """`<|vision_start|><|audio_start|> merged video/audio <|audio_end|><|vision_end|>`."""
    grid_thw: tuple[int, int, int]
    second_per_grid: float
    audio_tokens: int


Segment = Union[TextRun, AudioGroup, ImageGroup, VideoGroup, AudioInVideoGroup]


class SegmentPositions(NamedTuple):
    """What one unit gets: `positions` `[3, n]` float32 absolute; `token_ids` `[n]` int64 of a group (markers and
    placeholders in order, audio and video interleaved as merged) or None for text."""

    positions: np.ndarray
    token_ids: np.ndarray | None


@dataclasses.dataclass(frozen=True)
class Cursor:
    """Where a stream stands: the current text run starts at float32 `base` and `offset` of its tokens are placed.

    Attributes:
        base: float32 value (stored as a Python float, exactly) of the run's first id.
        offset: tokens of the run already placed.
        max_id: largest id placed so far (-1 before any); transformers' generate continues decoding at max_id + 1.
    """

    base: float = 0.0
    offset: int = 0
    max_id: float = -1.0

    @property
    def next_id(self) -> float:
        """The id the next text token gets."""
        return float(_F32(self.base) + _F32(self.offset))


class StreamPositions:
    """Positions of a session fed unit by unit (a text piece, or one whole group with its markers).

    `feed` returns the unit's absolute positions and advances the cursor; the concatenation over a prompt equals
    `rope_index` of the whole prompt exactly, however its text is split.
    """

    def __init__(self, config: Qwen3OmniConfig = Qwen3OmniConfig(), cursor: Cursor = Cursor()):
        self.config = config
        self.cursor = cursor

    @property
    def next_id(self) -> float:
        return self.cursor.next_id

    def feed(self, segment: Segment) -> SegmentPositions:
        """Places one unit at the cursor and moves the cursor past it."""
        c, cfg = self.cursor, self.config
        if isinstance(segment, TextRun):
            pos = text_positions(segment.n, c.base, c.offset)
            self._advance(pos, Cursor(c.base, c.offset + segment.n, c.max_id))
            return SegmentPositions(pos, None)
        start = _F32(c.base) + _F32(c.offset)  # the reference adds the text run's length in one step
        if isinstance(segment, AudioGroup):
            starts, ends = [cfg.audio_start_token_id], [cfg.audio_end_token_id]
            body = audio_positions(segment.tokens, start + _F32(1))
            body_ids = np.full(body.shape[1], cfg.audio_token_id)
            last_max = body[0, -1]
        elif isinstance(segment, (ImageGroup, VideoGroup)):
            starts, ends = [cfg.vision_start_token_id], [cfg.vision_end_token_id]
            t = _grid(segment.grid_thw, cfg.spatial_merge_size)[0]
            if isinstance(segment, ImageGroup):
                t_index, placeholder = image_t_index(t, cfg.position_id_per_seconds), cfg.image_token_id
            else:
                t_index = video_t_index(t, segment.second_per_grid, cfg.position_id_per_seconds)
                placeholder = cfg.video_token_id
            body = vision_positions(segment.grid_thw, t_index, spatial_merge_size=cfg.spatial_merge_size,
                                    start=start + _F32(1))
            body_ids = np.full(body.shape[1], placeholder)
            last_max = body.max()
        elif isinstance(segment, AudioInVideoGroup):
            starts = [cfg.vision_start_token_id, cfg.audio_start_token_id]
            ends = [cfg.audio_end_token_id, cfg.vision_end_token_id]
            merged = audio_in_video_positions(
                segment.grid_thw, segment.audio_tokens, segment.second_per_grid,
                spatial_merge_size=cfg.spatial_merge_size, position_id_per_seconds=cfg.position_id_per_seconds,
                start=start + _F32(2))
            body, last_max = merged.positions, merged.last_max
            body_ids = np.where(merged.is_video, cfg.video_token_id, cfg.audio_token_id)
        else:
            raise TypeError(f"not a position segment: {segment!r}")
        end_start = _F32(last_max) + _F32(1)
        pos = np.concatenate([text_positions(len(starts), start), body, text_positions(len(ends), end_start)], 1)
        ids = np.concatenate([starts, body_ids, ends]).astype(np.int64)
        self._advance(pos, Cursor(float(pos[0, -1] + _F32(1)), 0))
        return SegmentPositions(pos, ids)

    def _advance(self, pos: np.ndarray, cursor: Cursor) -> None:
        top = max(self.cursor.max_id, float(pos.max())) if pos.size else self.cursor.max_id
        self.cursor = dataclasses.replace(cursor, max_id=top)


def place(segments: Sequence[Segment], config: Qwen3OmniConfig = Qwen3OmniConfig(),
          cursor: Cursor = Cursor()) -> np.ndarray:
    """Absolute positions of `segments` laid end to end from `cursor`. `[3, total tokens]` float32."""
    stream = StreamPositions(config, cursor)
    pieces = [stream.feed(s).positions for s in segments]
    return np.concatenate(pieces, 1) if pieces else np.zeros((3, 0), _F32)


# --- whole prompts ---------------------------------------------------------------------------------------------------

class _Media:
    """Grids, audio lengths and seconds per grid, handed out in order of appearance with clear errors."""

    def __init__(self, image_grid_thw, video_grid_thw, audio_seqlens, second_per_grids):
        self.images = [tuple(int(v) for v in g) for g in _rows(image_grid_thw, "image_grid_thw")]
        self.videos = [tuple(int(v) for v in g) for g in _rows(video_grid_thw, "video_grid_thw")]
        self.audios = [int(v) for v in np.asarray(audio_seqlens if audio_seqlens is not None else ()).reshape(-1)]
        self.spgs = [float(v) for v in np.asarray(second_per_grids if second_per_grids is not None else ()).ravel()]
        self.used = {"image": 0, "video": 0, "audio": 0}

    def take(self, kind: str, where: str):
        pool = {"image": self.images, "video": self.videos, "audio": self.audios}[kind]
        i = self.used[kind]
        if i >= len(pool):
            raise ValueError(f"{where}: {kind} group #{i + 1} but only {len(pool)} {kind} "
                             f"{'lengths (audio_seqlens)' if kind == 'audio' else 'grids'} were given")
        self.used[kind] += 1
        if kind != "video":
            return pool[i]
        if i >= len(self.spgs):
            raise ValueError(f"{where}: video #{i + 1} has no second_per_grids entry ({len(self.spgs)} given)")
        return pool[i], self.spgs[i]

    def check_all_used(self) -> None:
        given = {"image": len(self.images), "video": len(self.videos), "audio": len(self.audios)}
        for kind, n in given.items():
            if self.used[kind] != n:
                raise ValueError(f"{n} {kind} inputs were given but the prompt has {self.used[kind]} {kind} groups")


def parse_segments(token_ids: Sequence[int], config: Qwen3OmniConfig = Qwen3OmniConfig(), *,
                   image_grid_thw: npt.ArrayLike | None = None, video_grid_thw: npt.ArrayLike | None = None,
                   audio_seqlens: Sequence[int] = (), second_per_grids: Sequence[float] = (),
                   use_audio_in_video: bool = False) -> list[Segment]:
    """Splits one unpadded prompt into text runs and modality groups, checking every placeholder count against its
    grid or audio length (`audio_seqlens` in mel frames), and that every input is used."""
    media = _Media(image_grid_thw, video_grid_thw, audio_seqlens, second_per_grids)
    segments = _parse_row(np.asarray(token_ids).reshape(-1).tolist(), config, media, use_audio_in_video, "prompt")
    media.check_all_used()
    return segments


def _parse_row(tokens: list, cfg: Qwen3OmniConfig, media: _Media, use_aiv: bool, row: str) -> list[Segment]:
    vs, ve, as_, ae = (cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.audio_start_token_id,
                       cfg.audio_end_token_id)
    names = {cfg.audio_token_id: "<|AUDIO|>", cfg.image_token_id: "<|IMAGE|>", cfg.video_token_id: "<|VIDEO|>",
             vs: "<|vision_start|>", ve: "<|vision_end|>", as_: "<|audio_start|>", ae: "<|audio_end|>"}
    out: list[Segment] = []
    text, i, n = 0, 0, len(tokens)

    def run(j: int, allowed: set) -> int:  # end of the run of `allowed` tokens from j
        while j < n and tokens[j] in allowed:
            j += 1
        return j

    def expect(j: int, marker: int, where: str) -> None:
        if j >= n or tokens[j] != marker:
            got = "the end of the prompt" if j >= n else f"token {tokens[j]} ({names.get(tokens[j], 'text')})"
            raise ValueError(f"{where}: expected {names[marker]} at {j}, got {got}; the placeholder count does not "
                             f"match the group or the group is not closed")

    def check(where: str, kind: str, got: int, want: int, source: str) -> None:
        if got != want:
            raise ValueError(f"{where}: {got} {kind} placeholders but {source} needs {want}")

    while i < n:
        tok = tokens[i]
        if tok != vs and tok != as_:
            if tok in names:
                raise ValueError(f"{row}, token {i}: {names[tok]} outside a modality group")
            text, i = text + 1, i + 1
            continue
        if text:
            out.append(TextRun(text))
            text = 0
        where = f"{row}, group at token {i}"
        nxt = tokens[i + 1] if i + 1 < n else None
        if tok == as_:
            j = run(i + 1, {cfg.audio_token_id})
            frames = media.take("audio", where)
            check(where, "<|AUDIO|>", j - i - 1, audio_token_count(frames), f"audio of {frames} mel frames")
            if j == i + 1:
                raise ValueError(f"{where}: an audio group needs at least one token ({frames} mel frames give none)")
            expect(j, ae, where)
            out.append(AudioGroup(j - i - 1))
        elif nxt == cfg.image_token_id:
            j = run(i + 1, {cfg.image_token_id})
            grid = media.take("image", where)
            check(where, "<|IMAGE|>", j - i - 1, vision_token_count(grid, cfg.spatial_merge_size), f"grid {grid}")
            expect(j, ve, where)
            out.append(ImageGroup(grid))
        elif nxt == cfg.video_token_id:
            if use_aiv:
                raise ValueError(f"{where}: a video without its audio, but use_audio_in_video=True expects "
                                 f"<|vision_start|><|audio_start|> groups")
            j = run(i + 1, {cfg.video_token_id})
            grid, spg = media.take("video", where)
            check(where, "<|VIDEO|>", j - i - 1, vision_token_count(grid, cfg.spatial_merge_size), f"grid {grid}")
            expect(j, ve, where)
            out.append(VideoGroup(grid, spg))
        elif nxt == as_:
            if not use_aiv:
                raise ValueError(f"{where}: an audio-in-video group but use_audio_in_video=False")
            j = run(i + 2, {cfg.video_token_id, cfg.audio_token_id})
            grid, spg = media.take("video", where)
            frames = media.take("audio", where)
            body = tokens[i + 2:j]
            n_video = sum(1 for t in body if t == cfg.video_token_id)
            check(where, "<|VIDEO|>", n_video, vision_token_count(grid, cfg.spatial_merge_size), f"grid {grid}")
            check(where, "<|AUDIO|>", len(body) - n_video, audio_token_count(frames),
                  f"audio of {frames} mel frames")
            if len(body) == n_video:
                raise ValueError(f"{where}: audio in video needs at least one audio token ({frames} mel frames)")
            expect(j, ae, where)
            expect(j + 1, ve, where)
            j += 1
            out.append(AudioInVideoGroup(grid, spg, len(body) - n_video))
        else:
            raise ValueError(f"{where}: <|vision_start|> must be followed by <|IMAGE|>, <|VIDEO|> or <|audio_start|>")
        i = j + 1
    if text:
        out.append(TextRun(text))
    return out


def rope_index(input_ids: npt.ArrayLike, attention_mask: npt.ArrayLike | None,
               config: Qwen3OmniConfig = Qwen3OmniConfig(), *, image_grid_thw: npt.ArrayLike | None = None,
               video_grid_thw: npt.ArrayLike | None = None, audio_seqlens: Sequence[int] = (),
               second_per_grids: Sequence[float] = (), use_audio_in_video: bool = False) -> np.ndarray:
    """Position ids of a padded batch, equal to the first output of transformers' `get_rope_index`.

    Args:
        input_ids: `[B, T]` token ids.
        attention_mask: `[B, T]` 1 for tokens, 0 for padding (any side); None means no padding.
        config: token ids and timing.
        image_grid_thw, video_grid_thw: `[N, 3]` grids in patches, in order of appearance over the batch; with both
            None the text path (cumsum of the mask - 1, padding 1) is taken. The layout is checked against the
            inputs whenever grids or audio lengths are given.
        audio_seqlens: mel frames of every audio, standalone or in a video, in order of appearance.
        second_per_grids: seconds per temporal patch of every video.
        use_audio_in_video: videos are audio-in-video groups.

    Returns:
        `[3, B, T]` float32.

    Raises:
        ValueError: the layout does not match the inputs (a group without a grid or audio length, an input without
            a group, a placeholder count that is not the grid's or the audio's, an unclosed group).
    """
    ids = np.asarray(input_ids)
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {ids.shape}")
    mask = np.ones(ids.shape, np.int64) if attention_mask is None else np.asarray(attention_mask)
    if mask.shape != ids.shape or not np.isin(mask, (0, 1)).all():
        raise ValueError(f"attention_mask must be 0/1 of shape {ids.shape}, got shape {mask.shape}")
    mask = mask.astype(bool)
    multimodal = image_grid_thw is not None or video_grid_thw is not None
    if multimodal or len(np.asarray(audio_seqlens if audio_seqlens is not None else ()).reshape(-1)):
        media = _Media(image_grid_thw, video_grid_thw, audio_seqlens, second_per_grids)
        rows = [_parse_row(ids[b][mask[b]].tolist(), config, media, use_audio_in_video, f"row {b}")
                for b in range(ids.shape[0])]
        media.check_all_used()
    if not multimodal:
        pos = np.where(mask, np.cumsum(mask, axis=-1) - 1, 1).astype(_F32)  # [B, T]
        return np.broadcast_to(pos, (3,) + ids.shape).copy()
    out = np.zeros((3,) + ids.shape, _F32)  # [3, B, T]; padding stays 0
    for b, segments in enumerate(rows):
        out[:, b, mask[b]] = place(segments, config)
    return out


def rope_deltas(positions: np.ndarray, attention_mask: npt.ArrayLike) -> np.ndarray:
    """The reference's second output: max position of each row (padding included) + 1 - its token count. `[B, 1]`.

    transformers decodes token j after a prompt of length T (padding included) at T + delta - pads + j, i.e. at the
    row's max position + 1 + j (`Cursor.max_id + 1` for a stream).
    """
    mask = np.asarray(attention_mask)
    return (positions.max(axis=(0, 2)) + _F32(1) - mask.sum(-1).astype(_F32))[:, None]
