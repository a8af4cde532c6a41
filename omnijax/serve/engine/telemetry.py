"""Per-frame telemetry of a Metronome engine, stall detection, and the first-order saturation model (Metronome §3.1).

Every tick records one `FrameRecord`: wall latency, pool occupancy (pages in use / pool pages), running and waiting
sessions, tokens produced, tokens dropped, empty frames. Stalls are explicit `StallEvent`s with counters, never
silent:

    pool_exhausted     some session's tokens could not be written because the pool had no free page
    page_table_full    ... because its page-table row was full (pool pages were still free)
    session_preempted  a session hit exhaustion and is parked: its later frames come back empty
    empty_frames       frames that asked for answer tokens came back with none

First-order model: under unbounded KV each of N sessions appends at a steady rate r (fraction of the pool per tick),
so occupancy(t) = rho0 + N r t and the pool saturates at t_sat = (1 - rho0) / (N r). `Telemetry.saturation_fit`
fits rho0 and N r by least squares on the early trace and reports the predicted t_sat (ticks, and seconds both at
the nominal frame budget and from a fit against wall time) next to the measured saturation tick.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

EVENT_KINDS = ("pool_exhausted", "page_table_full", "session_preempted", "empty_frames")


@dataclasses.dataclass(frozen=True)
class StallEvent:
    """One stall signal.

    Attributes:
        kind: one of `EVENT_KINDS`.
        tick: tick index (0-based) it happened in.
        time_s: seconds since the telemetry started (tick start).
        sessions: the sessions concerned.
        count: tokens dropped (exhaustion), sessions preempted, or empty frames.
        detail: a human-readable explanation.
    """

    kind: str
    tick: int
    time_s: float
    sessions: tuple[str, ...]
    count: int
    detail: str

    def to_dict(self) -> dict:
        row = dataclasses.asdict(self)
        row["sessions"] = list(self.sessions)
        return row


@dataclasses.dataclass(frozen=True)
class FrameRecord:
    """One tick: latency, pool occupancy and load. Occupancy is `used_pages / num_pages` after the tick."""

    tick: int
    time_s: float
    latency_s: float
    occupancy: float
    used_pages: int
    num_pages: int
    running: int
    waiting: int
    served: int
    tokens: int
    dropped: int
    empty_frames: int
    parked: int
    bucket: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class SaturationFit:
    """Least-squares fit of occupancy(t) = rho0 + N r t on the early trace and its predicted saturation.

    Attributes:
        rho0: intercept: occupancy extrapolated to the start of the first fitted tick.
        slope: N r per tick (fraction of the pool per tick, all sessions together).
        sessions: N, the mean running sessions over the fitted ticks.
        rate: r per session per tick (slope / N).
        t_sat_ticks: predicted saturation, ticks after the start of the first fitted tick (inf when the slope is
            <= 0); compare with `measured_tick - first_tick`.
        t_sat_s: `t_sat_ticks * frame_budget_s` (None without a budget).
        t_sat_wall_s: the same model fitted against wall time since the first fitted tick (None if degenerate).
        fit_ticks: ticks used by the fit.
        first_tick: index of the first fitted tick.
        measured_tick: first tick with pool exhaustion (None if it never happened).
        measured_full_tick: first tick whose occupancy reached 1 (None if it never did).
        measured_s: wall time from the start of the first fitted tick to the start of `measured_tick`.
        relative_error: |predicted - measured| / measured in ticks (None without a measurement).
    """

    rho0: float
    slope: float
    sessions: float
    rate: float
    t_sat_ticks: float
    t_sat_s: float | None
    t_sat_wall_s: float | None
    fit_ticks: int
    first_tick: int
    measured_tick: int | None
    measured_full_tick: int | None
    measured_s: float | None
    relative_error: float | None

    def to_dict(self) -> dict:
        row = dataclasses.asdict(self)
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Ordinary least squares `y = a + b x` (`np.polyfit`, degree 1); returns `(a, b)`.

    Exact where the answer is: constant y fit with slope 0 exactly (a flat trace predicts no saturation, not one in
    1e17 ticks from rounding), and all-equal x, where the slope is undetermined, give (mean y, 0).
    """
    if len(xs) == 0:
        raise ValueError("linear fit of no points")
    if np.ptp(ys) == 0:
        return float(ys[0]), 0.0
    if np.ptp(xs) == 0:
        return float(np.mean(ys)), 0.0
    b, a = np.polyfit(np.asarray(xs, np.float64), np.asarray(ys, np.float64), 1)
    return float(a), float(b)


