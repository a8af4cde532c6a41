"""Qwen2.5-Omni's speech pool (`omnijax.serve.engine.speech_qwen25.Qwen25SpeechPool`, issue 39 item 4) with several
sessions, on the seeded tiny Qwen2.5-Omni release the server's speech tests serve (`tests/_support/qwen25_speech`):

- a seeded schedule of 3 utterances of different answer and speech lengths, admitted on different ticks, the
  talker batched over the rows speaking: each utterance's codes equal the tokens of `speak()`'s talker alone
  (`talker_forward.generate_greedy`, equal to transformers' talker in tests/models/qwen2_5_omni/test_speech.py), its
  chunk sizes and PCM (bit for bit) those of `speech.speak_chunks` alone (the single-session path `Chat` runs,
  Token2Wav streamed with the same chunks and look-ahead);
- with a clock that moves 10 s a tick, every chunk after an utterance's first misses its playback deadline: each is
  sent all the same, flagged `late_s` > 0 and counted in `stats["late_chunks"]`, the PCM whole;
- admission counts talker pages: an utterance needing more pages than are free is refused (`Overloaded`, naming
  the pages), and so is one past the rows, the pool unchanged by a refusal; closing returns the pages.

The pool's settings are the ones `omnijax serve` builds for the served release in tests/serve/test_speech_written.py
(`speech_config_for`: rows 1, 2, 4, 8; 34 pages of 64), so its compiled talker programs are shared; its Token2Wav
chunks are test_speech.py's (4 then 5 codec tokens).
"""

import dataclasses
import warnings

import numpy as np
import pytest

import omnijax
from omnijax.models.qwen2_5_omni import speech as S
from omnijax.models.qwen2_5_omni import talker_forward
from omnijax.serve.engine.admission import Overloaded
from omnijax.serve.engine.speech_qwen25 import REPETITION_PENALTY, Qwen25SpeechPool
from omnijax.serve.speech_engine import speech_config_for
from tests._support.qwen25_release_cache import kept_release25
from tests._support.step_clock import StepClock

