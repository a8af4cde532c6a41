"""OmniPick, UnitFIFO and OfficialUnitWindow: the jitted vectorised plans equal plain-Python reference planners on
random unit streams (both layouts, tiny and generous budgets, varied hyperparameters, scrambled ages, a second trim
round over a trimmed stream), and the invariants of a trim hold."""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omnijax.chunks.spans import SpanKind as K
from omnijax.retention.base import REGISTRY, get_policy
from omnijax.retention.omnipick import OmniPick
from omnijax.retention.units import OfficialUnitWindow, UnitFIFO
from tests._support import reference_unit_policies as ref
from tests._support import soak
from tests._support.unit_streams import Token, kept_orders, random_stream, to_view

B, S = 8, 256
BATCHES = 6 * soak.factor()  # per scenario: 48 streams (OMNIJAX_SOAK multiplies them)


def reference(policy, stream):
    if isinstance(policy, OmniPick):
        return ref.omnipick(stream, low=policy.low_watermark, recent_units=policy.recent_units,
                            image_sink=policy.image_sink, audio_sink=policy.audio_sink, slice_sink=policy.slice_sink,
                            video_sink=policy.video_sink, text_budget=policy.text_budget,
                            source_image_whole=policy.source_image_whole)
    if isinstance(policy, OfficialUnitWindow):
        return ref.official_unit_window(stream, low=policy.low_watermark)
    return ref.unit_fifo(stream, low=policy.low_watermark)


def scrambled(stream, rng):
    """The same tokens with ages permuted at random: units no longer contiguous in time."""
    perm = rng.permutation(len(stream))
    return [dataclasses.replace(t, order=int(perm[i])) for i, t in enumerate(stream)]


def make_stream(rng, gen):
    while True:
        stream = random_stream(rng, **gen.get("stream", {}))
        if len(stream) <= S:
            return scrambled(stream, rng) if gen.get("scramble") else stream


# (id, policy, stream options). Stream lengths run from a handful of tokens to ~250, so the small watermarks trim
# deep (whole-unit drops, the one-unit floor) and the larger ones exercise the selection alone.
SCENARIOS = [
    ("tiny-omnipick", OmniPick(20, 10, recent_units=1, image_sink=1, audio_sink=2, slice_sink=3, video_sink=1,
                               text_budget=2), {}),
    ("tiny-omnipick-minicpm", OmniPick(20, 10, recent_units=1, image_sink=2, audio_sink=3, slice_sink=1,
                                       video_sink=2, text_budget=3, source_image_whole=True),
     {"stream": {"family": "minicpm"}}),
    ("tiny-fifo", UnitFIFO(20, 10), {}),
    ("tiny-official", OfficialUnitWindow(20, 10), {}),
    ("omnipick-mid", OmniPick(120, 80, recent_units=2, image_sink=4, audio_sink=4, slice_sink=4, video_sink=4,
                              text_budget=16), {}),
    ("omnipick-single-unit", OmniPick(8, 4, recent_units=1, image_sink=1, audio_sink=1, slice_sink=1,
                                      video_sink=1, text_budget=1), {"stream": {"units": 1}}),
    ("omnipick-text-only", OmniPick(40, 25, recent_units=2, image_sink=2, audio_sink=2, slice_sink=2,
                                    video_sink=2, text_budget=7), {"stream": {"kinds": ("text", "response")}}),
    ("omnipick-image-only", OmniPick(40, 30, recent_units=1, image_sink=3, audio_sink=1, slice_sink=1,
                                     video_sink=1, text_budget=4),
     {"stream": {"family": "qwen", "kinds": ("image",)}}),
    ("omnipick-minicpm-slices", OmniPick(90, 60, recent_units=2, image_sink=1, audio_sink=2, slice_sink=2,
                                         video_sink=1, text_budget=5, source_image_whole=True),
     {"stream": {"family": "minicpm", "kinds": ("image", "av")}}),
    ("omnipick-qwen-av", OmniPick(100, 70, recent_units=1, image_sink=2, audio_sink=3, slice_sink=1, video_sink=2,
                                  text_budget=3), {"stream": {"family": "qwen", "kinds": ("av",)}}),
    ("omnipick-zero-sinks-no-system", OmniPick(30, 0, recent_units=3, image_sink=0, audio_sink=0, slice_sink=0,
                                               video_sink=0, text_budget=0), {"stream": {"system": False}}),
    ("omnipick-generous-scrambled", OmniPick(200, 150, recent_units=4, image_sink=5, audio_sink=6, slice_sink=2,
                                             video_sink=3, text_budget=40), {"scramble": True}),
    ("omnipick-tight-text-scrambled", OmniPick(300, 200, recent_units=1, image_sink=1, audio_sink=1, slice_sink=1,
                                               video_sink=1, text_budget=3), {"scramble": True}),
    ("fifo-scrambled", UnitFIFO(60, 40), {"scramble": True}),
]

