"""A bounded talker KV on Qwen2.5-Omni, where users reach it: `SpeakOptions(talker_window=...)` and `omnijax chat
--speak --talker-window CELLS` on the seeded tiny release the CLI and server speech tests build
(`tests/_support/qwen25_speech.py`; the shapes of tests/chat/test_chat_speak_qwen25.py).

The oracle is transformers' own talker (`generate(..., return_audio=True)`, greedy) with its decoder's attention
mask hiding exactly the cells omnijax's `SinkWindow(sink, window)` trim has dropped (`tests/_support/talker_mask.py`):
the same talker tokens and the same waveform (1e-4 of the peak, the DiT's noise drawn from the same torch seed) as
`speak(talker_kv=...)`, other tokens than the unbounded talker's. Through `Chat` and the CLI the bounded speech
equals `speak(talker_kv=...)` of the turn's ids (PCM16 within 1 LSB); on the server's speech pool
(`omnijax serve --talker-window`) each batched utterance equals its bounded talker alone. Bad windows are refused
by name (`SpeakOptions`, the CLI, `SpeechConfig`, `ServeOptions`, `omnijax serve`).
"""

import dataclasses
import io
import sys
import warnings

import numpy as np
import pytest

import omnijax
from omnijax import commands
from omnijax.chat import SpeakOptions
from omnijax.media.audio import pcm16, read_wav
from omnijax.models.qwen2_5_omni import speech as S
from omnijax.models.qwen2_5_omni import talker_forward as TF
from omnijax.models.talker_kv import talker_policy
from omnijax.retention import SinkWindow
from omnijax.serve import app
from omnijax.serve.context import ServeOptions
from omnijax.serve.engine.speech import SpeechConfig
from omnijax.serve.engine.speech_qwen25 import Qwen25SpeechPool
from omnijax.serve.speech_engine import speech_config_for
from tests._support.speech_pool_schedule import run_pool
from tests._support.speech_refs import captured_talker, greedy_answer
from tests._support.talker_mask import hidden_cells

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")
pytest.importorskip("transformers", reason="transformers (the test extra) is the reference")

from tests._support.qwen25_release_cache import kept_release25  # noqa: E402
from tests._support.step_clock import StepClock  # noqa: E402
from tests._support.unpatched_attention import transformers_own_sdpa  # noqa: E402
from tests.chat import test_chat_speak_qwen25 as CQ  # noqa: E402
from tests.models.qwen2_5_omni import test_speech as TS  # noqa: E402
from tests.models.qwen2_5_omni import test_talker as T  # noqa: E402
from tests.serve.engine import test_speech_pool_qwen25 as P25  # noqa: E402

