"""Chunk builders and the host-side validation every chunk passes before it enters a compiled program."""

import dataclasses

import numpy as np
import pytest

import omnijax
from omnijax.chunks.chunk import split_text, stack_chunks, text_chunk
from omnijax.chunks.spans import SpanKind
from omnijax.models.config import TINY_OMNI
from omnijax.streaming.step import init_state


@pytest.fixture(scope="module")
def model():
    return omnijax.Decoder(TINY_OMNI)


def test_text_chunk_layout():
    c = text_chunk([5, 6, 7], length=5, unit=3, span=SpanKind.SYSTEM, answer_tokens=2)
    assert c.valid.tolist() == [[True, True, True, False, False]]
    assert c.positions.shape == (1, 1, 5) and c.positions[0, 0, :3].tolist() == [0, 1, 2]
    assert text_chunk([5, 6], position_axes=3).positions.shape == (3, 1, 2)
    assert (c.span[0, :3] == int(SpanKind.SYSTEM)).all() and c.answer_unit.tolist() == [4]
    stacked = split_text(np.arange(10), 3, answer_tokens=4)
    assert stacked.token_ids.shape == (3, 1, 4) and stacked.answer_tokens[:, 0].tolist() == [0, 0, 4]
    assert stacked.valid.sum() == 10
    with pytest.raises(ValueError, match="non-empty"):
        split_text(np.arange(2), 3)
    with pytest.raises(ValueError, match="at most length=2 tokens, got 3"):
        text_chunk([1, 2, 3], length=2)
    with pytest.raises(ValueError, match="at least one token"):
        text_chunk([])
    with pytest.raises(ValueError, match="integer token ids, got dtype float64"):
        text_chunk([1.5, 2.0])  # would otherwise be truncated to [1, 2]


@pytest.mark.parametrize("change, message", [
    (dict(token_ids=np.full((2, 1, 4), 999)), "token ids must lie in"),
    (dict(token_ids=np.full((2, 1, 4), 3.0)), "token_ids must be integers, got dtype float64"),
    (dict(unit=np.full((2, 1, 4), -1, np.int32)), "unit ids of valid tokens must be non-negative"),
    (dict(span=np.full((2, 1, 4), 42, np.int8)),
     r"span kinds must be omnijax.chunks.spans.SpanKind values, got \[42\]"),
    (dict(offset=np.full((2, 1, 4), -3, np.int32)), "offsets within spans must be non-negative, got -3"),
    (dict(answer_tokens=np.array([[0], [2]], np.int32), answer_unit=np.array([[0], [-1]], np.int32)),
     "answer_unit must be non-negative"),
    (dict(valid=np.ones((2, 1, 3), bool)), "valid has shape"),
    (dict(positions=np.zeros((2, 2, 1, 4), np.int32)), "positions must have 3"),
    (dict(positions=np.full((2, 1, 1, 4), -1, np.int32)), "non-negative"),
    (dict(answer_tokens=np.array([[0], [9]], np.int32)), "max_answer_tokens=4"),
    (dict(embeds=np.zeros((2, 1, 4, 64), np.float32)), "come together"),
    (dict(embeds=np.zeros((2, 1, 4, 8), np.float32), embed_mask=np.ones((2, 1, 4), bool)), "embeds must be"),
    (dict(embeds=np.full((2, 1, 4, 64), np.nan, np.float32), embed_mask=np.ones((2, 1, 4), bool)), "NaN"),
])
def test_stream_rejects_bad_chunks(model, change, message):
    chunks = stack_chunks([text_chunk([1, 2, 3, 4]), text_chunk([5, 6])])
    with pytest.raises(ValueError, match=message):
        omnijax.stream(model, dataclasses.replace(chunks, **change), max_answer_tokens=4)


def test_stream_and_session_refuse_a_policy_name_and_an_unknown_impl(model):
    chunks = stack_chunks([text_chunk([1, 2, 3, 4])])
    for run in (lambda **kw: omnijax.stream(model, chunks, **kw), lambda **kw: omnijax.Session(model, **kw)):
        with pytest.raises(TypeError, match="not the name 'omnipick'"):
            run(policy="omnipick")
        with pytest.raises(TypeError, match=r"retention policy object \(with plan and trigger\)"):
            run(policy=object())
        with pytest.raises(ValueError, match="unknown attention impl 'triton'"):
            run(impl="triton")


