"""Qwen2.5-Omni speech on the engine that starts while the thinker writes (`SpeechConfig(early_start=True)`, issue 39
item 2), on the seeded tiny release the other Qwen2.5-Omni speech tests build (`tests/_support/qwen25_speech`; its
transformers half kept between runs: `tests/_support/qwen25_release_cache`).

The engine's decode programs return each answer token's final-normed last-layer row (`FrameOutput.answer_rows`);
each tick's tokens and rows go to the speech pool (`Qwen25SpeechPool.extend(..., rows=...)`), whose talker prefills
once the first answer row is known and steps only as far as the rows allow. Checked here, on answers of 24 tokens
decoded 4 a tick (6 ticks) at positions 52 .. 75 (crossing the thinker's 64-token page), two sessions speaking on
a seeded schedule (the second opened a tick later):

- each utterance's talker tokens, codes and PCM equal `speech_stream.AnswerSpeech` (what `Chat(..., early_start)`
  speaks) fed the same tokens and rows after the answer ended, bit for bit, and the default finish-first path's
  (`speak_chunks`: one thinker forward over prompt and answer, held equal to transformers in
  tests/models/qwen2_5_omni/test_speech.py), the codes agreeing despite the rows' rounding;
- the first PCM chunk is sent in a tick before the answer's last token is decoded (ticks counted);
- the two sessions together equal each one alone (answer, rows, codes, PCM), the first alone on host-driven ticks
  (`token_step` with the tap), so those return the fused ticks' rows;
- the rows against one full thinker forward (`talker_forward.thinker_rows`): within `ROWS_TOL`;
- without the flag, the engine's programs (`engine_step`, its prefill-only form, `token_step`) lower to the text of
  the programs as they were before the tap existed (their bodies kept here as twins);
- refused by name, the pool unchanged: writing without `early_start`, sampling, an extend after the end, rows of
  another shape, a placeholder id, a whole-answer preparation opened as writing; an answer ended without a token
  ends its stream silent.
"""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import omnijax
from omnijax.chunks.chunk import text_chunk
from omnijax.models.qwen2_5_omni import talker_forward as TF
from omnijax.models.qwen2_5_omni.token2wav_stream import Token2WavStreaming
from omnijax.paging import migration
from omnijax.retention.recall import Recall
from omnijax.serve.engine import decode_loop
from omnijax.serve.engine.engine import Engine, EngineConfig
from omnijax.serve.engine.speech_config import SpeechConfig
from omnijax.serve.engine.speech_qwen25 import Qwen25SpeechPool
from omnijax.streaming.step import StreamState, chunk_step, decode_token
from tests._support.qwen25_release_cache import kept_release25

TAU, ANSWER, PROMPT = 4, 24, 52  # 4 answer tokens a tick, 6 ticks; positions 52 .. 75 cross the page at 64
SPEECH = SpeechConfig(rows=(2,), num_pages=8, page_size=64, first_chunk=4, chunk=5, steps_per_tick=TAU,
                      early_start=True)
ENGINE = EngineConfig(omnijax.StreamConfig(num_pages=16, page_size=64, max_answer_tokens=TAU), chunk_tokens=64,
                      buckets=(2,), speech=SPEECH)