_plans = {}


def jitted_plan(policy):
    if policy not in _plans:
        _plans[policy] = jax.jit(policy.plan)
    return _plans[policy]


def check_invariants(policy, streams, view, keep):
    """Invariants of a trim: keep = plan where triggered, else everything."""
    keep = np.asarray(keep)
    live = np.asarray(view.live)
    fired = np.asarray(policy.trigger(view))
    assert np.array_equal(fired, live.sum(1) > policy.high_watermark)
    keep = np.where(fired[:, None], keep, live)
    assert not np.any(keep & ~live), "kept ⊆ live"
    kept = kept_orders(view, keep)
    for stream, kept_b in zip(streams, kept):
        system = {t.order for t in stream if t.span == K.SYSTEM}
        assert system <= kept_b, "system prefix kept"
        members = [t for t in stream if t.span != K.SYSTEM]
        if not members:
            continue
        ages = {}
        for t in members:
            ages[t.unit] = min(ages.get(t.unit, t.order), t.order)
        newest_unit = max(ages, key=lambda u: (ages[u], u))
        newest = {t.order for t in members if t.unit == newest_unit}
        assert newest <= kept_b, "newest unit whole"
        kept_units = {t.unit for t in members if t.order in kept_b}
        if len(kept_b) > policy.low_watermark and len(stream) > policy.high_watermark:
            assert kept_units == {newest_unit}, "above the low watermark only with the newest unit alone"
            assert kept_b == system | newest
        if len(kept_b) > policy.high_watermark:
            assert len(system | newest) > policy.low_watermark, "retained <= high after trimming"


