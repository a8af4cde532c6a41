"""Session plots: how the KV cache and the per-step latency evolve over a streamed session.

    result = omnijax.stream(model, chunks, policy=OmniPick(...))
    plot.session(plot.trace_of(result, chunks=chunks), "session.png")     # or plot.session(result, ...), or a Chat
    plot.compare({"NoSlide": a, "OmniPick": b, "OmniPick+tile_skip": c}, "compare.png")

A `SessionTrace` holds one sequence's figures per step (a streamed chunk, or an answer block of a `Chat`): the
retained cells and the physical span attention traverses (cells), the active pages, the step's latency (NaN when
not measured: one `omnijax.stream` call is a single compiled program, so it has no per-step times) and a label per
step ("system", "av", "text", "answer", ...). `trace_of` reads it from an `omnijax.StreamResult`; a `Chat` makes
its own (`chat.trace()`).

Both plots have three panels over the steps: retained cells and physical span, active pages, latency (ms).
`session` marks each step with the colour of its label; `compare` draws one line per named run. matplotlib (the
`plot` extra: `pip install 'omnijax[plot]'`) is imported only when a plot is drawn, with the Agg renderer (no
display, no pyplot state).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from omnijax.chunks.chunk import Chunk
from omnijax.chunks.spans import SpanKind
from omnijax.streaming.step import StreamResult

__all__ = ["SessionTrace", "compare", "session", "trace_of"]


@dataclasses.dataclass(frozen=True)
class SessionTrace:
    """One sequence's figures over a session's `n` steps.

    Attributes:
        retained: `[n]` retained cells after each step.
        physical_span: `[n]` page-rounded extent attention traverses after each step (cells).
        active_pages: `[n]` pages holding at least one live cell.
        latency_ms: `[n]` float wall time of each step (NaN when unknown).
        labels: `n` step kinds ("system", "av", "text", "answer", ...).
        page_size: cells per page.
    """

    retained: np.ndarray
    physical_span: np.ndarray
    active_pages: np.ndarray
    latency_ms: np.ndarray
    labels: tuple[str, ...]
    page_size: int

    def __post_init__(self):
        n = None
        for name in ("retained", "physical_span", "active_pages", "latency_ms"):
            value = np.asarray(getattr(self, name), np.float64 if name == "latency_ms" else np.int64)
            if value.ndim != 1:
                raise ValueError(f"SessionTrace.{name} must be one value per step ([n]), got shape {value.shape}")
            n = value.shape[0] if n is None else n
            if value.shape[0] != n:
                raise ValueError(f"SessionTrace.{name} has {value.shape[0]} steps, retained has {n}")
            object.__setattr__(self, name, value)
        labels = tuple(str(label) for label in self.labels)
        if len(labels) != n:
            raise ValueError(f"SessionTrace.labels has {len(labels)} entries for {n} steps")
        object.__setattr__(self, "labels", labels)
        if isinstance(self.page_size, bool) or int(self.page_size) != self.page_size or self.page_size < 1:
            raise ValueError(f"SessionTrace.page_size must be a positive integer, got {self.page_size!r}")
        object.__setattr__(self, "page_size", int(self.page_size))

    @property
    def steps(self) -> int:
        return int(self.retained.shape[0])


def _input_kind(spans: np.ndarray) -> str:
    """A step's kind from the span kinds of its valid tokens."""

    present = set(int(s) for s in spans)
    if not present:
        return "empty"
    if present & {SpanKind.IMAGE, SpanKind.SLICE, SpanKind.VIDEO, SpanKind.AUDIO}:
        return "av"
    for kind, label in ((SpanKind.SYSTEM, "system"), (SpanKind.TEXT, "text"), (SpanKind.RESPONSE, "response")):
        if kind in present:
            return label
    return "boundary"


