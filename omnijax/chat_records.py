"""What a `Chat` records of its session: each fed unit (`UnitRecord`), each step's cache figures (`StepRecord`), and
what the cache keeps of each unit (`KeptRow`, as `Chat.kept()` returns it), with the tables the commands print.

`omnijax.chat` re-exports every name here.
"""

from __future__ import annotations

import dataclasses

__all__ = ["KeptRow", "StepRecord", "UnitRecord", "clock", "format_kept", "kept_by_kind"]


@dataclasses.dataclass(frozen=True)
class UnitRecord:
    """One fed unit: its id, kind ("system", "user", "answer", "image", "audio", "av"), a short label, and the
    tokens it fed per span kind (`{SpanKind: count}`)."""

    unit: int
    kind: str
    label: str
    fed: dict


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One step of the session (a fed chunk or an answer block): cache figures after it and its wall time."""

    label: str
    retained: int
    physical_span: int
    active_pages: int
    latency_ms: float


@dataclasses.dataclass(frozen=True)
class KeptRow:
    """What the cache holds of one unit's span kind: `kept` of `fed` tokens."""

    unit: int
    kind: str
    label: str
    span: str
    fed: int
    kept: int


def format_kept(rows: list[KeptRow]) -> str:
    """`Chat.kept()` rows as an aligned table."""
    header = ("unit", "kind", "label", "span", "fed", "kept")
    table = [header] + [("" if r.unit < 0 else str(r.unit), r.kind, r.label, r.span, str(r.fed), str(r.kept))
                        for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i in (0, 4, 5) else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in table]
    return "\n".join(lines)


def kept_by_kind(rows: list[KeptRow]) -> list[KeptRow]:
    """`Chat.kept()` rows summed per unit kind and span kind (label: how many units), in order of appearance."""
    totals: dict[tuple[str, str], list] = {}
    for r in rows:
        entry = totals.setdefault((r.kind, r.span), [set(), 0, 0])
        entry[0].add(r.unit)
        entry[1] += r.fed
        entry[2] += r.kept
    return [KeptRow(-1, kind, f"{len(units)} unit{'s' if len(units) > 1 else ''}", span, fed, kept)
            for (kind, span), (units, fed, kept) in totals.items()]


def clock(seconds: float) -> str:
    """`M:SS` of a time in seconds."""
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"