@pytest.mark.parametrize("name, policy, gen", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_plan_matches_reference(name, policy, gen):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    plan = jitted_plan(policy)
    compared = 0
    for _ in range(BATCHES):
        streams = [make_stream(rng, gen) for _ in range(B)]
        view = to_view(streams, rng, capacity=S)
        keep = plan(view)
        assert keep.shape == (B, S) and keep.dtype == jnp.bool_
        got = kept_orders(view, keep)
        assert not np.any(np.asarray(keep) & ~np.asarray(view.live)), "plan ⊆ live"
        for stream, kept_b in zip(streams, got):
            assert kept_b == reference(policy, stream), (name, stream)
            compared += 1
        check_invariants(policy, streams, view, keep)
        # Second round over the trimmed streams (orders now gappy, offsets as left by the first round).
        again = [[t for t in stream if t.order in kept_b] for stream, kept_b in zip(streams, got)]
        view2 = to_view(again, rng, capacity=S)
        got2 = kept_orders(view2, plan(view2))
        for stream, kept_b in zip(again, got2):
            assert kept_b == reference(policy, stream), (name, stream)
        check_invariants(policy, again, view2, plan(view2))
    assert compared == BATCHES * B


def test_reference_coverage():
    """The scenarios compare >= 500 first-round streams and do trim (drop whole units, hit the one-unit floor)."""
    assert len(SCENARIOS) * BATCHES * B >= 500
    rng = np.random.default_rng(0)
    drops = floors = 0
    for _, policy, gen in SCENARIOS:
        for _ in range(20):
            stream = make_stream(rng, gen)
            kept = reference(policy, stream)
            units = {t.unit for t in stream if t.span != K.SYSTEM}
            kept_units = {t.unit for t in stream if t.span != K.SYSTEM and t.order in kept}
            drops += len(kept_units) < len(units)
            floors += len(units) > 1 and len(kept_units) == 1
    assert drops > 50 and floors > 10


def test_handmade_omnipick():
    """A hand-checked plan: two older units, one recent unit, MiniCPM source image kept whole."""
    toks, order = [], 0

    def add(unit, spans):
        nonlocal order
        prev, k = None, 0
        for s in spans:
            k = k + 1 if s == prev else 0
            prev = s
            toks.append(Token(order=order, unit=unit, span=int(s), offset=k, score=0.0))
            order += 1

    add(0, [K.SYSTEM] * 2)                                                      # orders 0-1
    add(1, [K.BOUNDARY] + [K.IMAGE] * 3 + [K.SLICE] * 3 + [K.TEXT] * 2 + [K.BOUNDARY])  # 2-11
    add(2, [K.BOUNDARY] + [K.AUDIO] * 4 + [K.RESPONSE] * 2 + [K.BOUNDARY])      # 12-19
    add(3, [K.BOUNDARY] + [K.AUDIO] * 3 + [K.BOUNDARY])                         # 20-24
    policy = OmniPick(200, 100, recent_units=1, image_sink=1, audio_sink=2, slice_sink=1, video_sink=1,
                      text_budget=3, source_image_whole=True)
    expect = {0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 12, 13, 14, 17, 19, 20, 21, 22, 23, 24}
    assert ref.omnipick(toks, low=100, recent_units=1, image_sink=1, audio_sink=2, slice_sink=1, video_sink=1,
                        text_budget=3, source_image_whole=True) == expect
    view = to_view([toks], np.random.default_rng(1), capacity=64)
    assert kept_orders(view, policy.plan(view))[0] == expect
    # 20 selected: a low watermark of 12 drops unit 1 (8 kept) and stops at 2 + 5 + 5 = 12; 11 drops unit 2 too.
    tight = dataclasses.replace(policy, low_watermark=12)
    assert kept_orders(view, tight.plan(view))[0] == {0, 1, 12, 13, 14, 17, 19, 20, 21, 22, 23, 24}
    tighter = dataclasses.replace(policy, low_watermark=11)
    assert kept_orders(view, tighter.plan(view))[0] == {0, 1, 20, 21, 22, 23, 24}
    assert kept_orders(view, UnitFIFO(20, 15).plan(view))[0] == {0, 1} | set(range(12, 25))


def test_registry_and_flags():
    assert REGISTRY["omnipick"] is OmniPick
    assert REGISTRY["unit_fifo"] is UnitFIFO
    assert REGISTRY["official_unit_window"] is OfficialUnitWindow
    assert OmniPick.reindex and UnitFIFO.reindex and OfficialUnitWindow.reindex
    assert get_policy("official_unit_window") == OfficialUnitWindow(8000, 6000)
    assert (UnitFIFO().high_watermark, UnitFIFO().low_watermark) == (2500, 1800)
    p = get_policy("omnipick")
    assert (p.high_watermark, p.low_watermark, p.recent_units, p.text_budget) == (2500, 1800, 2, 256)
    assert hash(p) == hash(OmniPick())


@pytest.mark.parametrize("cls, kwargs", [
    (OmniPick, {"low_watermark": 3000}), (OmniPick, {"high_watermark": 0, "low_watermark": 0}),
    (OmniPick, {"low_watermark": -1}), (OmniPick, {"recent_units": 0}), (OmniPick, {"image_sink": -1}),
    (OmniPick, {"text_budget": -2}), (OmniPick, {"audio_sink": 1.5}), (OmniPick, {"source_image_whole": 1}),
    (OmniPick, {"video_sink": True}), (UnitFIFO, {"low_watermark": 2600}), (UnitFIFO, {"high_watermark": 2.5}),
    (OfficialUnitWindow, {"high_watermark": 5000}),
])
def test_validation(cls, kwargs):
    with pytest.raises(ValueError):
        cls(**kwargs)
