"""A bounded talker KV on Qwen3-Omni, where users reach it: `SpeakOptions(talker_window=...)` and `omnijax chat
--speak --talker-window CELLS` on the converted tiny release of tests/chat/test_chat_speech.py (same stream, chunk
and talker shapes).

The oracle is transformers' own talker (`generate(..., return_audio=True)`, greedy talker and code predictor) with
its decoder's attention mask hiding exactly the cells omnijax's `SinkWindow(sink, window)` trim has dropped
(`tests/_support/talker_mask.py`): the same codes and the same waveform (1e-4 of the peak) as `speak(talker_kv=...)`,
and other codes than the unbounded talker's, so the trim is exercised. Through `Chat` (the talker speaking while the
thinker writes) and the CLI the bounded speech equals `speak(talker_kv=...)` of the turn's ids; on the server's speech
pool (`SpeechConfig(talker_window=...)`) each batched utterance equals its bounded talker alone. A window the talker
cannot run with (0, 1, negative, not an int) is refused by name before anything is fed, read or written.
"""

import dataclasses
import io
import warnings

import numpy as np
import pytest

import omnijax
from omnijax import commands
from omnijax.chat import SpeakOptions
from omnijax.media.audio import pcm16, read_wav
from omnijax.models.qwen3_omni import speech as S
from omnijax.models.talker_kv import talker_policy
from omnijax.retention import SinkWindow
from omnijax.serve.engine.speech import SpeechPool
from tests._support.speech_pool_schedule import run_pool
from tests._support.speech_refs import captured_talker, greedy_answer
from tests._support.step_clock import StepClock
from tests._support.talker_mask import hidden_cells

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")
pytest.importorskip("transformers", reason="transformers (the test extra) is the reference")

from tests.chat import test_chat_speech as CS  # noqa: E402
from tests.models.qwen3_omni import test_speech as TS  # noqa: E402
from tests.models.qwen3_omni import test_talker as T  # noqa: E402
from tests.serve.engine import test_speech_ticks as P3  # noqa: E402

