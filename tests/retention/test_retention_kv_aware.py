"""Query-agnostic KV compression baselines that rank by cached keys and values (`InfiniPotV`, `StreamMem`): each plan
equals a plain-Python reading on 500+ random slot sets, and inside `omnijax.stream` they bound the cache, their plans
on the real cache's features equal the plain reading, and they are registered by name."""

import dataclasses
import math
import random

import jax
import numpy as np
import pytest

import omnijax
from omnijax.chunks.chunk import stack_chunks, text_chunk
from omnijax.chunks.spans import SpanKind as K
from omnijax.models.config import TINY_OMNI
from omnijax.retention import InfiniPotV, SequenceView, SlotFeatures, StreamMem, get_policy, sequence_view
from omnijax.retention.base import slot_features
from tests._support.traced_policy import plan_traced

KINDS = [K.SYSTEM, K.BOUNDARY, K.IMAGE, K.VIDEO, K.AUDIO, K.TEXT]
# The settings each policy's plan only computes with: traced, so the 500 random settings share one compiled plan per
# slot shape (StreamMem's num_proxies sizes a top-k: static).
TRACED = {"infinipot_v": ("budget", "recent_units", "tar_fraction"), "streammem": ("budget",)}


def _infinipot_plain(p, live, unit, span, offset, key, vnorm):
    S = len(live)
    visual = [live[i] and span[i] in p.visual_kinds for i in range(S)]
    units = sorted({unit[i] for i in range(S) if visual[i]}, reverse=True)
    recent, newest = set(units[:p.recent_units]), set(units[:1])
    protected = [live[i] and (not visual[i] or unit[i] in recent) for i in range(S)]
    candidates = [visual[i] and unit[i] not in recent for i in range(S)]
    quota = max(p.budget - sum(protected), 0)
    ref = {}
    for i in range(S):
        if visual[i] and unit[i] in newest:
            slot = min(max(offset[i], 0), S - 1)
            ref[slot] = ref.get(slot, 0) + key[i]
    redundancy = []
    for i in range(S):
        r = ref.get(min(max(offset[i], 0), S - 1))
        redundancy.append(-1.0 if r is None else
                          float(key[i] @ r / max(np.linalg.norm(key[i]) * np.linalg.norm(r), 1e-12)))
    by_tar = math.floor(quota * p.tar_fraction)
    ranked = sorted((i for i in range(S) if candidates[i]), key=lambda i: (redundancy[i], i))
    tar = set(ranked[:by_tar])
    rest = sorted((i for i in range(S) if candidates[i] and i not in tar), key=lambda i: (-vnorm[i], i))
    van = set(rest[:quota - len(tar)])
    return [protected[i] or i in tar or i in van for i in range(S)]


def _streammem_plain(p, live, span, order, key):
    S, d = key.shape
    proxy = [live[i] and span[i] in p.proxy_kinds for i in range(S)]
    protected = [live[i] and (span[i] == K.SYSTEM or proxy[i]) for i in range(S)]
    proxies = sorted((i for i in range(S) if proxy[i]), key=lambda i: -order[i])[:p.num_proxies]
    score = np.zeros(S)
    for q in proxies:
        logits = np.array([key[q] @ key[j] / math.sqrt(d) if live[j] else -np.inf for j in range(S)])
        weights = np.exp(logits - logits.max())
        score += weights / weights.sum()
    score /= max(len(proxies), 1)
    quota = max(p.budget - sum(protected), 0)
    rest = sorted((j for j in range(S) if live[j] and not protected[j]), key=lambda j: (-score[j], -order[j]))
    keep = set(rest[:quota])
    return [protected[j] or j in keep for j in range(S)]


def _view(live, unit, span, offset, order):
    B = 1
    as_row = lambda x, dtype: np.asarray([x], dtype)  # noqa: E731
    live_a = as_row(live, bool)
    return SequenceView(live=live_a, pos=np.zeros((1, B, len(live)), np.int32), unit=as_row(unit, np.int32),
                        span=as_row(span, np.int32), offset=as_row(offset, np.int32), order=as_row(order, np.int32),
                        score=np.zeros((B, len(live)), np.float32), retained=live_a.sum(axis=1).astype(np.int32))