def trace_of(result: StreamResult, sequence: int = 0, latency_ms: npt.ArrayLike | None = None, *,
             chunks: Chunk | None = None, labels: Sequence[str] | None = None) -> SessionTrace:
    """The `SessionTrace` of one sequence of an `omnijax.StreamResult` (`result.stats.layout`, after each chunk).

    Args:
        result: what `omnijax.stream` returned.
        sequence: the batch row.
        latency_ms: `[C]` per-step wall times, if measured (default NaN).
        chunks: the stacked chunks streamed; when given, each step is labelled by what it fed ("system", "av" for
            any image / video / audio, "text", "response", "empty" where the sequence had no token).
        labels: explicit labels (`C` of them), overriding the above.

    Without `labels`, a step that generated answer tokens is labelled "answer"; other steps take their input's kind
    (`chunks` given) or "chunk".
    """
    layout = result.stats.layout
    columns = [np.asarray(x) for x in (layout.retained_cells, layout.physical_span, layout.active_pages)]
    steps, batch = columns[0].shape
    if not 0 <= sequence < batch:
        raise IndexError(f"sequence {sequence} out of range: the result has {batch} sequence(s)")
    if latency_ms is None:
        latency = np.full(steps, np.nan)
    else:
        latency = np.asarray(latency_ms, np.float64)
        if latency.shape != (steps,):
            raise ValueError(f"latency_ms must have one value per step ({steps}), got shape {latency.shape}")
    if labels is None:
        answered = (np.asarray(result.tokens)[:, sequence] >= 0).any(axis=-1)
        if chunks is not None:
            spans, valid = np.asarray(chunks.span)[:, sequence], np.asarray(chunks.valid)[:, sequence]
            if spans.shape[0] != steps:
                raise ValueError(f"chunks hold {spans.shape[0]} steps, the result {steps}")
            kinds = [_input_kind(spans[c][valid[c]]) for c in range(steps)]
        else:
            kinds = ["chunk"] * steps
        labels = tuple("answer" if answered[c] else kinds[c] for c in range(steps))
    return SessionTrace(retained=columns[0][:, sequence], physical_span=columns[1][:, sequence],
                        active_pages=columns[2][:, sequence], latency_ms=latency, labels=tuple(labels),
                        page_size=int(result.state.kv.page_size))


def _as_trace(source, what: str = "session()") -> SessionTrace:
    if isinstance(source, SessionTrace):
        return source
    trace = getattr(source, "trace", None)
    if callable(trace):
        made = trace()
        if not isinstance(made, SessionTrace):
            raise TypeError(f"{type(source).__name__}.trace() returned {type(made).__name__}, not a SessionTrace")
        return made

    if isinstance(source, StreamResult):
        return trace_of(source)
    raise TypeError(f"{what} takes a SessionTrace, an omnijax.StreamResult or an object with a trace() method "
                    f"(such as omnijax.Chat), got {type(source).__module__}.{type(source).__qualname__}")


