"""Sessions of a converted tiny Qwen3-Omni checkpoint (with a tokenizer): `omnijax.Chat` answers as transformers'
greedy `generate` on the templated prompt; the Metronome engine serves audio sessions (PCM frames through the AuT
encoder) in batched ticks exactly as each session alone."""

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")

import omnijax  # noqa: E402
from omnijax.chat import Chat  # noqa: E402
from omnijax.convert import convert_checkpoint  # noqa: E402
from tests._support import qwen3_omni_models as Q  # noqa: E402


@pytest.fixture(scope="module")
def hf():
    return Q.build_thinker(seed=3, scale=0.3)


@pytest.fixture(scope="module")
def model(hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_chat")
    src = Q.save_thinker(hf, root / "hf")
    Q.write_tokenizer(src)
    loaded = omnijax.load(convert_checkpoint(src, root / "out", progress=False))
    assert loaded.tokenizer is not None and loaded.model_type == "qwen3_omni"
    return loaded


def test_chat_answer_is_the_reference_greedy_answer(model, hf):
    im_end = Q.SPECIALS["<|im_end|>"]
    assert model.config.eos_token_ids == (im_end,) and model.omni.im_end_token_id == im_end
    chat = Chat(model, omnijax.StreamConfig(max_answer_tokens=4, num_pages=16))
    chat.system("Be brief.")
    answer = "".join(chat.ask("Hi there!", max_tokens=9))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    with torch.no_grad():
        out = hf.generate(input_ids=torch.as_tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=int),
                          max_new_tokens=9, do_sample=False, eos_token_id=im_end, pad_token_id=0)
    want = [int(t) for t in out[0, len(ids):] if int(t) != im_end]
    assert len(want) >= 3  # a real answer, not an immediate end
    assert answer == model.tokenizer.decode(want, skip_special_tokens=True)
    assert chat.messages[-1] == {"role": "assistant", "content": answer}
    kept = chat.kept()
    assert kept  # the conversation is in the cache, unit by unit


def test_engine_serves_audio_sessions_as_each_session_alone(model):
    from omnijax.retention import SinkWindow
    from omnijax.serve.audio_frames import AudioFrameEncoder, frame_tokens
    from omnijax.serve.engine.engine import Engine, EngineConfig
    from omnijax.serve.loadgen import speech_like_pcm

    samples = 4000  # 250 ms frames: 25 mel frames, 4 AuT tokens, 6 chunk tokens
    T = frame_tokens(samples, model)
    assert T == 6 and frame_tokens(samples) == 8  # Qwen2.5-Omni's 25 tokens per second would give 6 + 2
    stream = omnijax.StreamConfig(policy=SinkWindow(4, 24), num_pages=32, page_size=8, max_answer_tokens=2)
    engine = Engine(model, EngineConfig(stream, chunk_tokens=T, buckets=(2,), frame_budget_s=1.0))
    encoder = AudioFrameEncoder(model, chunk_tokens=T, answer_tokens=2)
    alone = {s: omnijax.Session(model, stream) for s in ("a", "b")}
    for s in alone:
        engine.open(s)
    for tick in range(6):
        sent = {}
        for i, s in enumerate(alone):
            pcm = speech_like_pcm(samples / 16000, seed=10 * tick + i)
            chunk = encoder.encode(pcm, unit=tick)
            engine.submit(s, chunk, 2 if tick % 3 == 2 else 0)
            sent[s] = dataclasses.replace(chunk, answer_tokens=np.asarray([2 if tick % 3 == 2 else 0], np.int32))
        report = engine.tick()
        for s, chunk in sent.items():
            ref = alone[s].feed(chunk)
            np.testing.assert_allclose(report.outputs[s].logits, np.asarray(ref.logits[0]), atol=1e-5, rtol=0)
            assert report.outputs[s].tokens == [int(t) for t in np.asarray(ref.tokens[0]) if t >= 0]
    retained = np.asarray(alone["a"].state.kv.valid).sum()
    assert retained <= 4 + 24 + 2 * T  # the sink window bounds the session
