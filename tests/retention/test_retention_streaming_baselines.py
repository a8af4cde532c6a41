"""The 2025-26 streaming baselines: StreamingVLM and OmniMemBudgets (jitted plans and triggers equal plain-Python
planners on random unit streams, bounds hold, they run inside `omnijax.stream`) and TimeChat-Online's differential
token drop (jnp filter equals a numpy reference on random chunk stacks, composes with a policy in a stream)."""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import omnijax
from omnijax.chunks.chunk import Chunk, stack_chunks, text_chunk
from omnijax.chunks.spans import SpanKind as K
from omnijax.models.config import TINY_OMNI
from omnijax.retention import (
    REGISTRY,
    DifferentialTokenDrop,
    NoSlide,
    OmniMemBudgets,
    StreamingVLM,
    differential_token_drop,
    get_policy,
    sequence_view,
)
from tests._support import reference_streaming_baselines as ref
from tests._support import soak
from tests._support.unit_streams import Token, kept_orders, random_stream, to_view

B, S = 8, 256
_view = jax.jit(sequence_view)  # one program, not one per primitive
BATCHES = 64 * soak.factor()  # 512 streams per setting

SETTINGS = [
    StreamingVLM(sink=0, text_window=1, vision_window=1),
    StreamingVLM(sink=2, text_window=5, vision_window=3),
    StreamingVLM(sink=4, text_window=10, vision_window=20, audio_window=6),
    StreamingVLM(sink=3, text_window=4, vision_window=8, audio_window=0, text_sink=False),
    StreamingVLM(sink=8, text_window=0, vision_window=30, text_sink=False),
    StreamingVLM(sink=16, text_window=40, vision_window=60, audio_window=30),
    StreamingVLM(),  # paper-size windows: rarely triggers at S=256
    OmniMemBudgets(visual_budget=0, audio_budget=0),
    OmniMemBudgets(visual_budget=5, audio_budget=3),
    OmniMemBudgets(visual_budget=12, audio_budget=20, text_budget=6),
    OmniMemBudgets(visual_budget=40, audio_budget=10, text_budget=0),
    OmniMemBudgets(visual_budget=1, audio_budget=60, text_budget=30),
]


def _stream(rng: np.random.Generator) -> list[Token]:
    while True:
        kw = {"units": int(rng.integers(1, 9))}
        pick = rng.random()
        if pick < 0.15:
            kw["kinds"] = ("av",)
        elif pick < 0.25:
            kw["kinds"] = ("text", "response")
        elif pick < 0.35:
            kw["kinds"] = ("image", "audio")
        stream = random_stream(rng, **kw)
        if len(stream) <= S:
            break
    if rng.random() < 0.3:  # after earlier evictions: gaps in the orders
        stream = [t for t in stream if rng.random() < 0.6] or stream[-1:]
    if rng.random() < 0.2:  # ages scrambled: modalities interleave arbitrarily in time
        perm = rng.permutation(len(stream))
        stream = [dataclasses.replace(t, order=int(perm[i])) for i, t in enumerate(stream)]
    return stream


@pytest.fixture(scope="module")
def pool():
    rng = np.random.default_rng(2026)
    batches = []
    for _ in range(BATCHES):
        streams = [[] if rng.random() < 0.02 else _stream(rng) for _ in range(B)]
        batches.append((streams, to_view(streams, rng, capacity=S, axes=int(rng.choice([1, 3])))))
    return batches


def _bound(policy, stream) -> int:
    if isinstance(policy, StreamingVLM):
        return policy.budget
    system = sum(t.span == K.SYSTEM for t in stream)
    text = sum(t.span in ref.TEXT_SIDE and t.span != K.SYSTEM for t in stream)
    return system + policy.visual_budget + policy.audio_budget + (
        text if policy.text_budget is None else policy.text_budget)