@pytest.mark.parametrize("kind", ["infinipot_v", "streammem"])
def test_plans_equal_their_plain_reading(kind):
    rng = random.Random(1 if kind == "infinipot_v" else 2)
    nrng = np.random.default_rng(3)
    for case in range(500):
        S, d = rng.choice([16, 24, 40]), rng.choice([4, 8])
        live = [rng.random() < 0.8 for _ in range(S)]
        unit = [rng.randint(0, 5) for _ in range(S)]
        span = [int(rng.choice(KINDS)) for _ in range(S)]
        offset = [rng.randint(0, 6) for _ in range(S)]
        order = rng.sample(range(S * 2), S)
        key = nrng.normal(size=(S, d)).astype(np.float32)
        vnorm = nrng.random(S).astype(np.float32)
        view = _view(live, unit, span, offset, order)
        features = SlotFeatures(key=key[None], value_norm=vnorm[None])
        if kind == "infinipot_v":
            policy = InfiniPotV(budget=rng.randint(1, S), recent_units=rng.randint(1, 3),
                                tar_fraction=rng.choice([0.0, 0.25, 0.5, 1.0]))
            want = _infinipot_plain(policy, live, unit, span, offset, key, vnorm)
        else:
            policy = StreamMem(budget=rng.randint(1, S), num_proxies=rng.randint(1, 6))
            want = _streammem_plain(policy, live, span, order, key)
        got = np.asarray(plan_traced(policy, view, features, TRACED[kind]))[0].tolist()
        assert got == want, (case, policy)
        assert bool(np.asarray(policy.trigger(view))[0]) == (sum(live) > policy.budget)


def test_settings_and_registry():
    assert get_policy("infinipot_v:budget=64,tar_fraction=0.25") == InfiniPotV(budget=64, tar_fraction=0.25)
    assert get_policy("streammem:budget=32") == StreamMem(budget=32)
    for bad in (dict(budget=0), dict(recent_units=0), dict(tar_fraction=1.5), dict(visual_kinds=(99,))):
        with pytest.raises(ValueError):
            InfiniPotV(**bad)
    for bad in (dict(budget=-1), dict(num_proxies=0), dict(proxy_kinds=())):
        with pytest.raises(ValueError):
            StreamMem(**bad)


# InfiniPot-V compresses visual tokens only: a video stream; StreamMem keeps SYSTEM and its proxies: a mixed one
CYCLES = {"InfiniPotV": (K.VIDEO, K.VIDEO, K.IMAGE), "StreamMem": (K.BOUNDARY, K.VIDEO, K.AUDIO, K.VIDEO, K.TEXT,
                                                                   K.IMAGE)}


@pytest.fixture(scope="module")
def model():
    return omnijax.Decoder(TINY_OMNI)


@pytest.mark.parametrize("policy", [InfiniPotV(budget=40, recent_units=1, tar_fraction=0.5), StreamMem(budget=48)],
                         ids=repr)
def test_inside_the_scan(policy, model):
    """The policy bounds a streamed session (every trim leaves at most `budget` cells) and its plan on the real
    cache's features (keys and values averaged over layers and heads) equals the plain reading."""
    rng = np.random.default_rng(0)
    cycle = CYCLES[type(policy).__name__]
    spans = [K.SYSTEM] + [cycle[i % len(cycle)] for i in range(13)]
    chunks = stack_chunks([text_chunk(rng.integers(0, 300, 10), unit=i, span=s) for i, s in enumerate(spans)])
    result = omnijax.stream(model, chunks, policy=policy, page_size=8, num_pages=24)
    retained = np.asarray(result.stats.layout.retained_cells[:, 0])
    evicted = np.asarray(result.stats.evicted[:, 0])
    assert evicted.sum() > 0 and (retained[evicted > 0] <= policy.budget).all()
    assert retained.max() <= policy.budget + 10  # a chunk of 10 on top of the budget, then trimmed
    kv = result.state.kv
    view, features = jax.jit(sequence_view)(kv), jax.jit(slot_features)(kv)  # one program each, not op by op
    live = np.asarray(view.live)[0]
    tight = dataclasses.replace(policy, budget=20)
    got = np.asarray(jax.jit(tight.plan)(view, features))[0].tolist()
    key, vnorm = np.asarray(features.key)[0], np.asarray(features.value_norm)[0]
    unit, span = np.asarray(view.unit)[0].tolist(), np.asarray(view.span)[0].tolist()
    offset, order = np.asarray(view.offset)[0].tolist(), np.asarray(view.order)[0].tolist()
    want = (_infinipot_plain(tight, live.tolist(), unit, span, offset, key, vnorm) if isinstance(tight, InfiniPotV)
            else _streammem_plain(tight, live.tolist(), span, order, key))
    assert got == want and sum(got) < sum(live)


def test_streammem_without_proxies_keeps_the_newest_tokens():
    """A text stream labels no token BOUNDARY, so no proxy scores and every score is 0: StreamMem keeps SYSTEM and
    the newest `budget - system` tokens, the question just written among them (it kept the oldest: on SmolLM2 the
    pass-key question was evicted as it arrived and every answer was "TheTheThe")."""
    S, d = 24, 8
    live = [True] * 20 + [False] * 4
    span = [int(K.SYSTEM)] * 3 + [int(K.TEXT)] * 21
    order = list(range(S))
    key = np.random.default_rng(0).normal(size=(S, d)).astype(np.float32)
    view = _view(live, [0] * S, span, [0] * S, order)
    features = SlotFeatures(key=key[None], value_norm=np.ones((1, S), np.float32))
    got = np.asarray(StreamMem(budget=10).plan(view, features))[0].tolist()
    assert got == [True] * 3 + [False] * 10 + [True] * 7 + [False] * 4
