"""A talker's KV bounded by a retention policy, shared by both speaking families (Qwen3-Omni's MoE talker,
Qwen2.5-Omni's Qwen2 talker).

A talker decodes one codec token per 80 ms (Qwen3-Omni) or 20 ms (Qwen2.5-Omni) of speech and, unbounded, its cache
holds its prompt plus every token: a long spoken answer grows it without end. A `SinkWindow(sink, window)` (the
thinker's policy, positions not re-indexed) keeps the prompt's first `sink` cells and the newest `window`: the cache
is built for that budget (`bounded_capacity`) and trimmed after the prefill and after every step, so a step at
sequence index `i` attends to cells `[0, sink) ∪ [i - window, i]` (every cell while `i <= sink + window`). The
prefill itself reads its whole prompt, as the unbounded talker does. What users set is `talker_policy(window,
sink)`: `SpeakOptions(talker_window=...)`, `omnijax chat --speak --talker-window`, `omnijax serve
--talker-window`.
"""

from __future__ import annotations

from typing import Any

from omnijax.retention.baselines import SinkWindow

__all__ = ["DEFAULT_TALKER_SINK", "MIN_TALKER_WINDOW", "bounded_capacity", "talker_policy"]

MIN_TALKER_WINDOW = 2  # the newest cells a bounded talker keeps at least: its last step's row and the one before
DEFAULT_TALKER_SINK = 4  # the oldest talker cells pinned (the prompt's opening: its system / speaker rows)


def talker_policy(window: int | None, sink: int = DEFAULT_TALKER_SINK, *, what: str = "talker_window"
                  ) -> SinkWindow | None:
    """The talker's KV policy for `window` newest cells beside `sink` pinned ones (None: unbounded).

    Raises:
        ValueError: naming `what`: a window that is not an int, or below `MIN_TALKER_WINDOW`; a negative sink.
    """
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int):
        raise ValueError(f"{what} must be an int (talker KV cells kept) or None (unbounded), got {window!r}")
    if window < MIN_TALKER_WINDOW:
        raise ValueError(f"{what} {window}: the talker keeps at least {MIN_TALKER_WINDOW} newest cells "
                         "(MIN_TALKER_WINDOW: its last step's row and the one before); give a larger window or "
                         "None (unbounded)")
    if isinstance(sink, bool) or not isinstance(sink, int) or sink < 0:
        raise ValueError(f"the talker's sink cells must be an int >= 0, got {sink!r}")
    return SinkWindow(sink=sink, window=window)


def bounded_capacity(policy: Any, prefill_rows: int, page_size: int) -> int:
    """Cells a bounded talker cache is built with: the prefill's rows or the budget plus one step's row, whichever
    is more, rounded up to whole pages (holes the policy leaves are refilled, so it never needs more).

    Raises:
        ValueError: a policy without a cell budget, or keeping fewer than `MIN_TALKER_WINDOW` newest cells.
    """
    budget = getattr(policy, "budget", None)
    if isinstance(budget, bool) or not isinstance(budget, int) or getattr(policy, "reindex", None) is None:
        raise ValueError(f"the talker's KV policy must be a retention policy with a cell budget (e.g. SinkWindow), "
                         f"got {policy!r}")
    window = getattr(policy, "window", budget)
    if window < MIN_TALKER_WINDOW:
        raise ValueError(f"the talker's KV policy keeps {window} newest cells; the talker needs at least "
                         f"{MIN_TALKER_WINDOW} (MIN_TALKER_WINDOW: its last step's row and the one before)")
    return -(-max(prefill_rows, budget + 1) // page_size) * page_size
