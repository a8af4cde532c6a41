"""`DuplexStream`: the 4.5 full-duplex loop served by an `EngineWorker` decides exactly as `DuplexSession` does.

The tiny golden MiniCPM-o 4.5 checkpoint (LLM, SigLIP + resampler, Whisper), the system prompt, reference clip and
first video frame of golden case 4, and synthetic speech (`loadgen.speech_like_pcm`): a stream alone, and two
streams sharing the engine's batched ticks (one with a system prompt longer than a chunk, deciding from its first
unit and ending units early), each against its own `DuplexSession`; refusals leave the stream and the engine as
they were.
"""

import asyncio
import dataclasses
import json
import time

import numpy as np
import pytest

import omnijax
from omnijax.chunks.spans import SpanKind
from omnijax.convert import convert_checkpoint
from omnijax.models.minicpmo.duplex import DuplexDecodeRule, DuplexTokens, UnitResult
from omnijax.retention.base import NoSlide
from omnijax.serve.engine.duplex import UNIT_SAMPLES, DuplexStream, rows_chunks, speak_text
from omnijax.serve.engine.engine import Engine, EngineConfig
from omnijax.serve.loadgen import speech_like_pcm
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.duplex import DuplexSession
from tests._support import DATA
from tests._support.engine_worker import on_worker

GOLDEN = DATA / "minicpmo45"
PAGE_SIZE, SESSION_PAGES, WIDTH = 32, 16, 128  # 512 cached rows per session; a unit with a frame is 77 rows


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("minicpmo") / "converted"
    convert_checkpoint(GOLDEN / "checkpoint", out, progress=False)
    return omnijax.load(out)


@pytest.fixture(scope="module")
def golden():
    """Markers, the release's rule, the system prompt, the reference clip and the first video frame of case 4."""
    case = np.load(GOLDEN / "case4_duplex.npz")
    meta = json.loads((GOLDEN / "case4_duplex.json").read_text())["meta"]
    sp = json.loads((GOLDEN / "info.json").read_text())["special_token_ids_tiny"]
    tokens = DuplexTokens(unit_start=sp["<unit>"], unit_end=sp["</unit>"], image_start=sp["<image>"],
                          image_end=sp["</image>"], listen=sp["<|listen|>"], chunk_eos=sp["<|chunk_eos|>"],
                          chunk_tts_eos=sp["<|chunk_tts_eos|>"])
    rule = DuplexDecodeRule(chunk_eos=sp["<|chunk_eos|>"], turn_eos=sp["<|turn_eos|>"], listen=sp["<|listen|>"],
                            tts_bos=sp["<|tts_bos|>"], forbidden=tuple(meta["decoder_forbidden_token_ids"]))
    ids = case["input_ids"][0]
    ref_start = int(np.argmax(case["position_kind"][0] == 1))
    return dict(tokens=tokens, rule=rule, special=sp, prefix=ids[:ref_start].tolist(),
                suffix=ids[ref_start + 12:ref_start + 14].tolist(), ref=case["ref_audio_waveform"],
                frame=case["frame0_uint8"])


@pytest.fixture(scope="module")
def engine(model):
    """One engine for every test (each test closes its sessions): NoSlide, buckets 1 and 2, host logits."""
    stream = StreamConfig(policy=NoSlide(), num_pages=2 * SESSION_PAGES, page_size=PAGE_SIZE, max_answer_tokens=0)
    return Engine(model, EngineConfig(stream, max_pages=SESSION_PAGES, chunk_tokens=WIDTH, buckets=(1, 2)))


def _inputs(golden, seed, units, frame_units, prefix=None, mirror=False):
    """A conversation: system prompt, `units` seconds of speech, case 4's first frame (mirrored: another picture of
    the same size, which compiles nothing new) at each of `frame_units`."""
    pcm = speech_like_pcm(units, seed).astype(np.float32) / 32768.0
    frame = np.ascontiguousarray(golden["frame"][:, ::-1]) if mirror else golden["frame"]
    frames = [frame if u in frame_units else None for u in range(units)]
    return dict(prefix=golden["prefix"] if prefix is None else prefix, suffix=golden["suffix"], ref=golden["ref"],
                pcm=[pcm[u * UNIT_SAMPLES:(u + 1) * UNIT_SAMPLES] for u in range(units)], frames=frames)


def _reference(model, golden, conv, width=WIDTH):
    """`DuplexSession` on the conversation: (results, decoded, positions fed)."""
    duplex = DuplexSession(model, rule=golden["rule"], tokens=golden["tokens"], num_pages=SESSION_PAGES,
                           page_size=PAGE_SIZE, chunk_width=width, force_listen=golden.get("force_listen", 1))
    duplex.prepare(conv["prefix"], conv["suffix"], conv["ref"])
    results = [duplex.step(p, f) for p, f in zip(conv["pcm"], conv["frames"])]
    return results, list(duplex.decoded), int(duplex.session.state.next_pos[0])


