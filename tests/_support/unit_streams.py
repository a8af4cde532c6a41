"""Random unit streams for retention tests: the same session as plain-Python token records (for reference planners)
and as a vectorised `SequenceView` (for the jitted plans), with slots scattered over the view so that slot index and
age disagree, as they do in a paged cache after eviction and migration.

Layouts: Qwen2.5-Omni (audiovisual units: 2 bos, interleaved VIDEO/AUDIO runs, 2 eos; image units; text and
responses with chat markers) and MiniCPM-o (`<unit>`, `<image>` IMAGE×k `</image>`, slices `<slice>` SLICE×k
`</slice>`, AUDIO×k, text or response, `</unit>`), optionally after a SYSTEM prefix.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from omnijax.chunks.spans import SpanKind as K
from omnijax.retention.base import SequenceView


@dataclasses.dataclass(frozen=True)
class Token:
    """One live token: `order` is its age rank (larger = newer), unique within a stream."""

    order: int
    unit: int
    span: int
    offset: int
    score: float


def _runs(spans):
    """Offsets within span runs."""
    out, prev, k = [], None, 0
    for s in spans:
        k = k + 1 if s == prev else 0
        out.append(k)
        prev = s
    return out


def _qwen_unit(rng, kind):
    if kind == "av":
        spans = [K.BOUNDARY, K.BOUNDARY]
        for _ in range(rng.integers(1, 3)):
            spans += [K.VIDEO] * int(rng.integers(1, 9)) + [K.AUDIO] * int(rng.integers(1, 12))
        return spans + [K.BOUNDARY, K.BOUNDARY]
    if kind == "image":
        return [K.BOUNDARY] + [K.IMAGE] * int(rng.integers(1, 16)) + [K.BOUNDARY]
    if kind == "audio":
        return [K.BOUNDARY] + [K.AUDIO] * int(rng.integers(1, 20)) + [K.BOUNDARY]
    span = K.RESPONSE if kind == "response" else K.TEXT
    return [K.BOUNDARY] + [span] * int(rng.integers(1, 12)) + [K.BOUNDARY]


def _minicpm_unit(rng, kind, k):
    spans = [K.BOUNDARY]
    if kind in ("image", "av"):
        spans += [K.BOUNDARY] + [K.IMAGE] * k + [K.BOUNDARY]
        for _ in range(rng.integers(0, 4)):
            spans += [K.BOUNDARY] + [K.SLICE] * k + [K.BOUNDARY]
    if kind in ("audio", "av"):
        spans += [K.AUDIO] * int(rng.integers(1, 11))
    tail = rng.integers(0, 3)
    spans += [K.RESPONSE if kind == "response" else K.TEXT] * int(tail)
    return spans + [K.BOUNDARY]


def random_stream(rng: np.random.Generator, *, family: str | None = None, units: int | None = None,
                  system: bool | None = None, kinds: tuple[str, ...] | None = None) -> list[Token]:
    """A random session as token records, oldest first. Unit ids increase with time; the SYSTEM prefix is unit 0."""
    family = family or rng.choice(["qwen", "minicpm"])
    units = int(rng.integers(1, 12)) if units is None else units
    system = bool(rng.random() < 0.7) if system is None else system
    kinds = kinds or ("av", "image", "audio", "text", "response")
    slice_len = int(rng.integers(1, 6))
    spans, unit_ids = [], []
    if system:
        n = int(rng.integers(1, 8))
        spans += [K.SYSTEM] * n
        unit_ids += [0] * n
    for u in range(1, units + 1):
        kind = kinds[int(rng.integers(len(kinds)))]
        s = _qwen_unit(rng, kind) if family == "qwen" else _minicpm_unit(rng, kind, slice_len)
        spans += s
        unit_ids += [u] * len(s)
    offsets = _runs(list(zip(spans, unit_ids)))
    scores = rng.random(len(spans)).round(3)  # distinct-ish scores; ties broken by age in every planner
    return [Token(order=i, unit=unit_ids[i], span=int(spans[i]), offset=offsets[i], score=float(scores[i]))
            for i in range(len(spans))]


def to_view(streams: list[list[Token]], rng: np.random.Generator, *, capacity: int | None = None,
            axes: int = 1) -> SequenceView:
    """Batches streams into a `SequenceView`: each stream's tokens land on random slots among `capacity`, the rest
    of the slots are dead (and hold garbage metadata). Positions are the tokens' ages (1D; `axes` copies)."""
    B = len(streams)
    S = capacity or max(8, 2 * max(len(s) for s in streams))
    live = np.zeros((B, S), bool)
    fields = {name: rng.integers(-5, 50, (B, S)).astype(np.int32) for name in ("unit", "span", "offset", "order")}
    score = rng.random((B, S)).astype(np.float32)
    for b, stream in enumerate(streams):
        slots = rng.choice(S, size=len(stream), replace=False)
        for slot, t in zip(slots, stream):
            live[b, slot] = True
            fields["unit"][b, slot], fields["span"][b, slot] = t.unit, t.span
            fields["offset"][b, slot], fields["order"][b, slot] = t.offset, t.order
            score[b, slot] = t.score
    pos = np.broadcast_to(fields["order"], (axes, B, S)).copy()
    return SequenceView(live=jnp.asarray(live), pos=jnp.asarray(pos), unit=jnp.asarray(fields["unit"]),
                        span=jnp.asarray(fields["span"]), offset=jnp.asarray(fields["offset"]),
                        order=jnp.asarray(fields["order"]), score=jnp.asarray(score),
                        retained=jnp.asarray(live.sum(1).astype(np.int32)))


def kept_orders(view: SequenceView, keep) -> list[set[int]]:
    """The ages of the kept live tokens of each sequence (to compare with a reference planner's answer)."""
    keep = np.asarray(keep) & np.asarray(view.live)
    order = np.asarray(view.order)
    return [set(order[b][keep[b]].tolist()) for b in range(keep.shape[0])]