SINK, WINDOW = 4, 5  # 9 cells: the talker's prompt is longer, so its prefill is trimmed and every step after it


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("window3")
    (out,) = CS.spoken_release(root, thinker=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return root, omnijax.load(out)


def test_a_bounded_talker_speaks_as_transformers_with_the_dropped_cells_masked(release):
    _, model = release
    full = T.seeded_full_model()
    with T.greedy_predictor(full.talker.code_predictor), captured_talker(full) as seen, \
            hidden_cells(full.talker.model, SINK, WINDOW) as hid, torch.no_grad():
        sequence, wav = full.generate(
            input_ids=torch.as_tensor(TS.PROMPT)[None], speaker="Ethan", return_audio=True,
            thinker_max_new_tokens=TS.ANSWER_TOKENS, thinker_do_sample=False, thinker_eos_token_id=TS.IM_END,
            talker_max_new_tokens=TS.FRAMES, talker_do_sample=False, talker_repetition_penalty=1.0)
    sequence, wav = sequence[0].numpy(), wav.reshape(-1).numpy()
    want_codes = torch.stack([h[-1] for h in seen[0].hidden_states if h[-1] is not None], dim=1)[0].T.numpy()
    assert len(hid) >= 8 and min(hid) > 0, hid  # every step hid cells: the prompt is past the budget
    answer = greedy_answer(model, TS.PROMPT, TS.ANSWER_TOKENS, TS.IM_END)
    np.testing.assert_array_equal(answer, sequence[len(TS.PROMPT):])
    policy = SinkWindow(sink=SINK, window=WINDOW)
    spoken = S.speak(model, TS.PROMPT, answer[:-1], speaker="Ethan", max_new_tokens=TS.FRAMES, talker_kv=policy)
    np.testing.assert_array_equal(spoken.codes, want_codes)
    np.testing.assert_array_equal(spoken.talker_tokens, seen[0].sequences[0].numpy())
    peak = np.abs(wav).max()
    assert peak > 0.05 and spoken.pcm.shape == wav.shape
    assert np.abs(spoken.pcm - wav).max() <= 1e-4 * peak
    # the unbounded talker decodes other codes: the dropped cells mattered
    free = S.speak(model, TS.PROMPT, answer[:-1], speaker="Ethan", max_new_tokens=TS.FRAMES)
    assert free.codes.shape[1] >= 4 and not np.array_equal(free.codes, spoken.codes)
    # a budget the utterance never reaches trims nothing: the unbounded codes
    roomy = S.speak(model, TS.PROMPT, answer[:-1], speaker="Ethan", max_new_tokens=TS.FRAMES,
                    talker_kv=SinkWindow(sink=SINK, window=200))
    np.testing.assert_array_equal(roomy.codes, free.codes)


def test_chat_and_the_cli_speak_with_a_talker_window(release, tmp_path):
    root, model = release
    out = tmp_path / "spoken.wav"
    args = CS._cli_args(root / "hf_omnijax", "--speak", str(out), "--voice", "chelsie", "--max-speech-tokens",
                        str(CS.SPEECH_TOKENS), "--talker-window", str(WINDOW))
    args.command = "chat"
    printed = io.StringIO()
    assert commands.run_chat(args, io.StringIO(f"{CS.QUESTION}\n"), printed) == 0
    chat = omnijax.Chat(model, commands.stream_config(args))
    options = SpeakOptions(voice="chelsie", max_speech_tokens=CS.SPEECH_TOKENS, talker_window=WINDOW)
    assert options.talker_kv == SinkWindow(sink=SINK, window=WINDOW)
    text, chunks = CS.split(list(chat.ask(CS.QUESTION, max_tokens=6, speak=options)))
    spoken = chat.last_spoken
    assert printed.getvalue().splitlines()[0] == text
    # the talker ran while the answer was written (answer_stream), bounded: the one-shot bounded speech
    want = S.speak(model, np.asarray(spoken.prompt_ids), np.asarray(spoken.answer_ids), speaker="Chelsie",
                   max_new_tokens=CS.SPEECH_TOKENS, talker_kv=talker_policy(WINDOW))
    free = S.speak(model, np.asarray(spoken.prompt_ids), np.asarray(spoken.answer_ids), speaker="Chelsie",
                   max_new_tokens=CS.SPEECH_TOKENS)
    assert not np.array_equal(want.codes, free.codes)
    pcm = np.concatenate(chunks)
    peak = np.abs(want.pcm).max()
    assert peak > 0.05 and pcm.shape == want.pcm.shape
    assert np.abs(pcm - want.pcm).max() <= 1e-5 * peak
    samples, rate = read_wav(out)
    assert rate == 24000
    np.testing.assert_array_equal(np.round(samples * 32768).astype(np.int16), pcm16(pcm))


def test_the_speech_pool_speaks_each_utterance_as_its_bounded_talker_alone(release):
    """test_speech_ticks' pool (rows 2 / 4, pages of 16, vocoder chunks 3 then 4) with `talker_window`: three
    utterances opened on ticks 0, 1, 2, batched: each one's codes those of `speak(talker_kv=...)` alone, its PCM
    within 1e-6 of the peak of its lone streamed chunks; the rows trimmed to the budget; the window's pages
    reserved whatever `max_new_tokens`."""
    _, model = release
    config = dataclasses.replace(P3.SPEECH, talker_window=WINDOW)
    policy = config.talker_kv
    pool = SpeechPool(model, config, clock=StepClock(1e-6))
    plan = [u | dict(at=i) for i, u in enumerate(P3.utterances(3, 3))]
    got, most = run_pool(pool, plan)
    assert most <= policy.budget
    differ = 0
    for u in plan:
        args, kw = (model, u["prompt_ids"], u["answer_ids"]), dict(speaker=u["voice"],
                                                                   max_new_tokens=u["max_new_tokens"])
        ref = S.speak(*args, **kw, talker_kv=policy)
        chunks = list(S.speak_streamed(*args, **kw, first_chunk=P3.FIRST, chunk=P3.CHUNK, talker_kv=policy))
        mine = got[u["speech_id"]]
        np.testing.assert_array_equal(np.concatenate([c.codes for c in mine], axis=1), ref.codes,
                                      err_msg=u["speech_id"])
        assert [c.pcm.size for c in mine if c.pcm.size] == [c.size for c in chunks]
        P3.assert_same_pcm(np.concatenate([c.pcm for c in mine]), np.concatenate(chunks), u["speech_id"])
        differ += not np.array_equal(S.speak(*args, **kw).codes, ref.codes)
    assert differ > 0, "no utterance was long enough for the window to change its codes"
    assert pool.pages_needed(12, 10_000) == 1 and SpeechPool(model, P3.SPEECH).pages_needed(12, 10_000) == 626


@pytest.mark.parametrize("window", [0, 1, -3, True, "8"])
def test_a_window_the_talker_cannot_run_with_is_refused_by_name(release, tmp_path, capsys, window):
    root, model = release
    with pytest.raises(ValueError, match="talker_window"):
        SpeakOptions(talker_window=window)
    with pytest.raises(ValueError, match="talker's KV policy"):
        model.speech.speak_chunks(model, TS.PROMPT, [5, 6], voice="ethan", talker_kv="sink_window")
    with pytest.raises(ValueError, match="MIN_TALKER_WINDOW"):
        S.speak(model, TS.PROMPT, [5, 6], talker_kv=SinkWindow(sink=4, window=1))
    if isinstance(window, int) and not isinstance(window, bool):
        bad = tmp_path / "bad.wav"
        status = commands.main("chat", [str(root / "hf_omnijax"), "--speak", str(bad), "--talker-window",
                                        str(window)])
        assert status == 1 and "--talker-window" in capsys.readouterr().err and not bad.exists()
    status = commands.main("chat", [str(root / "hf_omnijax"), "--talker-window", "8"])
    assert status == 1 and "--talker-window needs --speak" in capsys.readouterr().err
