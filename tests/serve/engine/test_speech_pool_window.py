"""The speech pools' bounded talker KV (`SpeechConfig(talker_window=...)`, `omnijax serve --talker-window`), both
families: several utterances opened on different ticks, the talker batched over the rows speaking, each row trimmed
after its prefill and every step, give each utterance the codes and PCM of the same utterance spoken alone with
`talker_kv=` the same `SinkWindow` (whose tokens equal transformers' talker with the dropped cells masked:
tests/chat/test_talker_window_qwen3.py and test_talker_window_qwen25.py), other codes than the unbounded talker's
for some; every row's live cells stay within the budget; an utterance reserves the window's pages whatever its
`max_new_tokens`. A window the talker cannot run with is refused by name (`SpeechConfig`, `ServeOptions`).

The pools are those of tests/serve/engine/test_speech_ticks.py (Qwen3-Omni) and test_speech_pool_qwen25.py
(Qwen2.5-Omni, the served release's pool), with the window added, so their step programs are shared.
"""

import dataclasses
import warnings

import numpy as np
import pytest

import omnijax
from omnijax.convert import convert_checkpoint
from omnijax.kv import layout
from omnijax.models.qwen2_5_omni import speech as S25
from omnijax.models.qwen3_omni import speech as S3
from omnijax.models.talker_kv import talker_policy
from omnijax.serve import app
from omnijax.serve.context import ServeOptions
from omnijax.serve.engine.speech import SpeechConfig, SpeechPool
from omnijax.serve.engine.speech_qwen25 import Qwen25SpeechPool
from omnijax.serve.speech_engine import speech_config_for

pytest.importorskip("torch", reason="torch (the test extra) builds the transformers releases")
pytest.importorskip("transformers", reason="transformers (the test extra) builds the releases")

from tests._support.qwen25_speech import spoken_release25  # noqa: E402
from tests._support.step_clock import StepClock  # noqa: E402
from tests.models.qwen3_omni import test_talker as T  # noqa: E402
from tests.serve.engine import test_speech_pool_qwen25 as P25  # noqa: E402
from tests.serve.engine import test_speech_ticks as P3  # noqa: E402

WINDOW = 5  # with the 4 sink cells: 9, below the talker prompts (14 rows for Qwen2.5-Omni), so rows are trimmed


def _load(out):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no tokenizer files: token ids in, token ids out
        return omnijax.load(out)


@pytest.fixture(scope="module")
def model3(tmp_path_factory):
    """test_speech_ticks' release: the seeded tiny Qwen3-Omni, converted."""
    root = tmp_path_factory.mktemp("window_pool3")
    T.seeded_full_model().save_pretrained(root / "hf", safe_serialization=True)
    return _load(convert_checkpoint(root / "hf", root / "out", progress=False, log=lambda _: None))


@pytest.fixture(scope="module")
def model25(tmp_path_factory):
    """test_speech_pool_qwen25's release."""
    return _load(spoken_release25(tmp_path_factory.mktemp("window_pool25"), tokenizer=False))


def _run(pool, plan):
    """Opens each utterance at its tick and ticks until the pool empties: `{speech_id: chunks}`, and the most live
    cells any row held after a tick."""
    got, tick, most = {u["speech_id"]: [] for u in plan}, 0, 0
    waiting = list(plan)
    while waiting or pool.busy:
        for u in [u for u in waiting if u["at"] <= tick]:
            pool.open(u["speech_id"], u["prompt_ids"], u["answer_ids"], voice=u["voice"],
                      max_new_tokens=u["max_new_tokens"])
            waiting.remove(u)
        for c in pool.tick():
            got[c.speech_id].append(c)
        most = max(most, int(np.max(np.asarray(layout.layout_stats(pool.kv).retained_cells))))
        tick += 1
        assert tick < 60, "the schedule did not finish"
    assert pool.reserved == 0 and int(pool.kv.num_free) == pool.config.num_pages
    return got, most


