"""`Chunk`: one streaming event's tokens, positions and span metadata, padded to a fixed length.

Positions in a chunk are offsets relative to the stream's next-position cursor, so retention that re-indexes the
cache (and moves the cursor) never invalidates chunks built in advance. After the chunk the cursor moves by the
chunk's `advance`: usually its largest valid offset + 1 (TMRoPE: the next segment starts after the previous one's
max position), but an audio-in-video unit ends with eos markers that can sit below an earlier video position, and
the next segment starts after those markers.

Shapes for one chunk (B sequences, T padded length, A position axes, D hidden); a stack of chunks for
`omnijax.stream` has a leading `[num_chunks]` axis on every field.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import jax
import numpy as np

from omnijax.chunks.spans import SpanKind
from omnijax.decoding import MAX_LOGIT_BIAS, ROW_WIDTH, DecodingStrategy, check_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Chunk:
    """A chunk of a streaming session.

    Attributes:
        token_ids: `[B, T]` int32 token ids (placeholders where `embed_mask` is set).
        valid: `[B, T]` bool; padding is False and is neither written nor attended.
        positions: `[A, B, T]` int32 position offsets relative to the cursor.
        unit: `[B, T]` int32 unit id of each token.
        span: `[B, T]` int32 `SpanKind` of each token.
        offset: `[B, T]` int32 offset within the span.
        answer_tokens: `[B]` int32 greedy tokens to generate after the chunk (0 = no answer; at most the stream's
            `max_answer_tokens`).
        answer_unit: `[B]` int32 unit id given to the generated response.
        advance: `[B]` int32 cursor move after the chunk (0 for a sequence with no valid token).
        embeds: optional `[B, T, D]` embeddings used where `embed_mask` is True (multimodal features).
        embed_mask: optional `[B, T]` bool.
        deepstack: optional `[n, B, T, D]` DeepStack levels (Qwen3-Omni vision; zero away from visual tokens),
            level i added to the hidden states after decoder layer i. Needs `embeds`.
        sampling: optional `[B, ROW_WIDTH]` float32 per-sequence decoding settings of this chunk's answer tokens,
            read by a per-row strategy (`omnijax.decoding.RowSampling`; rows from `omnijax.decoding.sampling_row`).
    """

    token_ids: jax.Array
    valid: jax.Array
    positions: jax.Array
    unit: jax.Array
    span: jax.Array
    offset: jax.Array
    answer_tokens: jax.Array
    answer_unit: jax.Array
    advance: jax.Array
    embeds: jax.Array | None = None
    embed_mask: jax.Array | None = None
    deepstack: jax.Array | None = None
    sampling: jax.Array | None = None

    @property
    def length(self) -> int:
        return self.token_ids.shape[-1]


def text_chunk(tokens: Sequence[int] | np.ndarray, *, length: int | None = None, unit: int = 0,
               span: SpanKind = SpanKind.TEXT, position_axes: int = 1, answer_tokens: int = 0) -> Chunk:
    """A batch-1 chunk of text tokens at consecutive positions, padded to `length`.

    Text has equal t/h/w positions, so one position axis suffices (it drives all three mrope axes); pass
    `position_axes=3` to spell the axes out.
    """
    tokens = np.asarray(tokens).reshape(-1)
    n = tokens.shape[0]
    if n == 0:
        raise ValueError("a text chunk needs at least one token")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"text chunk tokens must be integer token ids, got dtype {tokens.dtype}")
    length = n if length is None else length
    if n > length:
        raise ValueError(f"a text chunk holds at most length={length} tokens, got {n}")
    ids = np.zeros((1, length), np.int32)
    ids[0, :n] = tokens
    valid = np.zeros((1, length), bool)
    valid[0, :n] = True
    offs = np.where(valid, np.arange(length, dtype=np.int32)[None], 0).astype(np.int32)
    return Chunk(
        token_ids=ids, valid=valid, positions=np.broadcast_to(offs, (position_axes, 1, length)).copy(),
        unit=np.full((1, length), unit, np.int32), span=np.full((1, length), int(span), np.int32),
        offset=offs, answer_tokens=np.asarray([answer_tokens], np.int32),
        answer_unit=np.asarray([unit + 1], np.int32), advance=np.asarray([n], np.int32))


def stack_chunks(chunks: Sequence[Chunk]) -> Chunk:
    """Stacks equally shaped chunks along a new leading `[num_chunks]` axis (padding each to the longest first)."""
    if not chunks:
        raise ValueError("no chunks to stack")
    length = max(c.length for c in chunks)
    padded = [pad_chunk(c, length) for c in chunks]
    kinds = {(c.embeds is None, c.embed_mask is None) for c in padded}
    if len(kinds) != 1:
        raise ValueError("either every chunk carries embeddings or none does")
    if len({None if c.deepstack is None else np.shape(c.deepstack)[0] for c in padded}) != 1:
        raise ValueError("either every chunk carries the same number of DeepStack levels or none does")
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *padded)


def pad_chunk(chunk: Chunk, length: int) -> Chunk:
    """Pads a chunk's token axis to `length` with invalid tokens."""
    extra = length - chunk.length
    if extra < 0:
        raise ValueError(f"chunk of length {chunk.length} is longer than {length}")
    if extra == 0:
        return chunk

    def pad(x, axis):
        x = np.asarray(x)
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, extra)
        return np.pad(x, widths)

    return dataclasses.replace(
        chunk, token_ids=pad(chunk.token_ids, 1), valid=pad(chunk.valid, 1), positions=pad(chunk.positions, 2),
        unit=pad(chunk.unit, 1), span=pad(chunk.span, 1), offset=pad(chunk.offset, 1),
        embeds=None if chunk.embeds is None else pad(chunk.embeds, 1),
        embed_mask=None if chunk.embed_mask is None else pad(chunk.embed_mask, 1),
        deepstack=None if chunk.deepstack is None else pad(chunk.deepstack, 2))


