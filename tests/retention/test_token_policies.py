"""Unit-blind baselines (TokenSliding, StreamingLLM, H2O, SinkWindow): jitted vectorised plans against the plain-Python
reference planners on random unit streams, plus invariants, tie-breaking, validation and registry checks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omnijax.chunks.spans import SpanKind as K
from omnijax.retention import base
from omnijax.retention.baselines import H2O, SinkWindow, StreamingLLM, TokenSliding, age_ranks
from tests._support import reference_token_policies as ref
from tests._support import soak
from tests._support.unit_streams import Token, kept_orders, random_stream, to_view

B, S = 8, 256
BATCHES = 80 * soak.factor()  # 640 streams, every setting below runs over all of them

SCENARIOS = ("mixed", "qwen", "minicpm", "single_unit", "text_only", "image_only", "holes", "tied_scores",
             "zero_scores", "tiny")


def _stream(rng: np.random.Generator, scenario: str) -> list[Token]:
    """One stream of at most S tokens for a scenario."""
    while True:
        kw = {"units": int(rng.integers(1, 9))}
        if scenario in ("qwen", "minicpm"):
            kw["family"] = scenario
        elif scenario == "single_unit":
            kw["units"] = 1
        elif scenario == "text_only":
            kw["kinds"] = ("text", "response")
        elif scenario == "image_only":
            kw["kinds"] = ("image",)
        elif scenario == "tiny":
            kw["units"] = 1
            kw["kinds"] = ("text",)
        stream = random_stream(rng, **kw)
        if len(stream) <= S:
            break
    if scenario == "holes":  # a stream after earlier evictions: orders with gaps
        stream = [t for t in stream if rng.random() < 0.6] or stream[-1:]
    elif scenario == "tied_scores":
        stream = [dataclasses.replace(t, score=float(rng.integers(0, 3)) / 2) for t in stream]
    elif scenario == "zero_scores":
        stream = [dataclasses.replace(t, score=0.0) for t in stream]
    if rng.random() < 0.5:  # shuffle the list: the planners must not rely on list order
        stream = [stream[i] for i in rng.permutation(len(stream))]
    return stream


@pytest.fixture(scope="module")
def pool():
    """`BATCHES` batches of (streams, view); a few empty sequences mixed in."""
    rng = np.random.default_rng(20240611)
    batches = []
    for _ in range(BATCHES):
        streams = []
        for _ in range(B):
            if rng.random() < 0.02:
                streams.append([])
            else:
                streams.append(_stream(rng, SCENARIOS[int(rng.integers(len(SCENARIOS)))]))
        batches.append((streams, to_view(streams, rng, capacity=S)))
    return batches


SETTINGS = [
    TokenSliding(window=1, high_watermark=1),
    TokenSliding(window=5, high_watermark=5),
    TokenSliding(window=5, high_watermark=8),
    TokenSliding(window=17, high_watermark=40),
    TokenSliding(window=60, high_watermark=100),
    TokenSliding(),  # the seed's 2500/1800: never triggers at S=256
    StreamingLLM(sink_tokens=0, window=5, high_watermark=5),
    StreamingLLM(sink_tokens=1, window=5, high_watermark=10),
    StreamingLLM(sink_tokens=2, window=5, high_watermark=7),
    StreamingLLM(sink_tokens=3, window=5, high_watermark=12),
    StreamingLLM(sink_tokens=3, window=1, high_watermark=4),
    StreamingLLM(sink_tokens=2, window=40, high_watermark=60),
    StreamingLLM(),
    H2O(heavy=0, recent=5, high_watermark=5),
    H2O(heavy=1, recent=5, high_watermark=9),
    H2O(heavy=2, recent=5, high_watermark=7),
    H2O(heavy=4, recent=5, high_watermark=12),
    H2O(heavy=4, recent=1, high_watermark=5),
    H2O(heavy=30, recent=20, high_watermark=70),
    H2O(),
    SinkWindow(sink=0, window=5),
    SinkWindow(sink=1, window=5),
    SinkWindow(sink=3, window=5),
    SinkWindow(sink=2, window=1),
    SinkWindow(sink=16, window=64),
    SinkWindow(),  # Metronome's 16 + 1024
]


@pytest.mark.parametrize("policy", SETTINGS, ids=repr)
def test_plan_and_trigger_match_reference(policy, pool):
    plan, trigger = jax.jit(policy.plan), jax.jit(policy.trigger)  # one compile per instance and shape
    budget = ref.reference_budget(policy)
    assert policy.budget == budget
    trims = 0
    for streams, view in pool:
        keep = np.asarray(plan(view))
        fire = np.asarray(trigger(view))
        live = np.asarray(view.live)
        assert keep.shape == (B, S) and keep.dtype == bool and fire.shape == (B,)
        assert not np.any(keep & ~live), "keep must be a subset of live"
        got = kept_orders(view, keep)
        for b, stream in enumerate(streams):
            want = ref.reference_plan(policy, stream)
            assert got[b] == want, (policy, b, sorted(t.order for t in stream))
            assert bool(fire[b]) == ref.reference_trigger(policy, stream)
            assert len(want) == min(len(stream), budget)
            if stream:
                assert max(t.order for t in stream) in got[b], "the newest token is always kept"
            if fire[b]:
                trims += 1
                assert keep[b].sum() <= budget
    threshold = ref.reference_threshold(policy)
    if threshold < 100:
        assert trims > 0, "the setting must exercise real trims"


@pytest.mark.parametrize("policy", [TokenSliding(5, 8), StreamingLLM(2, 5, 9), H2O(3, 4, 9), SinkWindow(2, 5)],
                         ids=repr)
def test_trim_style_select(policy, pool):
    """`where(trigger, plan, live)` as `base.trim` composes them: untouched below the threshold, exact above."""

    @jax.jit
    def select(view):
        return jnp.where(policy.trigger(view)[:, None], policy.plan(view), view.live)

    for streams, view in pool[:10]:
        got = kept_orders(view, select(view))
        for b, stream in enumerate(streams):
            want = ref.reference_plan(policy, stream) if ref.reference_trigger(policy, stream) else {
                t.order for t in stream}
            assert got[b] == want


def test_h2o_without_scores_is_token_sliding(pool):
    """All scores zero: ties everywhere, broken toward newer, so H2O keeps the newest heavy + recent tokens."""
    h2o, sliding = jax.jit(H2O(3, 4, 9).plan), jax.jit(TokenSliding(7, 9).plan)
    for _, view in pool[:10]:
        view = dataclasses.replace(view, score=jnp.zeros_like(view.score))
        np.testing.assert_array_equal(np.asarray(h2o(view)), np.asarray(sliding(view)))


def _view(stream: list[Token], seed: int = 0):
    return to_view([stream], np.random.default_rng(seed), capacity=32)


def test_h2o_ties_prefer_newer():
    # Orders 0..9; recent=2 keeps 8, 9. Among 0..7, scores tie at 0.5 for 1, 3, 6; the top-1 score 0.9 is order 2.
    scores = [0.1, 0.5, 0.9, 0.5, 0.2, 0.0, 0.5, 0.3, 0.0, 0.0]
    stream = [Token(order=i, unit=1, span=int(K.TEXT), offset=i, score=s) for i, s in enumerate(scores)]
    for heavy, want in [(0, {8, 9}), (1, {2, 8, 9}), (2, {2, 6, 8, 9}), (3, {2, 3, 6, 8, 9}),
                        (4, {1, 2, 3, 6, 8, 9}), (8, set(range(10)))]:
        policy = H2O(heavy=heavy, recent=2, high_watermark=10)
        view = _view(stream, seed=heavy)
        assert kept_orders(view, policy.plan(view))[0] == want == ref.h2o(stream, heavy, 2)


def test_h2o_negative_zero_ties_with_zero():
    stream = [Token(order=i, unit=1, span=int(K.TEXT), offset=i, score=0.0) for i in range(6)]
    view = _view(stream)
    live = np.asarray(view.live)
    score = np.where(live, 0.0, np.asarray(view.score)).astype(np.float32)
    order = np.asarray(view.order)
    score[live & (order % 2 == 0)] = -0.0
    view = dataclasses.replace(view, score=jnp.asarray(score))
    # recent=1 keeps 5; with every score equal the two newest of the rest (4, 3) are the heavy hitters.
    assert kept_orders(view, H2O(heavy=2, recent=1, high_watermark=3).plan(view))[0] == {3, 4, 5}


def test_unit_blind_system_prefix_not_pinned():
    """A SYSTEM prefix is just the oldest tokens: sliding drops it, sink policies keep only its first tokens."""
    spans = [K.SYSTEM] * 4 + [K.BOUNDARY] + [K.IMAGE] * 6 + [K.BOUNDARY]
    stream = [Token(order=i, unit=0 if s == K.SYSTEM else 1, span=int(s), offset=i, score=0.0)
              for i, s in enumerate(spans)]
    view = _view(stream)
    assert kept_orders(view, TokenSliding(5, 5).plan(view))[0] == {7, 8, 9, 10, 11}  # cuts through the image
    assert kept_orders(view, StreamingLLM(2, 3, 5).plan(view))[0] == {0, 1, 9, 10, 11}
    assert kept_orders(view, SinkWindow(1, 3).plan(view))[0] == {0, 9, 10, 11}


def test_age_ranks_use_order_not_slots(pool):
    for streams, view in pool[:5]:
        from_oldest, from_newest = (np.asarray(r) for r in jax.jit(age_ranks)(view))
        live, order = np.asarray(view.live), np.asarray(view.order)
        for b, stream in enumerate(streams):
            ages = sorted(t.order for t in stream)
            for slot in np.flatnonzero(live[b]):
                assert from_oldest[b, slot] == ages.index(order[b, slot])
                assert from_newest[b, slot] == len(ages) - 1 - ages.index(order[b, slot])


def test_registry_and_static_hyperparameters():
    assert base.get_policy("token_sliding") == TokenSliding(window=1800, high_watermark=2500)
    assert base.get_policy("streaming_llm") == StreamingLLM(sink_tokens=2, window=1800, high_watermark=2500)
    assert base.get_policy("h2o") == H2O(heavy=900, recent=900, high_watermark=2500)
    assert base.get_policy("sink_window") == SinkWindow(sink=16, window=1024)
    assert base.get_policy("sink_window", window=8).window == 8
    assert (TokenSliding.reindex, StreamingLLM.reindex, H2O.reindex, SinkWindow.reindex) == (True, True, True, False)
    for policy in (TokenSliding(), StreamingLLM(), H2O(), SinkWindow()):
        hash(policy)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(policy, dataclasses.fields(policy)[0].name, 1)


@pytest.mark.parametrize("make, match", [
    (lambda: TokenSliding(window=0, high_watermark=5), "window must be >= 1"),
    (lambda: TokenSliding(window=6, high_watermark=5), "must not exceed high_watermark"),
    (lambda: TokenSliding(window=2.5, high_watermark=5), "window must be an int"),
    (lambda: StreamingLLM(sink_tokens=-1, window=5, high_watermark=9), "sink_tokens must be >= 0"),
    (lambda: StreamingLLM(sink_tokens=2, window=0, high_watermark=9), "window must be >= 1"),
    (lambda: StreamingLLM(sink_tokens=5, window=5, high_watermark=9), "must not exceed high_watermark"),
    (lambda: StreamingLLM(sink_tokens=True, window=5, high_watermark=9), "sink_tokens must be an int"),
    (lambda: H2O(heavy=-1, recent=5, high_watermark=9), "heavy must be >= 0"),
    (lambda: H2O(heavy=1, recent=0, high_watermark=9), "recent must be >= 1"),
    (lambda: H2O(heavy=5, recent=5, high_watermark=9), "must not exceed high_watermark"),
    (lambda: SinkWindow(sink=-1, window=5), "sink must be >= 0"),
    (lambda: SinkWindow(sink=2, window=0), "window must be >= 1"),
    (lambda: SinkWindow(sink="2", window=4), "sink must be an int"),
])
def test_invalid_hyperparameters(make, match):
    with pytest.raises(ValueError, match=match):
        make()