ROWS_TOL = 1e-5  # the tapped rows against one full forward (printed)
# seed 0's prompts: greedy answers of 24 tokens, no placeholder or stop id among them
PLAN = [dict(sid="a", at=0, voice="Chelsie", max_new_tokens=30), dict(sid="b", at=1, voice="Ethan", max_new_tokens=30)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = kept_release25(tmp_path_factory.mktemp("early_pool25"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no tokenizer files: token ids in, token ids out
        model = omnijax.load(out)
    # no look-ahead, no vocoder right context: PCM as soon as the talker has first_chunk codes (every path alike)
    model.speech.streaming = Token2WavStreaming(right_blocks=0, vocoder_right=0)
    return model


def _plan():
    rng = np.random.default_rng(0)
    return [{**u, "prompt": rng.integers(20, 200, size=PROMPT)} for u in PLAN]


@dataclasses.dataclass
class Served:
    tokens: list = dataclasses.field(default_factory=list)
    rows: list = dataclasses.field(default_factory=list)
    chunks: list = dataclasses.field(default_factory=list)  # (tick, SpeechChunk)
    ticks: list = dataclasses.field(default_factory=list)  # ticks that decoded answer tokens

    @property
    def pcm(self):
        return np.concatenate([c.pcm for _, c in self.chunks])

    @property
    def codes(self):
        return np.concatenate([c.codes[0] for _, c in self.chunks])


def _continue():
    """A continuation chunk: no input, the answer goes on (as the worker's)."""
    return dataclasses.replace(text_chunk(np.zeros(1, np.int64), unit=1), valid=np.zeros((1, 1), bool),
                               advance=np.zeros(1, np.int32))


def _serve(model, plan, per_token=False) -> dict[str, Served]:
    """The sessions of `plan` on one engine, each opened at its tick with its utterance (`open(writing=True)`);
    after every tick each session's tokens and rows go to its utterance, the last with `end=True`."""
    engine = Engine(model, ENGINE)
    pool = engine.speech
    out = {u["sid"]: Served() for u in plan}
    tick = 0
    while tick <= max(u["at"] for u in plan) or engine.sessions or pool.sessions:
        for u in (u for u in plan if u["at"] == tick):
            engine.open(u["sid"])
            engine.submit(u["sid"], text_chunk(u["prompt"], unit=0), TAU)
            prepared = pool.prepare(u["prompt"], [], voice=u["voice"], writing=True)
            pool.open(u["sid"], u["prompt"], [], voice=u["voice"], max_new_tokens=u["max_new_tokens"],
                      writing=True, prepared=prepared)
            assert not pool.has_work or any(p["at"] < tick for p in plan)  # nothing to do before the first row
        report = engine.tick(per_token=per_token)
        for c in report.speech:
            out[c.speech_id].chunks.append((tick, c))
        for sid, o in report.outputs.items():
            s = out[sid]
            s.tokens += o.tokens
            s.rows.append(o.answer_rows)
            s.ticks.append(tick)
            done = len(s.tokens) >= ANSWER
            if sid in pool.sessions:  # (a talker that ended needs no more text)
                pool.extend(sid, o.tokens, rows=o.answer_rows, end=done)
            if done:
                engine.close(sid)
            else:
                engine.submit(sid, _continue(), min(TAU, ANSWER - len(s.tokens)))
        tick += 1
        assert tick < 60, "the schedule did not finish"
    assert pool.reserved == 0 and int(pool.kv.num_free) == SPEECH.num_pages
    for s in out.values():
        s.rows = np.concatenate(s.rows)
    return out


@pytest.fixture(scope="module")
def together(model):
    return _serve(model, _plan())


@pytest.fixture(scope="module")
def oracle(model, together):
    """Each answer spoken by `AnswerSpeech` from the engine's tokens and rows, after the answer ended:
    `(talker tokens, PCM chunks)`."""
    out = {}
    for u in _plan():
        s = together[u["sid"]]
        after = model.speech.tapped_answer_stream(model, u["prompt"], voice=u["voice"],
                                                  max_new_tokens=u["max_new_tokens"], first_chunk=SPEECH.first_chunk,
                                                  chunk=SPEECH.chunk)
        chunks = list(after.finish(s.tokens, s.rows))
        out[u["sid"]] = np.asarray(after.talker_tokens), chunks
    return out


def test_early_speech_equals_answer_speech_and_the_default_path(model, together, oracle):
    placeholders = set(model.speech.placeholders.values()) | {model.speech.im_end_token_id}
    read = []
    for u in _plan():
        s, (tokens, want) = together[u["sid"]], oracle[u["sid"]]
        assert len(s.tokens) == ANSWER and not placeholders & set(s.tokens)
        assert s.rows.shape == (ANSWER, model.config.hidden_size) and np.abs(s.rows).max(axis=-1).min() > 0
        assert len(s.ticks) == ANSWER // TAU and PROMPT < 64 < PROMPT + ANSWER
        assert s.chunks[-1][1].final and not any(c.final for _, c in s.chunks[:-1])
        np.testing.assert_array_equal(s.codes, tokens[:-1], err_msg=u["sid"])
        assert [c.pcm.size for _, c in s.chunks if c.pcm.size] == [w.size for w in want if w.size]
        ref = np.concatenate(want)
        assert np.abs(ref).max() > 0.05, "the reference is (near) silent: the test would prove nothing"
        np.testing.assert_array_equal(s.pcm, ref, err_msg=u["sid"])
        read.append(len(tokens) - 1 > ANSWER)  # the talker's steps read every answer row, then text_eos / pad
        # the default path: one thinker forward over prompt and answer (transformers' rows), its speech the same
        whole = list(model.speech.speak_chunks(model, u["prompt"], s.tokens, voice=u["voice"],
                                               max_new_tokens=u["max_new_tokens"], first_chunk=SPEECH.first_chunk,
                                               chunk=SPEECH.chunk))
        np.testing.assert_array_equal(np.concatenate(whole), s.pcm, err_msg=u["sid"])
    assert any(read), "no talker read the whole answer: the test would not cover the waiting rows"


def test_the_first_audio_comes_before_the_answer_ends(together):
    for sid, s in together.items():
        first = next(tick for tick, c in s.chunks if c.pcm.size)
        assert first < s.ticks[-1], (sid, first, s.ticks)  # sent in a tick before the one decoding the last token


def test_two_sessions_equal_each_one_alone_and_host_driven_ticks_the_fused_ones(model, together):
    """Each session alone from tick 0: "a" on host-driven ticks (`token_step` with the tap), "b" on fused ones;
    both equal the two together (fused): answer, rows, codes and PCM."""
    for u, per_token in zip(_plan(), (True, False)):
        alone = _serve(model, [{**u, "at": 0}], per_token=per_token)[u["sid"]]
        s = together[u["sid"]]
        assert alone.tokens == s.tokens, u["sid"]
        np.testing.assert_array_equal(alone.rows, s.rows, err_msg=u["sid"])
        np.testing.assert_array_equal(alone.codes, s.codes, err_msg=u["sid"])
        np.testing.assert_array_equal(alone.pcm, s.pcm, err_msg=u["sid"])


def test_the_rows_are_the_thinkers_last_layer(model, together):
    u = _plan()[0]
    s = together[u["sid"]]
    _, hidden = TF.thinker_rows(model.decoder, np.concatenate([u["prompt"], s.tokens]))
    err = float(np.abs(s.rows - np.asarray(hidden)[PROMPT:]).max())
    print(f"tapped rows vs thinker_rows: max abs {err:.2e} (rows' max {np.abs(s.rows).max():.2f})")
    assert err <= ROWS_TOL
    head = np.asarray(model.decoder.head_weight(), np.float32)  # row i is the one token i + 1 was chosen from
    logits = s.rows @ (head.T if model.config.tie_embeddings else head)
    np.testing.assert_array_equal(np.argmax(logits[:-1], axis=-1), s.tokens[1:])


# the engine's programs as they were before the tap existed (their bodies, unchanged), the oracle of the flag's off
# state; named as theirs so that the lowered modules' names agree
def engine_step(graphdef, params, state, chunk, *, config, answer=True):
    model = nnx.merge(graphdef, params)
    state, out = chunk_step(model, state, chunk, config, answer=answer)
    table_full = jnp.all(state.kv.page_table >= 0, axis=1)
    kv = migration.drop_empty_entries(state.kv)
    logprobs = None if out.logprobs is None else (out.logprobs, out.top_ids, out.top_logprobs)
    outputs = (out.logits, out.tokens, kv.exhausted, kv.dropped, kv.num_free, table_full, logprobs)
    return dataclasses.replace(state, kv=kv), outputs


def token_step(graphdef, params, state, history, i, active, unit, sampling, mask, *, config):
    model = nnx.merge(graphdef, params)
    if sampling is None and getattr(config.decoding, "per_row", False):
        sampling = config.decoding.rows(active.shape[0])
    track = getattr(config.policy, "needs_scores", False)
    kv, next_pos, key, logits, token, counts, seen, lps = decode_token(
        model, state.kv, state.next_pos, state.key, state.last_logits, active, i, history, unit, config, track,
        sampling, state.counts, state.seen, mask)
    state = StreamState(kv=kv, next_pos=next_pos, key=key, last_logits=logits, counts=counts, seen=seen)
    return state, (token, lps, kv.exhausted, kv.dropped, kv.num_free)


def test_without_the_flag_the_programs_are_the_ones_before_it(model):
    decoder = model.decoder
    graphdef, params = nnx.split(decoder)
    config = omnijax.StreamConfig(num_pages=4, page_size=16, max_answer_tokens=3)
    state = omnijax.init_state(decoder.config, num_pages=4, page_size=16)
    chunk = jax.tree.map(jnp.asarray, text_chunk(list(range(5)), answer_tokens=2))
    for answer in (True, False):
        twin = jax.jit(engine_step, static_argnames=("graphdef", "config", "answer"), donate_argnames=("state",))
        want = twin.lower(graphdef, params, state, chunk, config=config, answer=answer).as_text()
        assert decode_loop.engine_step.lower(graphdef, params, state, chunk, config=config,
                                             answer=answer).as_text() == want
    history, active = np.full((1, 3), -1, np.int32), np.ones((1,), bool)
    args = (graphdef, params, state, history, np.int32(0), active, jnp.zeros((1,), jnp.int32), None, None)
    twin = jax.jit(token_step, static_argnames=("graphdef", "config"), donate_argnames=("state",))
    want = twin.lower(*args, config=config).as_text()
    assert decode_loop.token_step.lower(*args, config=config).as_text() == want
    # (with the flag, the same programs return the rows: the served runs above, fused and host-driven)


def _state(pool):
    return pool.sessions, pool.reserved, dict(pool.stats)


def test_what_early_speech_cannot_take_is_refused_by_name(model):
    u = _plan()[0]
    prompt, width = u["prompt"], model.config.hidden_size
    plain = Qwen25SpeechPool(model, dataclasses.replace(SPEECH, early_start=False))
    with pytest.raises(ValueError, match=r"SpeechConfig\(early_start=True\)"):
        plain.open("x", prompt, [], voice="Ethan", max_new_tokens=8, writing=True)
    with pytest.raises(ValueError, match=r"SpeechConfig\(early_start=True\)"):
        plain.prepare(prompt, [], voice="Ethan", writing=True)
    assert not plain.reads_rows and not plain.sessions
    recalling = dataclasses.replace(ENGINE, stream=dataclasses.replace(ENGINE.stream, recall=Recall(budget=64)))
    with pytest.raises(ValueError, match=r"--speak-early.* not supported with StreamConfig\(recall=...\) \(`--rec"):
        Engine(model, recalling)
    pool = Qwen25SpeechPool(model, SPEECH)
    assert pool.reads_rows
    with pytest.raises(ValueError, match="greedy .*sampling must be None .*written"):
        pool.open("x", prompt, [], voice="Ethan", max_new_tokens=8, writing=True, sampling=object())
    with pytest.raises(ValueError, match="takes the prompt alone"):
        pool.prepare(prompt, [5], voice="Ethan", writing=True)
    whole = pool.prepare(prompt, [5, 6], voice="Ethan")
    with pytest.raises(ValueError, match="not for writing=True"):
        pool.open("x", prompt, [], voice="Ethan", max_new_tokens=8, writing=True, prepared=whole)
    with pytest.raises(ValueError, match=rf"rows must be \[2, {width}\]"):
        pool.open("x", prompt, [5, 6], voice="Ethan", max_new_tokens=8, writing=True, rows=np.zeros((1, width)))
    assert not pool.sessions and pool.reserved == 0
    pool.open("w", prompt, [], voice="Ethan", max_new_tokens=8, writing=True)
    assert not pool.has_work  # waits for its first answer row
    before = _state(pool)
    with pytest.raises(ValueError, match=rf"rows must be \[1, {width}\]"):
        pool.extend("w", [5], rows=None)
    placeholder = next(iter(model.speech.placeholders.values()))
    with pytest.raises(ValueError, match="placeholder"):
        pool.extend("w", [placeholder], rows=np.zeros((1, width), np.float32))
    with pytest.raises(KeyError, match="unknown speech"):
        pool.extend("nobody", [5], rows=np.zeros((1, width), np.float32))
    assert _state(pool) == before and not pool.has_work
    pool.extend("w", [5, 6], rows=np.ones((2, width), np.float32), end=True)
    assert pool.has_work
    with pytest.raises(ValueError, match="whole already"):
        pool.extend("w", [7], rows=np.zeros((1, width), np.float32))
    pool.close("w")
    assert not pool.sessions and pool.reserved == 0
    # an answer that ended without a token: nothing to speak, its stream ends with one empty final chunk
    pool.open("e", prompt, [], voice="Ethan", max_new_tokens=8, writing=True)
    pool.extend("e", [], end=True)
    assert pool.has_work
    assert [(c.speech_id, c.final, c.pcm.size) for c in pool.tick()] == [("e", True, 0)]
    assert not pool.sessions and pool.reserved == 0
