"""The server's warm-up of the engine's speech pool (`speech_engine.warm_up_pool`, called by `app.warm_up`): after it,
a first spoken utterance of one session compiles nothing (the pool's prefill, talker step and vocoder programs
already hold its shapes), the pool is left empty with its pages free and its statistics as they were, and a pool
that is speaking is refused by name.

The release, the engine and the pool settings are `test_speech_ticks`'s, so the programs compile once per suite (the
persistent cache holds them); each module starts with empty in-memory caches (tests/conftest.py), so the warm-up is
still seen adding the vocoder programs to this process and the utterance after it is seen adding nothing.
"""

import numpy as np
import pytest

import omnijax
from omnijax.models.qwen3_omni import code2wav_rows
from omnijax.serve.engine import speech_steps
from omnijax.serve.engine.engine import Engine, EngineConfig
from omnijax.serve.speech_engine import warm_up_pool

pytest.importorskip("torch", reason="torch (the test extra) builds the transformers release")
from tests.serve.engine import test_speech_ticks as ticks  # noqa: E402  (needs torch)

model = ticks.model  # the module's converted tiny Qwen3-Omni release (a fixture)
FIRST, CHUNK = ticks.FIRST, ticks.CHUNK


def _compiled():
    return (speech_steps.prefill._cache_size(), speech_steps.step._cache_size(), code2wav_rows._rows._cache_size())


def test_a_warmed_pool_speaks_a_first_utterance_without_compiling(model):
    # test_speech_ticks's engine and pool settings: the programs the warm-up compiles are that module's
    stream = omnijax.StreamConfig(num_pages=32, page_size=16, max_answer_tokens=2)
    speech = ticks.SPEECH
    engine = Engine(model, EngineConfig(stream=stream, chunk_tokens=8, buckets=(2,), speech=speech))
    pool = engine.speech
    stats = dict(pool.stats)
    before = _compiled()
    assert warm_up_pool(engine, prompt_tokens=(16,)) == [16]
    warmed = _compiled()
    assert warmed[2] > before[2], "the warm-up compiled no vocoder call: the check below would prove nothing"
    assert pool.sessions == [] and pool.free_pages == speech.num_pages and pool.stats == stats

    # a first real utterance: a system turn and a 7-id user turn (a 16-row talker prompt), a first chunk, full
    # chunks and a short last one
    T = ticks.TTS
    prompt = np.asarray([ticks.IM_START, T["system_token_id"], ticks.NL, 10, ticks.IM_END, ticks.NL, ticks.IM_START,
                         T["user_token_id"], ticks.NL, 23, 45, ticks.IM_END, ticks.NL, ticks.IM_START,
                         T["assistant_token_id"], ticks.NL])
    frames = FIRST + 2 * CHUNK + 3
    pool.open("first", prompt, [31, 41, 59, 26], voice="Ethan", max_new_tokens=frames + 1)
    chunks = []
    while pool.busy:
        chunks += [c.pcm.size for c in pool.tick()]
    assert len(chunks) == 4 and _compiled() == warmed
    assert pool.stats["opened"] == stats["opened"] + 1

    with pytest.raises(ValueError, match="the speech pool is speaking"):
        pool.open("again", prompt, [10, 11], voice="Ethan", max_new_tokens=3)
        warm_up_pool(engine)