@pytest.mark.parametrize("policy", SETTINGS, ids=repr)
def test_plan_and_trigger_match_reference(policy, pool):
    plan, trigger = jax.jit(policy.plan), jax.jit(policy.trigger)
    trims = compared = 0
    for streams, view in pool:
        keep, fire = np.asarray(plan(view)), np.asarray(trigger(view))
        assert keep.shape == (B, S) and keep.dtype == bool and fire.shape == (B,)
        assert not np.any(keep & ~np.asarray(view.live)), "keep must be a subset of live"
        got = kept_orders(view, keep)
        for b, stream in enumerate(streams):
            want = ref.reference_plan(policy, stream)
            assert got[b] == want, (policy, sorted((t.order, t.span) for t in stream))
            assert bool(fire[b]) == ref.reference_trigger(policy, stream), (policy, b)
            assert len(want) <= _bound(policy, stream)
            compared += 1
            if fire[b]:
                trims += 1
                # A second plan over the survivors keeps them all and does not trigger again.
                again = [t for t in stream if t.order in want]
                assert ref.reference_plan(policy, again) == want
                assert not ref.reference_trigger(policy, again)
    assert compared >= 500
    if policy not in (StreamingVLM(),):
        assert trims > 50, "the setting must exercise real trims"


def test_second_round_is_stable(pool):
    """Plans applied to their own survivors keep everything and stop triggering (jitted, both policies)."""
    rng = np.random.default_rng(5)
    for policy in (SETTINGS[2], SETTINGS[3], SETTINGS[9]):
        plan, trigger = jax.jit(policy.plan), jax.jit(policy.trigger)
        for streams, view in pool[:8]:
            got = kept_orders(view, plan(view))
            again = [[t for t in s if t.order in k] for s, k in zip(streams, got)]
            view2 = to_view(again, rng, capacity=S)
            assert kept_orders(view2, plan(view2)) == [{t.order for t in s} for s in again]
            assert not np.asarray(trigger(view2)).any()


def test_handmade_plans():
    spans = [K.SYSTEM] * 2 + [K.BOUNDARY] + [K.VIDEO] * 4 + [K.AUDIO] * 3 + [K.TEXT] * 3 + [K.BOUNDARY] \
        + [K.IMAGE] * 2 + [K.AUDIO] * 2 + [K.RESPONSE] * 2
    toks = [Token(order=i, unit=1, span=int(s), offset=0, score=0.0) for i, s in enumerate(spans)]
    view = to_view([toks], np.random.default_rng(3), capacity=40)
    # Orders: SYSTEM 0-1, B 2, V 3-6, A 7-9, T 10-12, B 13, I 14-15, A 16-17, R 18-19.
    vlm = StreamingVLM(sink=2, text_window=3, vision_window=4)  # audio shares the vision window
    assert kept_orders(view, vlm.plan(view))[0] == {0, 1} | {13, 18, 19} | {14, 15, 16, 17}
    split = StreamingVLM(sink=1, text_window=2, vision_window=3, audio_window=1, text_sink=False)
    assert kept_orders(view, split.plan(view))[0] == {0} | {18, 19} | {6, 14, 15} | {17}
    mem = OmniMemBudgets(visual_budget=3, audio_budget=2, text_budget=None)
    assert kept_orders(view, mem.plan(view))[0] == {0, 1, 2, 10, 11, 12, 13, 18, 19} | {6, 14, 15} | {16, 17}
    mem_t = OmniMemBudgets(visual_budget=0, audio_budget=4, text_budget=1)
    assert kept_orders(view, mem_t.plan(view))[0] == {0, 1, 19, 9, 16, 17, 8}


def test_registry_and_validation():
    assert REGISTRY["streaming_vlm"] is StreamingVLM and REGISTRY["omnimem_budgets"] is OmniMemBudgets
    assert StreamingVLM.reindex and OmniMemBudgets.reindex
    assert get_policy("streaming_vlm:sink=4,vision_window=64,audio_window=16") == StreamingVLM(
        sink=4, vision_window=64, audio_window=16)
    assert get_policy("omnimem_budgets:text_budget=none") == OmniMemBudgets()
    assert StreamingVLM(sink=1, text_window=2, vision_window=3, audio_window=4).budget == 10
    assert OmniMemBudgets(1, 2, 3).budget == 6 and OmniMemBudgets().budget is None
    for bad in ({"sink": -1}, {"text_window": 1.5}, {"audio_window": -2}, {"text_sink": 1},
                {"sink": 0, "text_window": 0, "vision_window": 0}, {"vision_window": True}):
        with pytest.raises(ValueError):
            StreamingVLM(**bad)
    for bad in ({"visual_budget": -1}, {"audio_budget": 2.0}, {"text_budget": -3}):
        with pytest.raises(ValueError):
            OmniMemBudgets(**bad)


# ------------------------------------------------------------------------------------------------- inside the scan