@pytest.fixture(scope="module")
def first(model, golden):
    """Speech of seed 3 over 4 units, frames at units 0 and 2, and its DuplexSession run."""
    conv = _inputs(golden, seed=3, units=4, frame_units=(0, 2))
    return conv, _reference(model, golden, conv)


async def _run(model, golden, worker, sid, conv):
    stream = await DuplexStream.open(model, worker, sid, rule=golden["rule"], tokens=golden["tokens"],
                                     force_listen=golden.get("force_listen", 1))
    await stream.prepare(conv["prefix"], conv["suffix"], conv["ref"])
    results = [await stream.step(p, f) for p, f in zip(conv["pcm"], conv["frames"])]
    return stream, results


async def _cursor(worker, sid):
    engine = worker.engine
    return await worker.in_engine(lambda: int(np.asarray(engine.state.next_pos)[engine.slot(sid)]))



def _assert_same(got, want):
    results, decoded, positions = want
    assert [r.tokens for r in got[1]] == [r.tokens for r in results]
    assert [r.listened for r in got[1]] == [r.listened for r in results]
    for g, w in zip(got[1], results):
        assert len(g.logits) == len(w.logits)
        np.testing.assert_allclose(np.stack(g.logits), np.stack(w.logits), atol=1e-5, rtol=0)
    assert got[0].decoded == decoded and got[0].position == positions == got[2]


def test_a_stream_through_the_worker_is_the_duplex_session(model, golden, engine, first):
    conv, want = first

    async def body(worker):
        stream, results = await _run(model, golden, worker, "a", conv)
        return stream, results, await _cursor(worker, "a")

    got = on_worker(engine, body)
    _assert_same(got, want)
    results = want[0]
    assert results[0].listened and not results[0].tokens  # force_listen
    assert any(r.tokens for r in results), "no unit spoke: the comparison would not cover decisions"
    assert got[0].units == 4 and got[0].failed is None


def test_two_streams_share_the_ticks_and_each_is_its_own_session(model, golden, engine, first, monkeypatch):
    conv_a, want_a = first
    tick = engine.tick

    def slow_tick():  # a tick as long as a real model's: chunks queued meanwhile share the next one
        report = tick()
        time.sleep(0.05)
        return report

    monkeypatch.setattr(engine, "tick", slow_tick)
    # B's system prompt (150 + 7 ids, the clip's 12 rows) takes two chunks of 128 rows; DuplexSession gets one wide.
    long_prefix = np.random.default_rng(1).integers(0, 1900, 150).tolist() + golden["prefix"]
    conv_b = _inputs(golden, seed=8, units=4, frame_units=(1,), prefix=long_prefix, mirror=True)
    # B decides from its first unit on, and its `<|listen|>` is an id the model decides in unit 2, so that a decision
    # ends a unit early there (the context up to that decision is the same).
    probe = _reference(model, dict(golden, force_listen=0), conv_b, width=256)[0]
    listen = probe[2].tokens[1]
    golden_b = dict(golden, rule=dataclasses.replace(golden["rule"], listen=listen), force_listen=0,
                    tokens=dataclasses.replace(golden["tokens"], listen=listen))
    want_b = _reference(model, golden_b, conv_b, width=256)
    assert any(r.listened for r in want_b[0]) and any(r.tokens for r in want_b[0])

    async def body(worker):
        (sa, ra), (sb, rb) = await asyncio.gather(_run(model, golden, worker, "a", conv_a),
                                                  _run(model, golden_b, worker, "b", conv_b))
        batched = sum(1 for t in worker.engine.telemetry.records if t.served == 2)
        return (sa, ra, await _cursor(worker, "a")), (sb, rb, await _cursor(worker, "b")), batched

    got_a, got_b, batched = on_worker(engine, body)
    assert batched >= 4  # the two streams' chunks ran in shared ticks
    _assert_same(got_a, want_a)
    _assert_same(got_b, want_b)


