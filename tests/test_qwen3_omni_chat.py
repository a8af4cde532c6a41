"""`omnijax.Chat` on a converted tiny Qwen3-Omni checkpoint with a tokenizer: the templated turn is fed, and the
streamed answer is transformers' greedy `generate` on the same ids."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")

import omnijax  # noqa: E402
from convert import convert_checkpoint  # noqa: E402
from omnijax.chat import Chat  # noqa: E402
from tests import qwen3_omni_models as Q  # noqa: E402


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