@pytest.fixture(scope="module")
def model():
    return omnijax.Decoder(TINY_OMNI)


CYCLE = (K.TEXT, K.VIDEO, K.AUDIO, K.VIDEO, K.IMAGE, K.AUDIO, K.RESPONSE)


def _mixed_session(n_chunks=14, length=10, seed=0) -> Chunk:
    """1D-position chunks of one span kind each (a SYSTEM chunk first), cycling over modalities."""
    rng = np.random.default_rng(seed)
    spans = [K.SYSTEM] + [CYCLE[i % len(CYCLE)] for i in range(n_chunks - 1)]
    return stack_chunks([text_chunk(rng.integers(0, 300, length), unit=i, span=s) for i, s in enumerate(spans)])


def _simulate(policy, chunks: Chunk):
    """Reference run: append each chunk's tokens, trim with the reference planner when it triggers."""
    stream, order, retained = [], 0, []
    for c in range(chunks.token_ids.shape[0]):
        for t in range(chunks.token_ids.shape[2]):
            if chunks.valid[c, 0, t]:
                stream.append(Token(order=order, unit=int(chunks.unit[c, 0, t]), span=int(chunks.span[c, 0, t]),
                                    offset=int(chunks.offset[c, 0, t]), score=0.0))
                order += 1
        if ref.reference_trigger(policy, stream):
            keep = ref.reference_plan(policy, stream)
            stream = [t for t in stream if t.order in keep]
        retained.append(len(stream))
    return stream, retained


@pytest.mark.parametrize("policy", [StreamingVLM(sink=4, text_window=12, vision_window=16),
                                    StreamingVLM(sink=6, text_window=8, vision_window=10, audio_window=7,
                                                 text_sink=False),
                                    OmniMemBudgets(visual_budget=15, audio_budget=8),
                                    OmniMemBudgets(visual_budget=12, audio_budget=5, text_budget=9)], ids=repr)
def test_inside_the_scan_matches_the_reference_run(model, policy):
    chunks = _mixed_session()
    result = omnijax.stream(model, chunks, policy=policy, page_size=8, num_pages=24, impl="reference")
    retained = np.asarray(result.stats.layout.retained_cells[:, 0])
    evicted = np.asarray(result.stats.evicted[:, 0])
    stream, want = _simulate(policy, jax.tree.map(np.asarray, chunks))
    np.testing.assert_array_equal(retained, want)
    assert evicted.sum() > 0 and (retained + np.cumsum(evicted) == 10 * np.arange(1, 15)).all()
    np.testing.assert_array_equal(np.asarray(result.stats.next_pos[:, 0]), retained)  # contiguous re-indexing
    view = _view(result.state.kv)
    live = np.asarray(view.live[0])
    got = sorted(zip(np.asarray(view.unit[0])[live].tolist(), np.asarray(view.span[0])[live].tolist(),
                     np.asarray(view.offset[0])[live].tolist()))
    assert got == sorted((t.unit, t.span, t.offset) for t in stream)
    pos = np.asarray(view.pos[0, 0])[live]
    assert sorted(pos.tolist()) == list(range(len(pos)))  # positions close up in write order
    assert retained.max() <= (policy.budget if isinstance(policy, StreamingVLM) else _bound(policy, stream))
    assert not bool(result.state.kv.exhausted[0])


def test_tmrope_session_stays_bounded(model):
    """A Qwen2.5-Omni layout (3-axis TMRoPE positions, audiovisual units) under both policies: per-modality counts
    stay within their windows after every trim and nothing is lost or invented."""
    from omnijax.testing.synthetic import qwen_av_session

    chunks = qwen_av_session(6, vocab_size=TINY_OMNI.vocab_size, system_tokens=8)
    per_chunk = np.asarray(chunks.valid).sum(axis=(1, 2))
    for policy in (StreamingVLM(sink=8, text_window=16, vision_window=90),
                   OmniMemBudgets(visual_budget=80, audio_budget=60)):
        result = omnijax.stream(model, chunks, policy=policy, page_size=16, num_pages=40, impl="reference")
        retained = np.asarray(result.stats.layout.retained_cells[:, 0])
        evicted = np.asarray(result.stats.evicted[:, 0])
        assert evicted.sum() > 0 and (retained + np.cumsum(evicted) == np.cumsum(per_chunk)).all()
        view = _view(result.state.kv)
        live, span = np.asarray(view.live[0]), np.asarray(view.span[0])
        visual = np.isin(span, [K.IMAGE, K.SLICE, K.VIDEO]) & live
        audio = (span == K.AUDIO) & live
        if isinstance(policy, StreamingVLM):
            assert retained.max() <= policy.budget and visual.sum() + audio.sum() <= policy.vision_window
        else:
            assert visual.sum() <= 80 and audio.sum() <= 60 and ((span == K.SYSTEM) & live).sum() == 8
        pos = np.asarray(view.pos[0])[:, live]
        assert pos.min() == 0 and pos.max() < int(result.stats.next_pos[-1, 0])  # re-indexed from 0, below the cursor