def test_refusals_feed_nothing(model, golden, engine, first):
    conv, want = first
    pcm = conv["pcm"][0]

    async def body(worker):
        with pytest.raises(ValueError, match="max_speak_tokens"):
            DuplexStream(model, worker, "r", rule=golden["rule"], tokens=golden["tokens"], max_speak_tokens=0)
        stream = await DuplexStream.open(model, worker, "r", rule=golden["rule"], tokens=golden["tokens"])
        with pytest.raises(RuntimeError, match="prepare"):
            await stream.step(pcm)
        with pytest.raises(ValueError, match="vocab|lie in"):
            await stream.prepare([golden["prefix"][0], 10 ** 6], [])
        await stream.prepare(conv["prefix"], conv["suffix"], conv["ref"])
        ticks, position, cursor = worker.stats["ticks"], stream.position, await _cursor(worker, "r")
        bad = [(pcm[:-1], "exactly 16000"), (np.concatenate([pcm, pcm[:5]]), "exactly 16000"),
               (pcm[None], "mono"), (np.stack([pcm, pcm], -1), "mono"),
               ((pcm * 32767).astype(np.int16), "float"), (np.where(np.arange(pcm.size) == 7, np.nan, pcm), "NaN")]
        for wrong, match in bad:
            with pytest.raises(ValueError, match=match):
                await stream.step(wrong)
        with pytest.raises(ValueError):
            await stream.step(pcm, np.zeros((4, 4), np.uint8))  # not an [H, W, 3] frame
        assert (worker.stats["ticks"], stream.position, await _cursor(worker, "r")) == (ticks, position, cursor)
        assert stream.failed is None and stream.units == 0
        # The stream goes on as if nothing had been tried; a second step while one runs is refused.
        running = asyncio.ensure_future(stream.step(pcm, conv["frames"][0]))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="busy"):
            await stream.step(conv["pcm"][1])
        result = await running
        with pytest.raises(RuntimeError, match="already prepared"):
            await stream.prepare(conv["prefix"], conv["suffix"])
        return result

    result = on_worker(engine, body)
    np.testing.assert_allclose(result.logits[0], want[0][0].logits[0], atol=1e-5, rtol=0)
    assert result.listened == want[0][0].listened


def test_rows_chunks_split_at_the_width_and_keep_the_layout(model):
    D = model.config.hidden_size
    block = np.arange(5 * D, dtype=np.float32).reshape(5, D)
    items = [(1960, SpanKind.BOUNDARY), (block, SpanKind.AUDIO), (7, SpanKind.RESPONSE), (8, SpanKind.RESPONSE)]
    chunks = rows_chunks(items, 3, D, width=4)
    assert [int(c.advance[0]) for c in chunks] == [4, 4]
    np.testing.assert_array_equal(np.concatenate([c.span[0] for c in chunks]), [1] + [5] * 5 + [7, 7])
    np.testing.assert_array_equal(np.concatenate([c.offset[0] for c in chunks]), [0, 0, 1, 2, 3, 4, 0, 1])
    np.testing.assert_array_equal(chunks[1].positions[0, 0], np.arange(4))
    np.testing.assert_array_equal(chunks[1].embeds[0, :2], block[3:])
    assert rows_chunks([(7, SpanKind.RESPONSE)], 3, D, width=4)[0].embeds is None  # token-only: no embeddings
    assert (chunks[0].unit == 3).all()


def test_speak_text_drops_the_markers(golden, tmp_path):
    from omnijax.models.tokenizer import Tokenizer, write_tiny_tokenizer
    sp = golden["special"]
    tokenizer = Tokenizer.from_directory(write_tiny_tokenizer(tmp_path, vocab_size=2048, special_tokens=sp,
                                                              chat_template=None))
    words = tokenizer.encode("Hello there")
    result = UnitResult(tokens=[sp["<|tts_bos|>"], *words, sp["<|turn_eos|>"]], listened=False, logits=[])
    markers = {sp["<|tts_bos|>"], sp["<|turn_eos|>"]}
    assert speak_text(result, tokenizer, markers) == "Hello there"
    decoder = tokenizer.stream_decoder(skip_special_tokens=True)
    halves = [UnitResult(tokens=t, listened=False, logits=[]) for t in (words[:1], words[1:])]
    assert "".join(speak_text(r, tokenizer, markers, decoder=decoder) for r in halves) + decoder.flush() == \
        "Hello there"


def test_a_response_on_a_server_that_decodes_no_answers_fails_at_once_naming_tau(model, engine):
    """A duplex engine decodes no answers (`max_answer_tokens=0`): a chat-style response asked of it used to wait
    for ever (every frame asked for 0 tokens); it fails at once, naming the setting, and queues nothing."""
    from omnijax.chunks.chunk import text_chunk
    from omnijax.conversation import Prompt

    chunk = text_chunk([1, 2, 3], length=WIDTH, answer_tokens=0)

    async def body(worker):
        await worker.open("r")
        answer = worker.respond("r", Prompt(parts=[chunk], answer_unit=1), 4, lambda unit, n: chunk)
        return answer, list(worker.lanes["r"].pending)

    answer, pending = on_worker(engine, body)
    assert answer.status == "failed" and "max_answer_tokens=0" in answer.reason and "--answer-tokens" in answer.reason
    assert pending == []