def test_the_qwen3_pool_speaks_each_utterance_as_its_bounded_talker_alone(model3):
    config = dataclasses.replace(P3.SPEECH, talker_window=WINDOW)
    policy = config.talker_kv
    pool = SpeechPool(model3, config, clock=StepClock(1e-6))
    plan = [u | dict(at=i) for i, u in enumerate(P3.utterances(3, 3))]
    got, most = _run(pool, plan)
    assert most <= policy.budget
    differ = 0
    for u in plan:
        kw = dict(speaker=u["voice"], max_new_tokens=u["max_new_tokens"])
        args = (model3, u["prompt_ids"], u["answer_ids"])
        ref = S3.speak(*args, **kw, talker_kv=policy)
        chunks = list(S3.speak_streamed(*args, **kw, first_chunk=P3.FIRST, chunk=P3.CHUNK, talker_kv=policy))
        mine = got[u["speech_id"]]
        np.testing.assert_array_equal(np.concatenate([c.codes for c in mine], axis=1), ref.codes,
                                      err_msg=u["speech_id"])
        assert [c.pcm.size for c in mine if c.pcm.size] == [c.size for c in chunks]
        P3.assert_same_pcm(np.concatenate([c.pcm for c in mine]), np.concatenate(chunks), u["speech_id"])
        differ += not np.array_equal(S3.speak(*args, **kw).codes, ref.codes)
    assert differ > 0, "no utterance was long enough for the window to change its codes"
    # an utterance reserves the window's pages (prompt or budget + 1 cells), whatever its speech tokens
    assert pool.pages_needed(12, 10_000) == 1 and SpeechPool(model3, P3.SPEECH).pages_needed(12, 10_000) == 626


def test_the_qwen25_pool_speaks_each_utterance_as_its_bounded_talker_alone(model25):
    # test_speech_pool_qwen25's pool: the served release's (a 64 x 16 stream, 20 speech tokens), chunks 4 then 5
    # (what `omnijax serve --talker-window` builds: speech_config_for(talker_window=...))
    config = dataclasses.replace(speech_config_for(model25, max_speech_tokens=20, context_tokens=64 * 16,
                                                   talker_window=WINDOW), first_chunk=4, chunk=5)
    assert config.talker_window == WINDOW
    policy = config.talker_kv
    pool = Qwen25SpeechPool(model25, config, clock=StepClock(1e-6))
    plan = P25.utterances(P25.SEED)
    got, most = _run(pool, plan)
    assert most <= policy.budget
    differ = 0
    for u in plan:
        kw = dict(speaker=u["voice"], max_new_tokens=u["max_new_tokens"])
        args = (model25, u["prompt_ids"], u["answer_ids"])
        ref = S25.speak_streamed(*args, **kw, talker_kv=policy)
        chunks = list(model25.speech.speak_chunks(*args, voice=u["voice"], max_new_tokens=u["max_new_tokens"],
                                                  first_chunk=config.first_chunk, chunk=config.chunk,
                                                  talker_kv=policy))
        mine = got[u["speech_id"]]
        np.testing.assert_array_equal(np.concatenate([c.codes[0] for c in mine]), ref.talker_tokens[:-1],
                                      err_msg=u["speech_id"])
        np.testing.assert_array_equal(np.concatenate([c.pcm for c in mine]), np.concatenate(chunks))
        differ += not np.array_equal(S25.speak_streamed(*args, **kw).talker_tokens, ref.talker_tokens)
    assert differ > 0, "no utterance was long enough for the window to change its tokens"
    T = pool.prepare(plan[0]["prompt_ids"], plan[0]["answer_ids"], voice="Ethan").talker.rows.shape[0]
    assert pool.open("long", plan[0]["prompt_ids"], plan[0]["answer_ids"], voice="Ethan",
                     max_new_tokens=10_000) == 1 == pool.pages_needed(T, 10_000)
    pool.close("long")


@pytest.mark.parametrize("window", [0, 1, -2])
def test_a_window_the_talker_cannot_run_with_is_refused_by_name(window, tmp_path, capsys):
    with pytest.raises(ValueError, match=rf"SpeechConfig.talker_window {window}: .*at least 2"):
        SpeechConfig(talker_window=window)
    with pytest.raises(ValueError, match=rf"talker_window \(--talker-window\) {window}: .*at least 2"):
        ServeOptions(talker_window=window)
    # `omnijax serve --talker-window`: refused before the checkpoint is read (the directory is empty)
    with pytest.raises(SystemExit) as e:
        app.main([str(tmp_path), "--talker-window", str(window)])
    assert e.value.code == 2 and f"(--talker-window) {window}:" in capsys.readouterr().err
    assert ServeOptions(talker_window=8).talker_window == 8 and talker_policy(8).budget == 12
