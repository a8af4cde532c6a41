"""Deadline-aware admission (Metronome §4.2): an AIMD loop on the measured per-frame latency.

Every tick the server reports the frame latency it measured (`AIMD.observe`). Every `window` observations the
controller takes one control step on a statistic of those samples (p95 by default):

    latency >= target (= target_fraction * frame_budget_s):   cap = max(min_cap, floor(cap * beta))   (decrease)
    otherwise, when the cap binds (current >= cap):           cap = min(max_cap, cap + alpha)          (probe)

and starts a fresh window, so one slow frame causes one decrease, not one per tick it stays in a sliding window.
An idle server measures nothing, so without more a cap cut by a burst would stay cut for good: `recover` (which the
worker calls once per idle interval, when no tick ran) steps a cap below `initial_cap` back up by `alpha`, so an
idle server returns to its starting cap in (initial_cap - cap) / alpha intervals.
The additive probe only happens while the cap is what limits admission (as TCP grows its window only when it is
window-limited); otherwise an idle stretch would let the cap drift far above anything measured and a burst of
arrivals would be over-admitted. Arrivals are admitted while `current < cap`; `check` raises `Overloaded`, a clean
rejection, for the surplus. Deterministic: the same observations give the same caps.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

STATISTICS = ("p95", "max", "mean")


class Overloaded(RuntimeError):
    """An arrival beyond the admission cap (or beyond the engine's largest batch bucket).

    Attributes:
        cap: the cap in force.
        current: sessions open when the arrival was refused.
        latency_s: the latency statistic behind the cap (None when not latency-driven).
        target_s: the latency target (None when not latency-driven).
    """

    def __init__(self, message: str, *, cap: int, current: int, latency_s: float | None = None,
                 target_s: float | None = None):
        super().__init__(message)
        self.cap, self.current, self.latency_s, self.target_s = cap, current, latency_s, target_s


@dataclasses.dataclass
class AIMD:
    """Additive-increase / multiplicative-decrease admission cap driven by per-frame latency.

    Args:
        target_fraction: latency target as a fraction of the frame budget B. Default 0.3: Metronome's admission
            run (its Fig. 7) targets 600 ms of per-frame latency on a 2 s budget.
        frame_budget_s: the frame budget B in seconds.
        alpha: additive increase per control step with headroom (sessions).
        beta: multiplicative decrease factor, in (0, 1).
        min_cap: the cap never drops below this (>= 1 keeps the service probing).
        max_cap: optional ceiling (e.g. the engine's largest batch bucket).
        initial_cap: the cap before any measurement.
        window: latency samples per control step.
        statistic: "p95" (numpy's default linear percentile), "max" or "mean" of the window's samples.
        probe_only_when_limited: increase only while `current >= cap` (see the module docstring).
    """

    target_fraction: float = 0.3
    frame_budget_s: float = 1.0
    alpha: int = 1
    beta: float = 0.7
    min_cap: int = 1
    max_cap: int | None = None
    initial_cap: int = 4
    window: int = 4
    statistic: str = "p95"
    probe_only_when_limited: bool = True
    cap: int = dataclasses.field(init=False)
    steps: int = dataclasses.field(init=False, default=0)
    last_latency_s: float | None = dataclasses.field(init=False, default=None)
    history: list[dict] = dataclasses.field(init=False, default_factory=list)
    _samples: list[float] = dataclasses.field(init=False, default_factory=list, repr=False)

    def __post_init__(self):
        if not 0 < self.target_fraction:
            raise ValueError(f"target_fraction must be positive, got {self.target_fraction}")
        if not self.frame_budget_s > 0:
            raise ValueError(f"frame_budget_s must be positive, got {self.frame_budget_s}")
        if not 0 < self.beta < 1:
            raise ValueError(f"beta must lie in (0, 1), got {self.beta}")
        if self.alpha < 1 or self.min_cap < 1 or self.window < 1:
            raise ValueError(f"alpha, min_cap and window must be >= 1, got {self.alpha}, {self.min_cap}, "
                             f"{self.window}")
        if self.max_cap is not None and self.max_cap < self.min_cap:
            raise ValueError(f"max_cap ({self.max_cap}) must be >= min_cap ({self.min_cap})")
        if self.statistic not in STATISTICS:
            raise ValueError(f"statistic must be one of {STATISTICS}, got {self.statistic!r}")
        self.cap = self._clamp(self.initial_cap)

    @property
    def target_s(self) -> float:
        """The latency target in seconds."""
        return self.target_fraction * self.frame_budget_s

    def _clamp(self, cap: int) -> int:
        cap = max(self.min_cap, int(cap))
        return cap if self.max_cap is None else min(self.max_cap, cap)

    def _stat(self, samples: list[float]) -> float:
        """The window's statistic; "p95" is `np.percentile(samples, 95)`, linear between order statistics."""
        if self.statistic == "max":
            return max(samples)
        if self.statistic == "mean":
            return float(np.mean(samples))
        return float(np.percentile(samples, 95.0))

    def observe(self, latency_s: float, current: int | None = None) -> int:
        """Records one frame's latency; runs a control step once `window` samples are in. Returns the cap."""
        if not math.isfinite(latency_s) or latency_s < 0:
            raise ValueError(f"latency must be a finite non-negative number of seconds, got {latency_s}")
        self._samples.append(float(latency_s))
        if len(self._samples) >= self.window:
            self.step(current=current)
        return self.cap

    def step(self, latency_s: float | None = None, current: int | None = None) -> int:
        """One control step on `latency_s` (default: the statistic of the pending samples). Returns the cap.

        Args:
            latency_s: the latency signal for this step; None uses (and clears) the pending samples.
            current: sessions open now; with `probe_only_when_limited`, the cap grows only if `current >= cap`
                (None: always allowed to grow).
        """
        if latency_s is None:
            if not self._samples:
                return self.cap
            latency_s = self._stat(self._samples)
        self._samples = []
        before = self.cap
        if latency_s >= self.target_s:
            self.cap = self._clamp(math.floor(self.cap * self.beta))
            action = "decrease"
        elif not self.probe_only_when_limited or current is None or current >= self.cap:
            self.cap = self._clamp(self.cap + self.alpha)
            action = "increase"
        else:
            action = "hold"
        self.steps += 1
        self.last_latency_s = float(latency_s)
        self.history.append({"step": self.steps, "latency_s": float(latency_s), "target_s": self.target_s,
                             "current": current, "cap_before": before, "cap": self.cap, "action": action})
        return self.cap

    def recover(self) -> int:
        """One idle interval without ticks: a cap below `initial_cap` grows by `alpha` (never past `initial_cap`),
        pending samples are dropped (they describe load that has gone). Returns the cap."""
        self._samples = []
        start = self._clamp(self.initial_cap)
        if self.cap >= start:
            return self.cap
        before = self.cap
        self.cap = min(start, self.cap + self.alpha)
        self.steps += 1
        self.history.append({"step": self.steps, "latency_s": None, "target_s": self.target_s, "current": 0,
                             "cap_before": before, "cap": self.cap, "action": "recover"})
        return self.cap

    def admit(self, current_sessions: int) -> bool:
        """Whether one more session may join `current_sessions` open ones."""
        return current_sessions < self.cap

    def check(self, current_sessions: int) -> None:
        """Raises `Overloaded` when one more session would exceed the cap."""
        if self.admit(current_sessions):
            return
        lat = "no latency measured yet" if self.last_latency_s is None else (
            f"{self.statistic} frame latency {1e3 * self.last_latency_s:.1f} ms vs target "
            f"{1e3 * self.target_s:.1f} ms ({self.target_fraction:g} x B={1e3 * self.frame_budget_s:g} ms)")
        raise Overloaded(f"overloaded: {current_sessions} sessions open, AIMD admission cap {self.cap} ({lat}); "
                         f"retry later", cap=self.cap, current=current_sessions, latency_s=self.last_latency_s,
                         target_s=self.target_s)