SINK, WINDOW = 4, 6  # 10 cells: the talker's prompt (22 rows) is longer, so every step reads a trimmed cache


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("window25")
    out = kept_release25(root, tokenizer=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return root, omnijax.load(out)


def test_a_bounded_talker_speaks_as_transformers_with_the_dropped_cells_masked(release, monkeypatch):
    transformers_own_sdpa(monkeypatch)  # kvpress, if a test of this worker imported it, breaks the DiT's attention
    root, model = release
    full = T.seeded_full_model()
    full.load_speakers(root / "hf" / "spk_dict.pt")
    torch.manual_seed(TS.SEED)  # the DiT's torch.randn is the first draw after it
    with captured_talker(full) as seen, hidden_cells(full.talker.model, SINK, WINDOW) as hid, torch.no_grad():
        sequence, wav = full.generate(
            input_ids=torch.as_tensor(TS.PROMPT)[None], speaker="Ethan", return_audio=True,
            thinker_max_new_tokens=TS.ANSWER_TOKENS, thinker_do_sample=False, thinker_eos_token_id=TS.IM_END,
            talker_max_new_tokens=TS.FRAMES, talker_do_sample=False, talker_eos_token_id=T.STOP)
    sequence, wav = sequence[0].numpy(), wav.reshape(-1).numpy()
    want_tokens = seen[0][0, len(TS.PROMPT) + 2:].numpy()
    assert len(hid) >= 8 and min(hid) > 0, hid  # every step hid cells: the prompt is past the budget
    answer = greedy_answer(model, TS.PROMPT, TS.ANSWER_TOKENS, TS.IM_END)
    np.testing.assert_array_equal(answer, sequence[len(TS.PROMPT):])
    policy = SinkWindow(sink=SINK, window=WINDOW)
    spoken = S.speak(model, TS.PROMPT, answer[:-1], speaker="Ethan", max_new_tokens=TS.FRAMES,
                     noise=TS._torch_noise, talker_kv=policy)
    np.testing.assert_array_equal(spoken.talker_tokens, want_tokens)
    assert len(want_tokens) >= 6 and len(set(want_tokens.tolist())) > 2, want_tokens
    peak = np.abs(wav).max()
    assert peak > 0.05 and spoken.pcm.shape == wav.shape
    assert np.abs(spoken.pcm - wav).max() <= 1e-4 * peak
    # the unbounded talker decodes other tokens: the dropped cells mattered
    assert not np.array_equal(_tokens(model, TS.PROMPT, answer[:-1], "Ethan", TS.FRAMES), want_tokens)


def _tokens(model, prompt, answer, voice, limit, policy=None):
    """The talker's greedy tokens alone (`speak`'s talker, no Token2Wav)."""
    speech = model.speech
    _, found, checked_prompt, checked_answer = S.checked_request(model, prompt, answer, voice, limit, 1.05)
    made = S.talker_input(model, checked_prompt, checked_answer, found)
    c = speech.talker.config
    return TF.generate_greedy(c, speech.params, made.rows, made.positions, made.trailing, made.text_pad,
                              prompt_ids=made.prompt_ids, max_new_tokens=limit, suppress=[c.codec_bos_id],
                              policy=policy)


def test_chat_and_the_cli_speak_with_a_talker_window(release, tmp_path, capsys, monkeypatch):
    root, model = release
    out = tmp_path / "spoken.wav"
    argv = [str(root / "out"), *CQ.STREAM, "--max-tokens", str(CQ.MAX_TOKENS), "--speak", str(out), "--voice",
            "chelsie", "--max-speech-tokens", str(CQ.SPEECH_TOKENS), "--talker-window", str(WINDOW)]
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{CQ.QUESTIONS[0]}\n"))
    assert commands.main("chat", argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out.splitlines()
    chat = omnijax.Chat(model, commands.stream_config(commands.build_parser("chat").parse_args(argv)))
    options = SpeakOptions(voice="chelsie", max_speech_tokens=CQ.SPEECH_TOKENS, talker_window=WINDOW)
    text = "".join(x for x in chat.ask(CQ.QUESTIONS[0], max_tokens=CQ.MAX_TOKENS, speak=options)
                   if isinstance(x, str))
    assert printed[0] == text
    spoken = chat.last_spoken
    want = S.speak(model, np.asarray(spoken.prompt_ids), np.asarray(spoken.answer_ids), speaker="Chelsie",
                   max_new_tokens=CQ.SPEECH_TOKENS, talker_kv=talker_policy(WINDOW))
    assert want.codes.size >= 6 and np.abs(want.pcm).max() > 0.05
    free = _tokens(model, spoken.prompt_ids, spoken.answer_ids, "Chelsie", CQ.SPEECH_TOKENS)
    assert not np.array_equal(want.talker_tokens, free)
    samples, rate = read_wav(out)
    assert rate == 24000
    got, ref = np.round(samples * 32768).astype(np.int32), pcm16(want.pcm).astype(np.int32)
    assert got.shape == ref.shape and int(np.abs(got - ref).max()) <= 1  # float rounding: within 1 LSB


def test_the_speech_pool_speaks_each_utterance_as_its_bounded_talker_alone(release):
    """`omnijax serve --talker-window`'s pool (`speech_config_for(talker_window=...)`; test_speech_pool_qwen25's
    pool and schedule: 3 utterances opened on ticks 0, 1, 3, batched): each utterance's codes and PCM (bit for bit)
    those of `speak_chunks(talker_kv=...)` alone; the rows trimmed to the budget; a long utterance reserves the
    window's pages."""
    _, model = release
    config = dataclasses.replace(speech_config_for(model, max_speech_tokens=20, context_tokens=64 * 16,
                                                   talker_window=WINDOW), first_chunk=4, chunk=5)
    policy = config.talker_kv
    assert policy == SinkWindow(sink=SINK, window=WINDOW)
    pool = Qwen25SpeechPool(model, config, clock=StepClock(1e-6))
    plan = P25.utterances(P25.SEED)
    got, most = run_pool(pool, plan)
    assert most <= policy.budget
    differ = 0
    for u in plan:
        args, kw = (model, u["prompt_ids"], u["answer_ids"]), dict(max_new_tokens=u["max_new_tokens"])
        tokens = _tokens(*args, u["voice"], u["max_new_tokens"], policy)
        chunks = list(model.speech.speak_chunks(*args, voice=u["voice"], **kw, first_chunk=config.first_chunk,
                                                chunk=config.chunk, talker_kv=policy))
        mine = got[u["speech_id"]]
        np.testing.assert_array_equal(np.concatenate([c.codes[0] for c in mine]), tokens[:-1], err_msg=u["speech_id"])
        np.testing.assert_array_equal(np.concatenate([c.pcm for c in mine]), np.concatenate(chunks))
        differ += not np.array_equal(_tokens(*args, u["voice"], u["max_new_tokens"]), tokens)
    assert differ > 0, "no utterance was long enough for the window to change its tokens"
    T = pool.prepare(plan[0]["prompt_ids"], plan[0]["answer_ids"], voice="Ethan").talker.rows.shape[0]
    assert pool.open("long", plan[0]["prompt_ids"], plan[0]["answer_ids"], voice="Ethan",
                     max_new_tokens=10_000) == 1 == pool.pages_needed(T, 10_000)  # unbounded: 157 pages
    pool.close("long")


@pytest.mark.parametrize("window", [0, 1, -3])
def test_a_window_the_talker_cannot_run_with_is_refused_by_name(release, tmp_path, capsys, monkeypatch, window):
    root, model = release
    with pytest.raises(ValueError, match=f"talker_window {window}: .*at least 2"):
        SpeakOptions(talker_window=window)
    with pytest.raises(ValueError, match="talker's KV policy"):
        model.speech.speak_chunks(model, TS.PROMPT, [5, 6], voice="Ethan", talker_kv="sink_window")
    bad = tmp_path / "bad.wav"
    monkeypatch.setattr(sys, "stdin", io.StringIO("Say hello.\n"))
    status = commands.main("chat", [str(root / "out"), "--speak", str(bad), "--talker-window", str(window)])
    assert status == 1 and f"--talker-window {window}" in capsys.readouterr().err and not bad.exists()
    assert sys.stdin.read() == "Say hello.\n"  # no message read
    # the server's: SpeechConfig, ServeOptions, and `omnijax serve --talker-window` before the checkpoint is read
    with pytest.raises(ValueError, match=rf"SpeechConfig.talker_window {window}: .*at least 2"):
        SpeechConfig(talker_window=window)
    with pytest.raises(ValueError, match=rf"talker_window \(--talker-window\) {window}: .*at least 2"):
        ServeOptions(talker_window=window)
    with pytest.raises(SystemExit) as e:
        app.main([str(tmp_path), "--talker-window", str(window)])
    assert e.value.code == 2 and f"(--talker-window) {window}:" in capsys.readouterr().err