# ------------------------------------------------------------------------------------ differential token drop

def _random_stack(rng, C, Bn, T, D=6, kinds=(K.VIDEO, K.IMAGE)):
    """A chunk stack with random runs of media/text (runs cross chunk borders, offsets continue), some padding,
    embeddings that often repeat the previous run's token at the same offset (with small noise)."""
    L = C * T
    valid = np.zeros((Bn, L), bool)
    span = np.zeros((Bn, L), np.int32)
    offset = np.zeros((Bn, L), np.int32)
    mask = np.zeros((Bn, L), bool)
    emb = np.zeros((Bn, L, D), np.float32)
    for b in range(Bn):
        i, last = 0, {}
        frame = int(rng.integers(2, 7))
        while i < L:
            kind = [K.VIDEO, K.VIDEO, K.AUDIO, K.TEXT, K.IMAGE][int(rng.integers(5))]
            n = min(int(rng.integers(1, 3 * frame)), L - i)
            base = last.get(kind, {})
            now = {}
            for k in range(n):
                j = i + k
                valid[b, j] = rng.random() > 0.05
                span[b, j], offset[b, j] = kind, k
                mask[b, j] = kind != K.TEXT and rng.random() > 0.03
                r = rng.random()
                if k in base and r < 0.5:
                    emb[b, j] = base[k] + rng.normal(0, 0.02, D)
                elif k in base and r < 0.6:
                    emb[b, j] = base[k] * rng.uniform(0.5, 2.0)  # same direction, other norm
                elif r < 0.62:
                    emb[b, j] = 0.0
                else:
                    emb[b, j] = rng.normal(0, 1, D)
                now[k] = emb[b, j]
            last[kind] = now
            i += n
    unflat = lambda x: np.moveaxis(x.reshape((Bn, C, T) + x.shape[2:]), 1, 0)  # noqa: E731
    zeros = np.zeros((C, Bn), np.int32)
    chunks = Chunk(token_ids=np.zeros((C, Bn, T), np.int32), valid=unflat(valid),
                   positions=unflat(offset)[None].transpose(1, 0, 2, 3), unit=np.zeros((C, Bn, T), np.int32),
                   span=unflat(span), offset=unflat(offset), answer_tokens=zeros, answer_unit=zeros,
                   advance=np.full((C, Bn), T, np.int32), embeds=unflat(emb), embed_mask=unflat(mask))
    return chunks, (valid, mask, span, offset, emb)


DTD_SETTINGS = [DifferentialTokenDrop(0.9), DifferentialTokenDrop(0.99, kinds=(K.VIDEO, K.IMAGE)),
                DifferentialTokenDrop(0.5, frame_tokens=3), DifferentialTokenDrop(-1.0, frame_tokens=2),
                DifferentialTokenDrop(1.0, kinds=(K.AUDIO,))]


@pytest.mark.parametrize("dtd", DTD_SETTINGS, ids=repr)
def test_token_drop_matches_reference(dtd):
    rng = np.random.default_rng(zlib.crc32(repr(dtd).encode()))
    run, apply = jax.jit(dtd.redundant), jax.jit(dtd)
    sequences = drops = marginal_total = 0
    for _ in range(64):
        C, Bn, T = 3, 4, 16  # one shape: one compile
        chunks, (valid, mask, span, offset, emb) = _random_stack(rng, C, Bn, T)
        got = np.asarray(run(chunks))  # [C, B, T]
        got_flat = np.moveaxis(got, 0, 1).reshape(Bn, C * T)
        for b in range(Bn):
            want, marginal = ref.differential_token_drop(valid[b], mask[b], span[b], offset[b], emb[b],
                                                         threshold=dtd.threshold, frame_tokens=dtd.frame_tokens,
                                                         kinds=dtd.kinds)
            np.testing.assert_array_equal(got_flat[b][~marginal], want[~marginal])
            sequences += 1
            drops += int(want.sum())
            marginal_total += int(marginal.sum())
        filtered = apply(chunks)
        np.testing.assert_array_equal(np.asarray(filtered.valid), np.asarray(chunks.valid) & ~got)
        assert not np.any(got & ~np.asarray(chunks.valid))
    assert sequences >= 256
    if dtd.threshold < 1.0:  # (at 1.0 the rescaled copies sit exactly on the threshold: marginal by design)
        assert drops > 50 and marginal_total < 5