def split_text(tokens: Sequence[int], num_chunks: int, *, position_axes: int = 1,
               answer_tokens: int = 0) -> Chunk:
    """Splits one token sequence into `num_chunks` near-equal text chunks (units 0, 1, ...), stacked.

    The last chunk asks for `answer_tokens` greedy tokens.
    """
    parts = np.array_split(np.asarray(tokens, np.int32), num_chunks)
    if any(len(p) == 0 for p in parts):
        raise ValueError(f"cannot split {len(tokens)} tokens into {num_chunks} non-empty chunks")
    length = max(len(p) for p in parts)
    return stack_chunks([
        text_chunk(p, length=length, unit=i, position_axes=position_axes,
                   answer_tokens=answer_tokens if i == num_chunks - 1 else 0)
        for i, p in enumerate(parts)])


def split_chunk(chunk: Chunk, max_len: int) -> list[Chunk]:
    """Splits a batch-1 chunk into consecutive parts of at most `max_len` tokens that stream as the whole does.

    Each part's position offsets are taken relative to a base: the smallest offset of that part and every later one
    (a non-decreasing base, so offsets stay non-negative), and a part advances the cursor by the next part's base
    minus its own (the last part by the whole chunk's advance minus its base). Every token therefore lands at the
    position it has in the whole chunk, on every axis, and the cursor ends where the whole chunk leaves it. Unit,
    span, span offsets, embeddings and DeepStack levels are cut alongside; only the last part asks for the answer.
    Padding (invalid tokens) past the last valid token is dropped.

    Args:
        chunk: a `[1, T]` chunk (text or media).
        max_len: the most tokens of a part (>= 1).

    Returns:
        The parts, in order (the chunk itself, without trailing padding, when it fits).
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    valid = np.asarray(chunk.valid).astype(bool)
    if valid.ndim != 2 or valid.shape[0] != 1:
        raise ValueError(f"split_chunk takes one session's chunk ([1, T]), got valid of shape {valid.shape}")
    n = int(np.flatnonzero(valid[0])[-1]) + 1 if valid.any() else 0
    if n <= max_len:
        return [chunk if n == chunk.length else _cut(chunk, 0, n, 0, int(np.asarray(chunk.advance)[0]), True)]
    pos = np.asarray(chunk.positions)  # [A, 1, T]
    lowest = np.where(valid[0], pos[:, 0].min(axis=0), np.iinfo(np.int32).max)[:n]  # [n] per token, all axes
    bounds = list(range(0, n, max_len)) + [n]
    bases = [int(lowest[a:].min()) for a in bounds[:-1]]  # suffix minima: non-decreasing
    advance = int(np.asarray(chunk.advance)[0])
    parts = []
    for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        last = b == n
        step = advance - bases[k] if last else bases[k + 1] - bases[k]
        parts.append(_cut(chunk, a, b, bases[k], step, last))
    return parts


def _cut(chunk: Chunk, a: int, b: int, base: int, advance: int, last: bool) -> Chunk:
    """Tokens [a, b) of a batch-1 chunk with positions less `base`, the given advance, the answer only if `last`."""
    cut = lambda x: None if x is None else np.asarray(x)[:, a:b]  # noqa: E731  ([1, T] fields)
    valid = cut(chunk.valid)
    positions = np.where(valid[None], np.asarray(chunk.positions)[:, :, a:b] - base, 0).astype(np.int32)
    return dataclasses.replace(
        chunk, token_ids=cut(chunk.token_ids), valid=valid, unit=cut(chunk.unit), span=cut(chunk.span),
        offset=cut(chunk.offset), positions=positions, embeds=cut(chunk.embeds), embed_mask=cut(chunk.embed_mask),
        answer_tokens=np.asarray(chunk.answer_tokens) * int(last), advance=np.asarray([advance], np.int32),
        deepstack=None if chunk.deepstack is None else np.asarray(chunk.deepstack)[:, :, a:b])


class DecoderLimits(Protocol):
    """What `validate` reads of a model's `DecoderConfig` (omnijax.models.config, a layer above)."""

    @property
    def position_axes(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def num_layers(self) -> int: ...


def validate(chunk: Chunk, config: DecoderLimits, *, max_answer_tokens: int, stacked: bool,
             decoding: DecodingStrategy | None = None) -> None:
    """Checks a chunk (or a stack of chunks) on the host before it enters a compiled program.

    Args:
        chunk: the chunk; with `stacked`, every field has a leading `[num_chunks]` axis.
        config: the model's `DecoderConfig`.
        max_answer_tokens: tau of the stream or session.
        stacked: whether `chunk` is a stack.
        decoding: the decoding strategy the chunk is answered with: per-row `sampling` needs a per-row one.

    Raises:
        ValueError: naming the field and what is wrong with it.
    """
    lead = 1 if stacked else 0
    what = "stacked chunks" if stacked else "chunk"
    ids = np.asarray(chunk.token_ids)
    if ids.ndim != 2 + lead:
        want = "[C, B, T]" if stacked else "[B, T]"
        raise ValueError(f"{what}: token_ids must be {want}, got shape {ids.shape}"
                         + ("; stack chunks with omnijax.stack_chunks" if stacked and ids.ndim == 2 else ""))
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{what}: token_ids must be integers, got dtype {ids.dtype}")
    bt = ids.shape
    for name in ("valid", "unit", "span", "offset"):
        if np.shape(getattr(chunk, name)) != bt:
            raise ValueError(f"{what}: {name} has shape {np.shape(getattr(chunk, name))}, token_ids has {bt}")
    pos = np.asarray(chunk.positions)
    axes = pos.shape[lead] if pos.ndim == 3 + lead else None
    if axes not in (1, config.position_axes) or pos.shape[:lead] + pos.shape[lead + 1:] != bt:
        raise ValueError(f"{what}: positions must have {config.position_axes} (or 1) axes before the token shape "
                         f"{bt[lead:]}, got shape {pos.shape}")
    valid = np.asarray(chunk.valid).astype(bool)
    if valid.any() and (pos.min(axis=lead)[valid] < 0).any():
        raise ValueError(f"{what}: position offsets must be non-negative")
    plain = valid if chunk.embed_mask is None else valid & ~np.asarray(chunk.embed_mask).astype(bool)
    if plain.any() and (ids[plain].min() < 0 or ids[plain].max() >= config.vocab_size):
        raise ValueError(f"{what}: token ids must lie in [0, {config.vocab_size}), got range "
                         f"[{ids[plain].min()}, {ids[plain].max()}]")
    for name, described in (("unit", "unit ids of valid tokens must be non-negative (-1 marks an empty cache slot)"),
                            ("offset", "offsets within spans must be non-negative")):
        lowest = np.asarray(getattr(chunk, name))[valid].min(initial=0)
        if lowest < 0:
            raise ValueError(f"{what}: {described}, got {lowest}")
    spans = np.asarray(chunk.span)[valid]
    if not np.isin(spans, [int(kind) for kind in SpanKind]).all():
        raise ValueError(f"{what}: span kinds must be omnijax.chunks.spans.SpanKind values, got "
                         f"{sorted(set(spans.tolist()) - {int(kind) for kind in SpanKind})}")
    answers = np.asarray(chunk.answer_tokens)
    per_sequence = {"answer_tokens": answers, "answer_unit": chunk.answer_unit, "advance": chunk.advance}
    for name, value in per_sequence.items():
        if np.shape(value) != bt[:-1]:
            raise ValueError(f"{what}: {name} must have shape {bt[:-1]}, got {np.shape(value)}")
    if (np.asarray(chunk.advance) < 0).any():
        raise ValueError(f"{what}: advance must be non-negative")
    if (np.asarray(chunk.answer_unit)[answers > 0] < 0).any():
        raise ValueError(f"{what}: answer_unit must be non-negative where answer_tokens > 0")
    if answers.size and (answers.min() < 0 or answers.max() > max_answer_tokens):
        raise ValueError(f"{what}: answer_tokens must lie in [0, max_answer_tokens={max_answer_tokens}], got "
                         f"up to {answers.max()}")
    if (chunk.embeds is None) != (chunk.embed_mask is None):
        raise ValueError(f"{what}: embeds and embed_mask come together")
    if chunk.embeds is not None:
        if np.shape(chunk.embed_mask) != bt or np.shape(chunk.embeds) != bt + (config.hidden_size,):
            raise ValueError(f"{what}: embeds must be {bt + (config.hidden_size,)} with embed_mask {bt}, got "
                             f"{np.shape(chunk.embeds)} and {np.shape(chunk.embed_mask)}")
        if not np.isfinite(np.asarray(chunk.embeds, np.float32)[np.asarray(chunk.embed_mask, bool)]).all():
            raise ValueError(f"{what}: embeds hold NaN or infinite values")
    if chunk.deepstack is not None:
        shape = np.shape(chunk.deepstack)
        if chunk.embeds is None or len(shape) != len(bt) + 2 or shape[:lead] + shape[lead + 1:] != \
                bt + (config.hidden_size,):
            raise ValueError(f"{what}: deepstack must be [levels, ...{bt}, {config.hidden_size}] beside embeds, got "
                             f"{shape}")
        if shape[lead] > config.num_layers:
            raise ValueError(f"{what}: {shape[lead]} DeepStack levels for a {config.num_layers}-layer decoder")
    if chunk.sampling is not None:
        if decoding is not None and not getattr(decoding, "per_row", False):
            raise ValueError(f"{what}: carries per-row sampling settings but decodes with {decoding!r}, which would "
                             f"ignore them; decode with omnijax.decoding.RowSampling()")
        rows = np.asarray(chunk.sampling)
        if rows.shape != bt[:-1] + (ROW_WIDTH,):
            raise ValueError(f"{what}: sampling must be {bt[:-1] + (ROW_WIDTH,)} (one row of settings per sequence), "
                             f"got {rows.shape}; build the rows with omnijax.decoding.sampling_row")
        wrong = check_rows(rows)
        if wrong is None and (rows[..., -2 * MAX_LOGIT_BIAS:-MAX_LOGIT_BIAS] >= config.vocab_size).any():
            wrong = f"logit-bias ids below the vocabulary size {config.vocab_size}"
        if wrong is not None:
            raise ValueError(f"{what}: sampling rows need {wrong}; build them with omnijax.decoding.sampling_row")