def test_stream_and_session_refuse_a_state_made_for_another_model(model):
    # Before this check a cache with fewer layers ran silently: the layer loop clamps its index into the cache.
    chunks = stack_chunks([text_chunk([1, 2, 3, 4])])
    for change, message in ((dict(num_layers=TINY_OMNI.num_layers - 1), "layers"),
                            (dict(dtype="bfloat16"), "dtype bfloat16 \\(model: float32\\)")):
        state = init_state(dataclasses.replace(TINY_OMNI, **change), num_pages=4, page_size=8)
        with pytest.raises(ValueError, match=f"not made for this model: {message}"):
            omnijax.stream(model, chunks, state=state)
        with pytest.raises(ValueError, match=f"not made for this model: {message}"):
            omnijax.Session(model, state=state)
    omnijax.stream(model, chunks, state=init_state(TINY_OMNI, num_pages=4, page_size=8))  # the right one runs


def test_stream_warns_when_the_pool_runs_out(model):
    chunks = stack_chunks([text_chunk([1, 2, 3, 4, 5, 6])])
    with pytest.warns(RuntimeWarning, match=r"ran out in sequence\(s\) \[0\]: \[2\] token\(s\) were not cached"):
        result = omnijax.stream(model, chunks, num_pages=1, page_size=4)
    assert bool(result.state.kv.exhausted[0]) and int(result.state.kv.dropped[0]) == 2


def test_stream_and_session_reject_wrong_rank_and_batch(model):
    with pytest.raises(ValueError, match="stack_chunks"):
        omnijax.stream(model, text_chunk([1, 2]))
    session = omnijax.Session(model, num_pages=4, page_size=4, batch=2)
    with pytest.raises(ValueError, match="chunk batch 1 != session batch 2"):
        session.feed(text_chunk([1, 2]))
    with pytest.raises(ValueError, match=r"token_ids must be \[B, T\]"):
        session.feed(split_text([1, 2, 3], 1))


def test_split_chunk_streams_exactly_as_the_whole(model):
    """An audiovisual unit (3-axis TMRoPE positions that are not monotone in the token order) and a text turn cut
    into parts of at most 7 tokens: streaming the parts gives the cache the whole chunk gives (positions on every
    axis, units, spans) and the same logits for the question that follows."""
    from omnijax.chunks.chunk import pad_chunk, split_chunk
    from omnijax.models.qwen2_5_omni import layout as adapter
    from omnijax.streaming.session import Session

    def small(chunk):  # the release's marker ids folded into the tiny vocabulary
        chunk = adapter.with_embeds(chunk, TINY_OMNI.hidden_size)
        return dataclasses.replace(chunk, token_ids=np.asarray(chunk.token_ids) % TINY_OMNI.vocab_size)

    rng = np.random.default_rng(0)
    av = small(adapter.audiovisual_unit((2, 4, 6), 25, 1.0, 1))
    av = dataclasses.replace(av, embeds=rng.normal(size=av.embeds.shape).astype(np.float32))
    text = small(adapter.text_unit(list(range(30, 49)), 2))
    question = small(adapter.text_unit([7, 8, 9], 3, answer_tokens=2))
    parts = split_chunk(av, 7) + split_chunk(text, 7)
    assert all(p.length <= 7 for p in parts) and len(parts) == -(-av.length // 7) + -(-text.length // 7)
    assert sum(int(p.valid.sum()) for p in parts) == int(av.valid.sum() + text.valid.sum())
    assert all(int(p.answer_tokens[0]) == 0 for p in parts)
    assert split_chunk(question, 7)[-1].answer_tokens.tolist() == [2]  # only the last part asks for the answer

    def run(chunks):
        session = Session(model, omnijax.StreamConfig(num_pages=32, page_size=16, max_answer_tokens=2))
        for c in chunks:
            session.feed(pad_chunk(c, 64))
        out = session.feed(pad_chunk(question, 64))
        kv = session.state.kv
        keep = np.asarray(kv.valid)
        cells = sorted(zip(np.asarray(kv.order)[keep].tolist(), np.asarray(kv.pos)[:, keep].T.tolist(),
                           np.asarray(kv.unit)[keep].tolist(), np.asarray(kv.span)[keep].tolist()))
        return np.asarray(out.logits), np.asarray(out.tokens), cells, int(session.state.next_pos[0])

    whole, split = run([av, text]), run(parts)
    np.testing.assert_allclose(split[0], whole[0], atol=1e-5)
    assert np.array_equal(split[1], whole[1]) and split[2] == whole[2] and split[3] == whole[3]
    with pytest.raises(ValueError, match="max_len"):
        split_chunk(av, 0)
