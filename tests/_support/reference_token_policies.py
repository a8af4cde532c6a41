"""Plain-Python reference planners for the unit-blind baselines (`omnijax.retention.baselines`).

Each takes one stream (a list of `Token`, any order, orders unique) and returns the set of kept `order`s. They sort
lists and loop; nothing here shares code with the vectorised plans. Plans are unconditional (what a trim would keep);
`reference_trigger` says whether the policy trims that stream at all.
"""

from __future__ import annotations

import numpy as np

from tests._support.unit_streams import Token


def _by_age(stream: list[Token]) -> list[int]:
    """Orders, oldest first."""
    return sorted(t.order for t in stream)


def newest(stream: list[Token], window: int) -> set[int]:
    ages = _by_age(stream)
    kept = set()
    for order in reversed(ages):
        if len(kept) == window:
            break
        kept.add(order)
    return kept


def oldest(stream: list[Token], sink: int) -> set[int]:
    kept = set()
    for order in _by_age(stream):
        if len(kept) == sink:
            break
        kept.add(order)
    return kept


def token_sliding(stream: list[Token], window: int) -> set[int]:
    return newest(stream, window)


def streaming_llm(stream: list[Token], sink_tokens: int, window: int) -> set[int]:
    return oldest(stream, sink_tokens) | newest(stream, window)


def sink_window(stream: list[Token], sink: int, window: int) -> set[int]:
    return oldest(stream, sink) | newest(stream, window)


def h2o(stream: list[Token], heavy: int, recent: int) -> set[int]:
    """Newest `recent`, then the `heavy` best of the rest by (score, order) descending: newer wins a tie.

    Scores compare as float32 (the cache's dtype), so values equal in float32 tie here too.
    """
    kept = newest(stream, recent)
    rest = [t for t in stream if t.order not in kept]
    rest.sort(key=lambda t: (float(np.float32(t.score)), t.order), reverse=True)
    for t in rest[:heavy]:
        kept.add(t.order)
    return kept


def reference_plan(policy, stream: list[Token]) -> set[int]:
    """Dispatches on the policy's registry name, reading its hyperparameters."""
    if policy.name == "token_sliding":
        return token_sliding(stream, policy.window)
    if policy.name == "streaming_llm":
        return streaming_llm(stream, policy.sink_tokens, policy.window)
    if policy.name == "h2o":
        return h2o(stream, policy.heavy, policy.recent)
    if policy.name == "sink_window":
        return sink_window(stream, policy.sink, policy.window)
    raise KeyError(policy.name)


def reference_threshold(policy) -> int:
    """Retained cells above which the policy trims."""
    if policy.name == "sink_window":
        return policy.sink + policy.window
    return policy.high_watermark


def reference_budget(policy) -> int:
    """Most retained cells after a trim."""
    return {"token_sliding": lambda p: p.window,
            "streaming_llm": lambda p: p.sink_tokens + p.window,
            "h2o": lambda p: p.heavy + p.recent,
            "sink_window": lambda p: p.sink + p.window}[policy.name](policy)


def reference_trigger(policy, stream: list[Token]) -> bool:
    return len(stream) > reference_threshold(policy)
