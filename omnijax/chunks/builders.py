"""Model adapters: turn each model's input layout into batch-1 `Chunk`s with span metadata.

`omnijax.models.qwen2_5_omni.layout` (TMRoPE, 3 position axes) and `omnijax.models.minicpmo.layout` (1D positions) build
one chunk per streaming unit (or per segment of a unit; `concat` joins segments). This module holds what both share:
building a chunk from per-token arrays, offsets within span runs, joining chunks, adding zero embeddings, and
`token_layout`, which flattens chunks into the token ids and absolute positions a one-shot forward would see.

Positions in a chunk are offsets from the stream's cursor; the cursor moves by each chunk's `advance` after it
(`omnijax.stream`), and `token_layout` / `concat` apply the same rule.
"""

from __future__ import annotations

import dataclasses
from typing import AbstractSet, Iterable, Protocol, Sequence

import numpy as np
import numpy.typing as npt

from omnijax.chunks.chunk import Chunk
from omnijax.chunks.spans import SpanKind


def span_offsets(span: np.ndarray, unit: np.ndarray | None = None) -> np.ndarray:
    """Index of each token within its span run: a maximal run of consecutive tokens with equal span (and unit).

    `span`, `unit`: `[T]`. Returns `[T]` int32; e.g. spans B B V V V A A B give 0 1 0 1 2 0 1 0.
    """
    span = np.asarray(span).reshape(-1)
    key = span if unit is None else span.astype(np.int64) * (1 << 32) + np.asarray(unit, np.int64).reshape(-1)
    n = key.shape[0]
    if n == 0:
        return np.zeros(0, np.int32)
    starts = np.ones(n, bool)
    starts[1:] = key[1:] != key[:-1]
    run_start = np.maximum.accumulate(np.where(starts, np.arange(n), 0))
    return (np.arange(n) - run_start).astype(np.int32)


class MarkerIds(Protocol):
    """What `text_spans` reads of a family's id config (the families' layouts, a layer above)."""

    @property
    def placeholder_ids(self) -> AbstractSet[int]: ...

    @property
    def boundary_ids(self) -> AbstractSet[int]: ...

    @property
    def audio_start_token_id(self) -> int: ...

    @property
    def vision_start_token_id(self) -> int: ...


