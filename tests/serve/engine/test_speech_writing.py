"""The speech pool speaking an answer while the thinker still writes it, and drawing its speech (issue 39): on the
tiny converted Qwen3-Omni release of tests/serve/engine/test_speech_ticks.py.

- An utterance opened with its answer's first token (`open(writing=True)`) and given the rest in pieces between
  ticks (`extend`, then `extend(end=True)`) steps only as far as its tokens allow (step t reads answer token t + 1),
  and its talker tokens, codes and PCM equal the whole answer spoken alone (`speak_streamed`): PCM within 1e-5 of
  the peak.
- `TalkerSampling` on the pool: a drawn utterance beside a greedy one and a drawn one of another setting (three
  calls' worth of rows in each tick) speaks the tokens, codes and PCM of `speak(..., sampling=...)` alone; another
  seed draws other speech; the greedy row is unchanged.
- Refused by name, nothing changed: extending an answer that is whole, a writing answer without tokens or ending in
  `<|im_end|>`, a sampling that is not a `TalkerSampling`.
"""

import dataclasses

import numpy as np
import pytest

from omnijax.models.qwen3_omni import speech as S
from omnijax.models.qwen3_omni.talker_decode import TalkerSampling
from omnijax.serve.engine.speech import SpeechConfig, SpeechPool

pytest.importorskip("torch", reason="torch (the test extra) builds the transformers release")
pytest.importorskip("transformers", reason="transformers (the test extra) builds the release")

from tests.serve.engine import test_speech_ticks as ticks  # noqa: E402

IM_END, prompt_ids, model = ticks.IM_END, ticks.prompt_ids, ticks.model  # `model`: the module's fixture

# test_speech_ticks's pool settings: the same compiled pool programs (row buckets 2 and 4, 40 pages of 16)
FIRST, CHUNK, SPEECH = ticks.FIRST, ticks.CHUNK, ticks.SPEECH


def _run(pool, ids, feed=None):
    """Ticks until every utterance in `ids` left the pool; `feed(tick)` runs before each tick. Returns each
    utterance's chunks and the talker tokens it had after each tick."""
    chunks = {s: [] for s in ids}
    seen = {s: [] for s in ids}
    tick = 0
    while any(s in pool.sessions for s in ids):
        if feed is not None:
            feed(tick)
        for c in pool.tick():
            chunks[c.speech_id].append(c)
        for s in ids:
            if s in pool.sessions:
                seen[s].append(len(pool.talker_tokens(s)))
        tick += 1
        assert tick < 200, "the pool never finished"
    return chunks, seen


def _close(chunks, whole):
    pcm = np.concatenate([c.pcm for c in chunks])
    want = np.concatenate(list(whole))
    assert pcm.shape == want.shape
    peak = float(np.abs(want).max())
    assert peak > 0.01
    return float(np.abs(pcm - want).max()) / peak


def test_an_answer_spoken_while_written_equals_it_spoken_whole(model):
    rng = np.random.default_rng(5)
    prompt, answer = prompt_ids(rng), [int(t) for t in rng.integers(10, 200, size=9)]
    pool = SpeechPool(model, SPEECH)
    kw = dict(speaker="Ethan", max_new_tokens=14)
    pool.open("w", prompt, answer[:1], voice="Ethan", max_new_tokens=14, writing=True)
    pieces = {0: answer[1:3], 3: answer[3:4], 4: [], 7: answer[4:8], 11: answer[8:]}
    work = []

    def feed(tick):
        work.append(pool.has_work)  # before the piece: False while the talker waits and no chunk is due
        if tick in pieces:
            pool.extend("w", pieces[tick], end=tick == 11)
    chunks, seen = _run(pool, ["w"], feed)
    # talker tokens after each tick: the prefill's and step 0's first, then one a tick while answer token t + 1 is
    # written (step t reads it), waiting at ticks 2 and 4-6 for the next piece
    assert seen["w"][:12] == [2, 3, 3, 4, 4, 4, 4, 5, 6, 7, 8, 9], seen["w"]
    # work before each tick: the prefill, step 1, then waiting (no chunk due: the first went out in tick 3)
    assert work[:9] == [True, True, False, False, False, False, False, False, True], work
    utterance = S.speak(model, prompt, np.asarray(answer), **kw)
    whole = S.speak_streamed(model, prompt, np.asarray(answer), first_chunk=FIRST, chunk=CHUNK, **kw)
    assert np.array_equal(np.concatenate([c.codes for c in chunks["w"]], axis=1), utterance.codes)
    assert _close(chunks["w"], whole) < 1e-5
    assert not pool.sessions and pool.reserved == 0