def _figure(title: str):
    """A three-panel matplotlib `Figure` (Agg canvas) sharing the step axis."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # optional (omnijax[plot])
        from matplotlib.figure import Figure  # optional (omnijax[plot])
    except ImportError as e:
        raise ImportError("omnijax.plot draws with matplotlib: pip install 'omnijax[plot]' (or pip install "
                          "matplotlib)") from e
    figure = Figure(figsize=(10, 8), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(3, 1, sharex=True)
    figure.suptitle(title)
    axes[0].set_ylabel("cells")
    axes[1].set_ylabel("active pages")
    axes[2].set_ylabel("latency (ms)")
    axes[2].set_xlabel("step")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return figure, axes


def _save(figure, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=100)
    return path


def _latency_top(latencies) -> float | None:
    """Where the latency panel stops, to keep it on the steady state: a few steps that compiled a program (seconds,
    not ms) would flatten the rest, so the axis stops at 4x the median when they exceed it (None: no clipping)."""
    values = np.concatenate([np.asarray(v, np.float64)[np.isfinite(v)] for v in latencies])
    if values.size == 0:
        return None
    top = 4 * float(np.median(values))
    return top if values.max() > top > 0 else None


def _plot_latency(ax, steps: np.ndarray, latency: np.ndarray, top: float | None, **style) -> None:
    """One run's latency line; steps above `top` break the line (no stroke runs off the panel) and are marked with
    a triangle on its top edge."""
    if top is None:
        ax.plot(steps, latency, **style)
        return
    over = np.isfinite(latency) & (latency > top)
    ax.plot(steps, np.where(over, np.nan, latency), **style)
    if over.any():
        ax.scatter(steps[over], np.full(int(over.sum()), top), marker="^", s=24, color=style.get("color", "0.6"),
                   clip_on=False, zorder=3)


def _note_clipped(ax, latencies, top: float | None) -> None:
    if top is None:
        return
    values = np.concatenate([np.asarray(v, np.float64)[np.isfinite(v)] for v in latencies])
    ax.set_ylim(0, top)
    ax.text(0.99, 0.95, f"{int((values > top).sum())} step(s) above {top:.0f} ms (compilation) on the top edge (^)",
            transform=ax.transAxes, ha="right", va="top", fontsize="small", color="0.4")


def _no_latency(ax) -> None:
    ax.text(0.5, 0.5, "latency not measured", transform=ax.transAxes, ha="center", va="center", color="0.4")


def session(source: object, path: str | Path, *, title: str | None = None) -> Path:
    """Plots one session (a `SessionTrace`, a `StreamResult` or an object with `trace()`) to a PNG at `path`.

    Panels: retained cells and physical span (cells); active pages; per-step latency (ms). Each step is marked in
    the colour of its label. Returns the path written.
    """
    trace = _as_trace(source)
    figure, axes = _figure(title or f"session: {trace.steps} steps, page size {trace.page_size}")
    steps = np.arange(trace.steps)
    axes[0].plot(steps, trace.retained, color="0.2", label="retained cells")
    axes[0].plot(steps, trace.physical_span, color="0.2", linestyle="--", label="physical span")
    axes[1].plot(steps, trace.active_pages, color="0.2", drawstyle="steps-mid")
    latency = trace.latency_ms
    top = _latency_top([latency])
    if np.isfinite(latency).any():
        _plot_latency(axes[2], steps, latency, top, color="0.6", linewidth=0.8)
        _note_clipped(axes[2], [latency], top)
    else:
        _no_latency(axes[2])
    kinds = list(dict.fromkeys(trace.labels))  # in order of appearance
    colours = {kind: f"C{i % 10}" for i, kind in enumerate(kinds)}
    for kind in kinds:
        mask = np.asarray([label == kind for label in trace.labels])
        axes[0].scatter(steps[mask], trace.retained[mask], s=14, color=colours[kind], zorder=3, label=kind)
        axes[1].scatter(steps[mask], trace.active_pages[mask], s=14, color=colours[kind], zorder=3)
        finite = mask & np.isfinite(latency) & ~(latency > (np.inf if top is None else top))
        if finite.any():
            axes[2].scatter(steps[finite], latency[finite], s=14, color=colours[kind], zorder=3)
    axes[0].legend(loc="upper left", fontsize="small", ncols=2)
    return _save(figure, path)


def compare(traces: Mapping[str, object], path: str | Path, *, title: str | None = None) -> Path:
    """Plots several named runs (each a `SessionTrace`, a `StreamResult` or an object with `trace()`) on the same
    three panels, one colour per run (physical span dashed). Returns the path written."""
    if not isinstance(traces, Mapping) or not traces:
        raise ValueError("compare() takes a non-empty dict of run name -> SessionTrace")
    runs = {str(name): _as_trace(source, "compare()") for name, source in traces.items()}
    figure, axes = _figure(title or f"{len(runs)} runs")
    top = _latency_top([trace.latency_ms for trace in runs.values()])
    measured = False
    for i, (name, trace) in enumerate(runs.items()):
        colour, steps = f"C{i % 10}", np.arange(trace.steps)
        axes[0].plot(steps, trace.retained, color=colour, label=f"{name}: retained")
        axes[0].plot(steps, trace.physical_span, color=colour, linestyle="--", label=f"{name}: span")
        axes[1].plot(steps, trace.active_pages, color=colour, drawstyle="steps-mid", label=name)
        if np.isfinite(trace.latency_ms).any():
            _plot_latency(axes[2], steps, trace.latency_ms, top, color=colour, marker=".", label=name)
            measured = True
    if measured:
        axes[2].legend(loc="upper left", fontsize="small")
        _note_clipped(axes[2], [trace.latency_ms for trace in runs.values()], top)
    else:
        _no_latency(axes[2])
    axes[0].legend(loc="upper left", fontsize="small", ncols=2)
    axes[1].legend(loc="upper left", fontsize="small")
    return _save(figure, path)