def predicted_saturation(rho0: float, slope: float) -> float:
    """t_sat = (1 - rho0) / slope (slope = N r); inf when the occupancy does not grow."""
    return (1.0 - rho0) / slope if slope > 0 else math.inf


class Telemetry:
    """Frame records, stall events and counters of one engine.

    Args:
        num_pages: pool size.
        frame_budget_s: the frame budget B (for seconds and for the latency-overrun counter).
        fit_fraction: default share of the recorded ticks the saturation fit uses (the early trace).
        fit_ticks: default number of early ticks for the fit (overrides `fit_fraction`).
    """

    def __init__(self, num_pages: int, *, frame_budget_s: float | None = None, fit_fraction: float = 0.25,
                 fit_ticks: int | None = None):
        self.num_pages, self.frame_budget_s = num_pages, frame_budget_s
        self.fit_fraction, self.fit_ticks = fit_fraction, fit_ticks
        self.records: list[FrameRecord] = []
        self.events: list[StallEvent] = []
        self.counters = {"ticks": 0, "tokens": 0, "dropped_tokens": 0, "pool_exhausted_ticks": 0,
                         "page_table_full_ticks": 0, "sessions_preempted": 0, "empty_frames": 0,
                         "parked_frames": 0, "deadline_overruns": 0}
        self._t0: float | None = None

    def now(self) -> float:
        """Seconds since the first recorded tick started (0 before any)."""
        if self._t0 is None:
            self._t0 = time.perf_counter()
        return time.perf_counter() - self._t0

    def record(self, *, start_s: float, latency_s: float, used_pages: int, running: int, waiting: int,
               served: int, tokens: int, bucket: int, dropped: dict[str, int] | None = None,
               pool_empty: bool = True, preempted: list[str] | None = None,
               empty: list[str] | None = None, parked: list[str] | None = None) -> list[StallEvent]:
        """Records one tick and returns the stall events it raised.

        Args:
            start_s: tick start, as returned by `now()` before the tick.
            latency_s: wall latency of the tick.
            used_pages: pool pages in use after the tick.
            running, waiting, served, tokens, bucket: load figures (see `TickReport`).
            dropped: tokens each session could not write this tick (sessions with none may be left out).
            pool_empty: whether the pool had no free page after the tick (tells pool exhaustion from a full
                page-table row).
            preempted: sessions preempted in this tick.
            empty: sessions whose frame asked for answer tokens and got none.
            parked: preempted sessions whose frame was not run this tick.
        """
        tick = len(self.records)
        dropped = {s: n for s, n in (dropped or {}).items() if n > 0}
        preempted, empty = list(preempted or []), list(empty or [])
        events = []
        if dropped:
            kind = "pool_exhausted" if pool_empty else "page_table_full"
            total = sum(dropped.values())
            where = "the shared KV pool has no free page" if pool_empty else "their page-table rows are full"
            events.append(StallEvent(kind, tick, start_s, tuple(sorted(dropped)), total,
                                     f"{total} tokens of {len(dropped)} sessions were not written: {where} "
                                     f"({used_pages}/{self.num_pages} pages in use)"))
            self.counters[f"{kind}_ticks"] += 1
            self.counters["dropped_tokens"] += total
        if preempted:
            events.append(StallEvent("session_preempted", tick, start_s, tuple(preempted), len(preempted),
                                     f"{len(preempted)} sessions preempted after KV exhaustion; their frames now "
                                     f"come back empty"))
            self.counters["sessions_preempted"] += len(preempted)
        if empty:
            events.append(StallEvent("empty_frames", tick, start_s, tuple(empty), len(empty),
                                     f"{len(empty)} frames asked for answer tokens and came back empty while "
                                     f"{running + waiting} sessions are open"))
            self.counters["empty_frames"] += len(empty)
        self.counters["ticks"] += 1
        self.counters["tokens"] += tokens
        self.counters["parked_frames"] += len(parked or [])
        if self.frame_budget_s is not None and latency_s > self.frame_budget_s:
            self.counters["deadline_overruns"] += 1
        self.records.append(FrameRecord(
            tick=tick, time_s=start_s, latency_s=latency_s, occupancy=used_pages / self.num_pages,
            used_pages=used_pages, num_pages=self.num_pages, running=running, waiting=waiting, served=served,
            tokens=tokens, dropped=sum(dropped.values()), empty_frames=len(empty), parked=len(parked or []),
            bucket=bucket))
        self.events.extend(events)
        return events

    # ------------------------------------------------------------------------------------------------ analysis
    def measured_saturation_tick(self) -> int | None:
        """First tick with a pool-exhaustion event (None if the pool never ran out)."""
        ticks = [e.tick for e in self.events if e.kind == "pool_exhausted"]
        return min(ticks) if ticks else None

    def saturation_fit(self, *, fit_ticks: int | None = None, fit_fraction: float | None = None,
                       skip: int = 0) -> SaturationFit | None:
        """Fits occupancy(t) = rho0 + N r t on the early trace; None with fewer than two usable ticks.

        Args:
            fit_ticks: early ticks to fit (default: the constructor's, else `fit_fraction` of the trace).
            fit_fraction: share of the recorded ticks to fit (default: the constructor's).
            skip: warm-up ticks to leave out before the window.

        Ticks at or after the measured saturation are never fitted (the model only holds before the wall). Time
        runs from the start of the first fitted tick; a tick's occupancy is sampled at its end. The pool is full at
        t_sat, so the first write to fail falls in the tick starting then: the measured saturation time is the start
        of the first tick with pool exhaustion.
        """
        recs = self.records[skip:]
        fit_ticks = fit_ticks if fit_ticks is not None else self.fit_ticks
        if fit_ticks is None:
            frac = self.fit_fraction if fit_fraction is None else fit_fraction
            fit_ticks = max(2, math.ceil(frac * len(recs)))
        measured = self.measured_saturation_tick()
        window = [r for r in recs[:fit_ticks] if (measured is None or r.tick < measured) and r.occupancy < 1.0]
        if len(window) < 2:
            return None
        first = window[0]
        # A record's occupancy is measured at the end of its tick: time tick - first + 1 (ticks), or its start
        # plus its latency (wall seconds), counted from the start of the first fitted tick.
        rho0, slope = linear_fit([r.tick - first.tick + 1 for r in window], [r.occupancy for r in window])
        t_ticks = predicted_saturation(rho0, slope)
        w0, wslope = linear_fit([r.time_s + r.latency_s - first.time_s for r in window],
                                [r.occupancy for r in window])
        t_wall = predicted_saturation(w0, wslope)
        sessions = float(np.mean([r.running for r in window]))
        full = next((r.tick for r in self.records if r.occupancy >= 1.0), None)
        measured_s = None if measured is None else self.records[measured].time_s - first.time_s
        rel = None
        if measured is not None and math.isfinite(t_ticks):
            rel = abs(t_ticks - (measured - first.tick)) / max(measured - first.tick, 1)
        return SaturationFit(
            rho0=rho0, slope=slope, sessions=sessions, rate=slope / sessions if sessions else math.nan,
            t_sat_ticks=t_ticks, t_sat_s=None if self.frame_budget_s is None else t_ticks * self.frame_budget_s,
            t_sat_wall_s=t_wall if math.isfinite(t_wall) else None, fit_ticks=len(window), first_tick=first.tick,
            measured_tick=measured, measured_full_tick=full, measured_s=measured_s, relative_error=rel)

    def rows(self) -> list[dict]:
        """Frame records as JSON-ready dicts."""
        return [r.to_dict() for r in self.records]

    def event_rows(self) -> list[dict]:
        """Stall events as JSON-ready dicts."""
        return [e.to_dict() for e in self.events]

    def summary(self) -> dict:
        """Counters, latency percentiles, peak occupancy and the saturation fit, JSON-ready."""
        lat = [r.latency_s for r in self.records]
        # Nearest-rank percentiles: the order statistic at the rounded (half to even) index q / 100 * (n - 1).
        pct = lambda q: float(np.percentile(lat, q, method="nearest")) if lat else None  # noqa: E731
        fit = self.saturation_fit()
        return {"counters": dict(self.counters), "latency_p50_s": pct(50), "latency_p95_s": pct(95),
                "latency_max_s": max(lat) if lat else None,
                "peak_occupancy": max((r.occupancy for r in self.records), default=0.0),
                "stalled": bool(self.events), "saturation": None if fit is None else fit.to_dict()}