def text_spans(token_ids: Sequence[int], kind: SpanKind, tokens: MarkerIds, *,
               markers: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """`(ids [T] int64, span [T] int32)` of a text unit of a Qwen-style family: every token `kind`, the chat and
    modality markers BOUNDARY when `markers`. `tokens` (the family's id config) names the placeholders and the
    group starts, which text must not hold (each group has its own builder)."""
    ids = np.asarray(token_ids, np.int64).reshape(-1)
    bad = np.isin(ids, list(tokens.placeholder_ids) + [tokens.audio_start_token_id, tokens.vision_start_token_id])
    if bad.any():
        raise ValueError(f"text holds multimodal token {int(ids[bad][0])}: build that segment with its own builder "
                         f"(image_unit, audio_unit, ...) and join them with concat")
    span = np.full(ids.shape, int(kind), np.int32)
    if markers:
        span[np.isin(ids, list(tokens.boundary_ids))] = SpanKind.BOUNDARY
    return ids, span


def make_chunk(token_ids: Sequence[int] | np.ndarray, positions: np.ndarray, span: Sequence[int] | np.ndarray,
               unit: int | Sequence[int], *,
               answer_tokens: int = 0, answer_unit: int | None = None, embed_mask: np.ndarray | None = None,
               embeds: np.ndarray | None = None, advance: int | None = None,
               deepstack: np.ndarray | None = None) -> Chunk:
    """A batch-1, unpadded `Chunk` from per-token host arrays.

    Args:
        token_ids: `[T]` ids.
        positions: `[A, T]` offsets from the cursor (A = 3 for TMRoPE, 1 for 1D RoPE).
        span: `[T]` `SpanKind` values.
        unit: the unit id (or `[T]` ids).
        answer_tokens: greedy tokens to generate after the chunk.
        answer_unit: unit id of the generated response; default the chunk's last unit + 1.
        embed_mask: `[T]` bool, tokens whose embedding comes from `embeds`.
        embeds: `[T, D]` embeddings (zero where `embed_mask` is False); given with `embed_mask` or not at all.
        advance: cursor move after the chunk; default the largest offset + 1.
        deepstack: `[n, T, D]` DeepStack levels (Qwen3-Omni), zero away from visual tokens; needs `embeds`.
    """
    ids = np.asarray(token_ids, np.int64).reshape(-1)
    T = ids.shape[0]
    if T == 0:
        raise ValueError("a chunk needs at least one token")
    pos = np.asarray(positions)
    if pos.ndim != 2 or pos.shape[1] != T:
        raise ValueError(f"positions must be [axes, {T}], got {pos.shape}")
    span = np.asarray(span, np.int32).reshape(-1)
    units = np.broadcast_to(np.asarray(unit, np.int32), (T,)).copy()
    if span.shape != (T,):
        raise ValueError(f"span must have {T} entries, got {span.shape}")
    if (embeds is None) != (embed_mask is None):
        raise ValueError("embeds and embed_mask come together")
    if deepstack is not None and (embeds is None or np.shape(deepstack)[1:] != np.shape(embeds)):
        raise ValueError(f"deepstack must be [levels, T, D] beside embeds {np.shape(embeds)}, got "
                         f"{np.shape(deepstack)}")
    if answer_unit is None:
        answer_unit = int(units[-1]) + 1
    return Chunk(
        token_ids=ids.astype(np.int32)[None], valid=np.ones((1, T), bool), positions=pos.astype(np.int32)[:, None],
        unit=units[None], span=span[None], offset=span_offsets(span, units)[None],
        answer_tokens=np.asarray([answer_tokens], np.int32), answer_unit=np.asarray([answer_unit], np.int32),
        advance=np.asarray([int(pos.max()) + 1 if advance is None else advance], np.int32),
        embeds=None if embeds is None else np.asarray(embeds)[None],
        embed_mask=None if embed_mask is None else np.asarray(embed_mask, bool).reshape(1, T),
        deepstack=None if deepstack is None else np.asarray(deepstack)[:, None])


def place_embeds(ids: np.ndarray, groups: Sequence[tuple[np.ndarray, np.ndarray | None]],
                 hidden_size: int | None) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Embeddings `[T, D]` and mask `[T]` for a chunk whose placeholder tokens are given by `groups`.

    Each group is `(mask [T] bool, features [count, D] or None)`: the features fill the group's tokens in order
    (None leaves zeros). D comes from the features or `hidden_size`; with neither, returns `(None, None)` (positions
    and metadata only; see `with_embeds`).
    """
    sizes = {np.asarray(f).shape[-1] for _, f in groups if f is not None}
    if hidden_size is not None:
        sizes.add(int(hidden_size))
    if len(sizes) > 1:
        raise ValueError(f"embedding widths disagree: {sorted(sizes)}")
    if not sizes:
        return None, None
    D = sizes.pop()
    dtypes = [np.asarray(f).dtype for _, f in groups if f is not None]
    out = np.zeros((ids.shape[0], D), dtypes[0] if dtypes else np.float32)
    full = np.zeros(ids.shape[0], bool)
    for mask, features in groups:
        mask = np.asarray(mask, bool)
        full |= mask
        if features is None:
            continue
        features = np.asarray(features)
        features = features.reshape(-1, features.shape[-1])
        if features.shape[0] != int(mask.sum()):
            raise ValueError(f"got {features.shape[0]} embeddings for {int(mask.sum())} placeholder tokens")
        out[mask] = features
    return out, full


def with_embeds(chunk: Chunk, hidden_size: int, placeholder_ids: Iterable[int],
                dtype: npt.DTypeLike = np.float32) -> Chunk:
    """Adds zero embeddings `[B, T, hidden_size]` and a placeholder mask to a chunk built without them.

    A stack of chunks needs embeddings on every chunk or on none; use this on text chunks of a multimodal session.
    A chunk that already carries embeddings is returned unchanged.
    """
    if chunk.embeds is not None:
        if np.shape(chunk.embeds)[-1] != hidden_size:
            raise ValueError(f"chunk embeddings are {np.shape(chunk.embeds)[-1]} wide, not {hidden_size}")
        return chunk
    ids = np.asarray(chunk.token_ids)
    mask = np.isin(ids, np.asarray(list(placeholder_ids), ids.dtype)) & np.asarray(chunk.valid, bool)
    return dataclasses.replace(chunk, embeds=np.zeros(ids.shape + (hidden_size,), dtype), embed_mask=mask)


def unstack(chunks: Chunk | Sequence[Chunk]) -> list[Chunk]:
    """A list of batch-1 chunks from a chunk, a stacked chunk (`[C, 1, T]` fields) or a sequence of chunks."""
    if not isinstance(chunks, Chunk):
        return list(chunks)
    if np.ndim(chunks.token_ids) == 2:
        return [chunks]
    return [Chunk(*[None if f is None else np.asarray(f)[i] for f in _fields(chunks)])
            for i in range(np.shape(chunks.token_ids)[0])]


def token_layout(chunks: Chunk | Sequence[Chunk], start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token ids `[N]` and absolute positions `[A, N]` of batch-1 chunks streamed one after another.

    Valid tokens only, in order; positions = offsets + the cursor, which starts at `start` and moves by each
    chunk's `advance` (the rule of `omnijax.stream`). Generated answers are not included: a stream that
    generates tokens moves its cursor by their count, so represent them as response chunks here. Chunks with one
    position axis are broadcast to the widest axis count.
    """
    chunks = unstack(chunks)
    axes = max((np.shape(c.positions)[0] for c in chunks), default=1)
    ids, pos, cursor = [], [], int(start)
    for c in chunks:
        tok = np.asarray(c.token_ids)
        if tok.ndim != 2 or tok.shape[0] != 1:
            raise ValueError(f"token_layout takes batch-1 chunks, got token_ids of shape {tok.shape}")
        valid = np.asarray(c.valid, bool)[0]
        p = np.asarray(c.positions, np.int64)[:, 0][:, valid]
        ids.append(tok[0][valid].astype(np.int64))
        pos.append(np.broadcast_to(p, (axes, p.shape[1])) + cursor)
        cursor += int(np.asarray(c.advance)[0])
    if not ids:
        return np.zeros(0, np.int64), np.zeros((axes, 0), np.int64)
    return np.concatenate(ids), np.concatenate(pos, axis=1)


def concat(chunks: Sequence[Chunk]) -> Chunk:
    """Joins batch-1 chunks (e.g. the segments of one unit) into one unpadded chunk.

    Each part's offsets are shifted by the cursor advance of the parts before it, so streaming the result equals
    streaming the parts. Unit ids and spans are kept; offsets are recomputed over span runs of the joined sequence;
    `answer_tokens` and `answer_unit` come from the last part. Either every part carries embeddings or none does.
    """
    chunks = unstack(chunks)
    if not chunks:
        raise ValueError("nothing to concatenate")
    if len({c.embeds is None for c in chunks}) != 1:
        raise ValueError("either every chunk carries embeddings or none does (see with_embeds)")
    levels = {np.shape(c.deepstack)[0] for c in chunks if c.deepstack is not None}
    if len(levels) > 1:
        raise ValueError(f"parts carry different numbers of DeepStack levels: {sorted(levels)}")
    axes = max(np.shape(c.positions)[0] for c in chunks)
    ids, pos, span, unit, emb, mask, stack, cursor = [], [], [], [], [], [], [], 0
    for c in chunks:
        valid = np.asarray(c.valid, bool)[0]
        p = np.asarray(c.positions, np.int64)[:, 0][:, valid]
        ids.append(np.asarray(c.token_ids)[0][valid])
        pos.append(np.broadcast_to(p, (axes, p.shape[1])) + cursor)
        span.append(np.asarray(c.span)[0][valid])
        unit.append(np.asarray(c.unit)[0][valid])
        if c.embeds is not None:
            emb.append(np.asarray(c.embeds)[0][valid])
            mask.append(np.asarray(c.embed_mask, bool)[0][valid])
        if levels:  # parts without DeepStack levels get zeros (text between images)
            D = np.shape(c.embeds)[-1]
            stack.append(np.zeros((min(levels), int(valid.sum()), D), np.float32) if c.deepstack is None
                         else np.asarray(c.deepstack)[:, 0][:, valid])
        cursor += int(np.asarray(c.advance)[0])
    last = chunks[-1]
    return make_chunk(np.concatenate(ids), np.concatenate(pos, axis=1), np.concatenate(span), np.concatenate(unit),
                      answer_tokens=int(np.asarray(last.answer_tokens)[0]),
                      answer_unit=int(np.asarray(last.answer_unit)[0]), advance=cursor,
                      embeds=np.concatenate(emb) if emb else None, embed_mask=np.concatenate(mask) if mask else None,
                      deepstack=np.concatenate(stack, axis=1) if stack else None)


def _fields(chunk: Chunk) -> list:
    return [getattr(chunk, f.name) for f in dataclasses.fields(Chunk)]


__all__ = ["SpanKind", "concat", "make_chunk", "place_embeds", "span_offsets", "text_spans", "token_layout", "unstack",
           "with_embeds"]