def test_token_drop_single_chunk_and_jit():
    """A single chunk `[B, T]` is filtered on its own (as the first chunk of a stack would be)."""
    rng = np.random.default_rng(11)
    chunks, _ = _random_stack(rng, 3, 2, 16)
    dtd = DifferentialTokenDrop(0.8)
    whole = np.asarray(dtd.redundant(chunks))
    first = jax.tree.map(lambda x: np.asarray(x)[0], chunks)
    np.testing.assert_array_equal(np.asarray(jax.jit(dtd.redundant)(first)), whole[0])
    out = differential_token_drop(first, 0.8)
    np.testing.assert_array_equal(np.asarray(out.valid), np.asarray(first.valid) & ~whole[0])
    with pytest.raises(ValueError):
        dtd(text_chunk([1, 2, 3]))  # no embeddings
    for bad in ({"threshold": 1.5}, {"threshold": True}, {"frame_tokens": 0}, {"kinds": ()}, {"kinds": (99,)}):
        with pytest.raises(ValueError):
            DifferentialTokenDrop(**bad)


def test_token_drop_composes_with_a_policy_in_the_stream(model):
    """Video chunks with embeddings, every other one a near-copy of the previous frame: the filter drops the copies
    before the cache and any policy then bounds what is left."""
    rng = np.random.default_rng(4)
    D, length = TINY_OMNI.hidden_size, 10
    parts, prev = [], None
    for i in range(8):
        span = K.TEXT if i % 4 == 3 else K.VIDEO
        chunk = text_chunk(rng.integers(0, 300, length), unit=i, span=span)
        emb = rng.normal(0, 1, (1, length, D)).astype(np.float32)
        if span == K.VIDEO and prev is not None and i % 2 == 1:
            emb[0, :6] = prev[0, :6] + rng.normal(0, 1e-3, (6, D))  # six of ten tokens barely change
        if span == K.VIDEO:
            prev = emb
        parts.append(dataclasses.replace(chunk, embeds=emb, embed_mask=np.full((1, length), span == K.VIDEO)))
    chunks = stack_chunks(parts)
    filtered = DifferentialTokenDrop(0.95)(chunks)
    dropped = np.asarray(chunks.valid) & ~np.asarray(filtered.valid)
    assert dropped.sum() == 6 * 2  # chunks 1 and 5 repeat chunks 0 and 4 (chunks 3 and 7 are text)
    per_chunk = np.asarray(filtered.valid).sum(axis=(1, 2))
    for policy in (NoSlide(), StreamingVLM(sink=2, text_window=8, vision_window=20),
                   OmniMemBudgets(visual_budget=18, audio_budget=4)):
        result = omnijax.stream(model, filtered, policy=policy, page_size=8, num_pages=16, impl="reference")
        retained = np.asarray(result.stats.layout.retained_cells[:, 0])
        evicted = np.asarray(result.stats.evicted[:, 0])
        assert (retained + np.cumsum(evicted) == np.cumsum(per_chunk)).all()
        view = _view(result.state.kv)
        live = np.asarray(view.live[0])
        cached = set(zip(np.asarray(view.unit[0])[live].tolist(), np.asarray(view.offset[0])[live].tolist()))
        c_idx, _, t_idx = np.nonzero(dropped)
        assert not cached & set(zip(c_idx.tolist(), t_idx.tolist())), "dropped tokens never enter the cache"
        if isinstance(policy, NoSlide):
            assert retained[-1] == 80 - 12
        else:
            assert evicted.sum() > 0
    jitted = jax.jit(DifferentialTokenDrop(0.95))(jax.tree.map(jnp.asarray, chunks))
    np.testing.assert_array_equal(np.asarray(jitted.valid), np.asarray(filtered.valid))