IM_START, IM_END, NL = 298, 299, 198
SEED = 4  # its talkers end at 12 tokens (the limit), 17 (stop id 60) and 24 (the limit): three lengths, both ends


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = kept_release25(tmp_path_factory.mktemp("pool25"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no tokenizer files: token ids in, token ids out
        return omnijax.load(out)


@pytest.fixture(scope="module")
def config(model):
    """The served release's pool (test_speech_written: a 64 x 16 stream, 20 speech tokens) with Token2Wav chunks of
    4 then 5 codec tokens (2 then 3 DiT blocks: tests/models/qwen2_5_omni/test_speech.py's), so that a 24-token
    utterance sends two chunks."""
    served = speech_config_for(model, max_speech_tokens=20, context_tokens=64 * 16)
    return dataclasses.replace(served, first_chunk=4, chunk=5)


def prompt_ids(rng):
    """A user turn of 4 random words and the assistant's opening (one length: one talker prefill shape)."""
    return np.asarray([IM_START, 10, NL, *rng.integers(20, 200, size=4), IM_END, NL, IM_START, 14, NL])


def utterances(seed):
    """3 utterances: answers of 3, 5 and 8 tokens, 12, 18 and 24 speech tokens at most, opened at ticks 0, 1, 3."""
    rng = np.random.default_rng(seed)
    return [dict(speech_id=f"u{i}", prompt_ids=prompt_ids(rng), answer_ids=rng.integers(20, 200, size=n),
                 voice=("Chelsie", "ethan")[i % 2], max_new_tokens=m, at=at)
            for i, (n, m, at) in enumerate(((3, 12, 0), (5, 18, 1), (8, 24, 3)))]


@pytest.fixture(scope="module")
def alone(model, config):
    """Each utterance of `utterances(SEED)` spoken alone: `(talker tokens, PCM chunks)`, the tokens those of
    `speak()`'s talker (`talker_forward.generate_greedy` over the same talker input), the chunks `speak_chunks'` with
    the pool's chunk sizes and the speech output's look-ahead."""
    speech, out = model.speech, {}
    talker = speech.talker.config
    for u in utterances(SEED):
        made = S.talker_input(model, u["prompt_ids"], u["answer_ids"], speech.voice(u["voice"]))
        tokens = talker_forward.generate_greedy(
            talker, speech.params, made.rows, made.positions, made.trailing, made.text_pad,
            prompt_ids=made.prompt_ids, max_new_tokens=u["max_new_tokens"], repetition_penalty=REPETITION_PENALTY,
            suppress=[talker.codec_bos_id])
        chunks = list(speech.speak_chunks(model, u["prompt_ids"], u["answer_ids"], voice=u["voice"],
                                          max_new_tokens=u["max_new_tokens"], first_chunk=config.first_chunk,
                                          chunk=config.chunk))
        assert sum(c.size for c in chunks) == (tokens.size - 1) * speech.token2wav.config.samples_per_token
        out[u["speech_id"]] = tokens, chunks
    return out


def _open(pool, u, **changes):
    u = {**u, **changes}
    return pool.open(u["speech_id"], u["prompt_ids"], u["answer_ids"], voice=u["voice"],
                     max_new_tokens=u["max_new_tokens"])


def _state(pool):
    return pool.sessions, pool.reserved, pool.free_pages, int(pool.kv.num_free), dict(pool.stats)


@pytest.mark.parametrize("tick_s", [0.0, 10.0])
def test_a_seeded_schedule_speaks_as_each_utterance_alone(model, config, alone, tick_s):
    """tick_s 0: no chunk is late. tick_s 10: every tick takes 10 s, so each chunk after an utterance's first leaves
    past its playback deadline: sent all the same, flagged and counted, never dropped. Either way each utterance's
    talker tokens, chunk sizes and PCM equal its lone run."""
    clock = StepClock(1e-6)
    pool = Qwen25SpeechPool(model, config, clock=clock)
    plan = utterances(SEED)
    got, tick, rows = {u["speech_id"]: [] for u in plan}, 0, []
    waiting = list(plan)
    while waiting or pool.busy:
        for u in [u for u in waiting if u["at"] <= tick]:
            assert _open(pool, u) == 1  # prompt + speech tokens: one page of 64
            waiting.remove(u)
        for c in pool.tick():
            got[c.speech_id].append(c)
        rows.append(pool.kv.batch)
        clock.now += tick_s
        tick += 1
        assert tick < 60, "the schedule did not finish"
    assert 2 in rows and 4 in rows, rows  # the talker batched over 2, then 3 rows (bucket 4)
    assert pool.reserved == 0 and pool.free_pages == config.num_pages and not pool.sessions
    assert int(pool.kv.num_free) == config.num_pages
    lengths = set()
    for u in plan:
        mine, (tokens, want) = got[u["speech_id"]], alone[u["speech_id"]]
        assert mine[-1].final and not any(c.final for c in mine[:-1])
        # every talker token but the last (a stop id, or the one the limit cut) is a code, named by a chunk once
        np.testing.assert_array_equal(np.concatenate([c.codes[0] for c in mine]), tokens[:-1], err_msg=u["speech_id"])
        assert [c.start_frame for c in mine] == list(np.cumsum([0] + [c.codes.shape[1] for c in mine[:-1]]))
        assert [c.pcm.size for c in mine if c.pcm.size] == [w.size for w in want], u["speech_id"]
        pcm, ref = np.concatenate([c.pcm for c in mine]), np.concatenate(want)
        assert np.abs(ref).max() > 0.05, "the lone run is (near) silent: the test would prove nothing"
        np.testing.assert_array_equal(pcm, ref, err_msg=u["speech_id"])
        lengths.add(pcm.size)
        if tick_s:
            assert mine[0].late_s == 0 and mine[0].first_pcm_s is not None
            assert all(c.late_s > 0 for c in mine[1:]), [c.late_s for c in mine]
    assert len(lengths) == 3
    stops = model.speech.talker.config.stop_ids
    assert {int(tokens[-1]) in stops for tokens, _ in alone.values()} == {True, False}  # a stop id and the limit
    chunks = sum(len(cs) for cs in got.values())
    late = chunks - len(plan) if tick_s else 0
    assert pool.stats["late_chunks"] == late and pool.stats["chunks"] == chunks and (late > 0) == bool(tick_s)


def test_admission_refuses_what_the_pages_cannot_hold(model):
    """A pool of 5 pages of 16, 4 a row: utterances reserve their prompt plus speech tokens up front; one past the
    free pages, or past the rows, is refused naming the numbers and changes nothing; closing returns the pages."""
    from omnijax.serve.engine.speech import SpeechConfig

    pool = Qwen25SpeechPool(model, SpeechConfig(rows=(1, 2), num_pages=5, page_size=16, max_pages=4))
    u = utterances(SEED)[0]
    empty = _state(pool)
    with pytest.raises(ValueError, match=r"needs 5 talker pages .* a row holds 4"):
        _open(pool, u, max_new_tokens=60)
    assert _state(pool) == empty
    T = pool.prepare(u["prompt_ids"], u["answer_ids"], voice=u["voice"]).talker.rows.shape[0]
    assert T == len(u["prompt_ids"]) + 2 == 14
    assert _open(pool, u, max_new_tokens=40) == pool.pages_needed(T, 40) == 4
    before = _state(pool)
    with pytest.raises(Overloaded, match="needs 2 talker pages and 1 of 5 are free") as e:
        _open(pool, u, speech_id="v", max_new_tokens=10)
    assert (e.value.cap, e.value.current) == (2, 1)
    after = _state(pool)
    assert after[:4] == before[:4] and after[4] == {**before[4], "refused": before[4]["refused"] + 1}
    assert _open(pool, u, speech_id="v", max_new_tokens=1) == 1  # what fits still goes in
    with pytest.raises(Overloaded, match="2 sessions are speaking, the speech pool holds at most 2"):
        _open(pool, u, speech_id="w", max_new_tokens=1)
    assert pool.sessions == ["u0", "v"] and pool.reserved == 5
    pool.close("u0")
    assert pool.free_pages == 4 and _open(pool, u, speech_id="w", max_new_tokens=10) == 2
    for s in ("v", "w"):
        pool.close(s)
    assert _state(pool)[:4] == empty[:4] and pool.stats["refused"] == 2