def test_several_steps_a_tick_catch_up_with_the_text(model):
    """`SpeechConfig.steps_per_tick` 3: a tick runs up to 3 batched steps, each as far as the text allows; the speech
    is the same."""
    rng = np.random.default_rng(6)
    prompt, answer = prompt_ids(rng), [int(t) for t in rng.integers(10, 200, size=9)]
    pool = SpeechPool(model, dataclasses.replace(SPEECH, steps_per_tick=3))
    pool.open("w", prompt, answer[:1], voice="Ethan", max_new_tokens=14, writing=True)
    pieces = {0: (answer[1:5], False), 2: (answer[5:], True)}

    def feed(tick):
        if tick in pieces:
            pool.extend("w", pieces[tick][0], end=pieces[tick][1])
    chunks, seen = _run(pool, ["w"], feed)
    assert seen["w"][:4] == [4, 5, 8, 11], seen["w"]  # 3 steps, 1 (waiting for token 5), 3, 3
    kw = dict(speaker="Ethan", max_new_tokens=14)
    utterance = S.speak(model, prompt, np.asarray(answer), **kw)
    assert np.array_equal(np.concatenate([c.codes for c in chunks["w"]], axis=1), utterance.codes)
    whole = S.speak_streamed(model, prompt, np.asarray(answer), first_chunk=FIRST, chunk=CHUNK, **kw)
    assert _close(chunks["w"], whole) < 1e-5
    with pytest.raises(ValueError, match="steps_per_tick"):
        SpeechConfig(steps_per_tick=0)


def test_sampled_speech_on_the_pool_is_the_seeded_speech_alone(model):
    rng = np.random.default_rng(8)
    plan = [("g", None), ("a", TalkerSampling(seed=3)), ("b", TalkerSampling(seed=3, temperature=0.7, top_k=20)),
            ("c", TalkerSampling(seed=4))]
    args = {s: (prompt_ids(rng), rng.integers(10, 200, size=4)) for s, _ in plan}
    pool = SpeechPool(model, SPEECH)
    for s, sampling in plan:
        pool.open(s, *args[s], voice="chelsie", max_new_tokens=10, sampling=sampling)
    chunks, _ = _run(pool, [s for s, _ in plan])
    codes = {}
    for s, sampling in plan:
        kw = dict(speaker="chelsie", max_new_tokens=10, sampling=sampling)
        utterance = S.speak(model, *args[s], **kw)
        codes[s] = np.concatenate([c.codes for c in chunks[s]], axis=1)
        assert np.array_equal(codes[s], utterance.codes), s
        whole = S.speak_streamed(model, *args[s], first_chunk=FIRST, chunk=CHUNK, **kw)
        assert _close(chunks[s], whole) < 1e-5, s
    greedy = S.speak(model, *args["a"], speaker="chelsie", max_new_tokens=10)
    assert not np.array_equal(codes["a"], greedy.codes), "the draw spoke the greedy speech"
    other = S.speak(model, *args["a"], speaker="chelsie", max_new_tokens=10, sampling=TalkerSampling(seed=4))
    assert not np.array_equal(codes["a"], other.codes), "another seed drew the same speech"


def test_what_an_open_answer_cannot_take_is_refused_by_name(model):
    rng = np.random.default_rng(2)
    prompt = prompt_ids(rng)
    pool = SpeechPool(model, SPEECH)
    with pytest.raises(ValueError, match="first token at least"):
        pool.open("x", prompt, [], voice="Ethan", max_new_tokens=4, writing=True)
    with pytest.raises(ValueError, match="im_end"):
        pool.open("x", prompt, [11, IM_END], voice="Ethan", max_new_tokens=4, writing=True)
    with pytest.raises(ValueError, match="TalkerSampling"):
        pool.open("x", prompt, [11], voice="Ethan", max_new_tokens=4, sampling={"seed": 1})
    assert not pool.sessions and pool.reserved == 0
    pool.open("whole", prompt, [11, 12], voice="Ethan", max_new_tokens=4)
    with pytest.raises(ValueError, match="whole already"):
        pool.extend("whole", [13])
    with pytest.raises(KeyError, match="unknown speech"):
        pool.extend("nobody", [13])
    pool.open("w", prompt, [11], voice="Ethan", max_new_tokens=4, writing=True)
    pool.extend("w", [12], end=True)
    with pytest.raises(ValueError, match="whole already"):
        pool.extend("w", [13])
