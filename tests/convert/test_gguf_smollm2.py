"""The real SmolLM2-135M-Instruct from the GGUF `make test` installs (tests/_support/real_model.py), converted by
omnijax and checked against transformers 5.2.0 loading the same file: logits and greedy answers on a few short prompts.
The tiny GGUFs of every quantisation type and architecture are in test_gguf.py. A 30-layer model decoding: the module
is execution-bound (tests/_support/xla_flags.EXECUTION_BOUND), its steps run ~4x slower without LLVM optimisation."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gguf", reason="the gguf package (the omnijax[gguf] / test extra) reads the GGUF")
torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")

import omnijax  # noqa: E402
from omnijax.chunks.spans import SpanKind  # noqa: E402
from omnijax.demo.passkey import configs  # noqa: E402
from omnijax.models.frontend import units_for  # noqa: E402
from tests._support import real_model  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
PROMPTS = ("What is the capital of France?", "Name three primary colours.", "What is 2 + 2?")


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct: the omnijax model of the installed GGUF and transformers' model and tokenizer of the
    same file, loaded once for the module (both cached outside the clone: tests/_support/real_model.py)."""
    ours = omnijax.load(real_model.checkpoint())
    reference, theirs = real_model.transformers_reference()
    return ours, reference, theirs


def test_smollm2_matches_transformers(smollm2):
    """The real model on a few short prompts: the chat template renders and encodes as transformers' GGUF tokenizer
    does; the prompt's logits <= 1e-3 from transformers' at every position (the first prompt) and at the last (all);
    the greedy answer, decoded inside omnijax's streamed step (the prompt fed once, answer tokens fed back into the
    cache), is transformers' `generate` token for token."""
    model, reference, theirs = smollm2
    config = configs(512)["NoSlide"]  # the demo's full-context session: its compiled steps are shared
    units, block = units_for(model), config.max_answer_tokens
    answers = []
    for n, question in enumerate(PROMPTS):
        messages = [{"role": "user", "content": question}]
        text = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert model.tokenizer.render(messages) == text
        prompt = theirs.encode(text, add_special_tokens=False)
        assert model.tokenizer.encode(text) == prompt
        with torch.no_grad():
            want = reference(torch.as_tensor([prompt])).logits.numpy()[0]
            expected = reference.generate(torch.as_tensor([prompt]), max_new_tokens=block,
                                          do_sample=False)[0, len(prompt):].tolist()
        assert np.abs(want).max() > 10.0  # real logits, not a degenerate model
        if n == 0:
            np.testing.assert_allclose(np.asarray(model(input_ids=np.asarray([prompt])))[0], want, atol=1e-3,
                                       rtol=0)
        session = omnijax.Session(model, config)
        out = session.feed(units.pad(units.text(prompt, 0, SpanKind.TEXT, answer_tokens=block)))
        np.testing.assert_allclose(np.asarray(out.logits)[0], want[-1], atol=1e-3, rtol=0)
        got = [int(t) for t in np.asarray(out.tokens)[0] if t >= 0]
        assert got == expected[:len(got)] and len(got) == min(len(expected), block)
        answers.append(model.tokenizer.decode(got, skip_special_tokens=True))
    assert "Paris" in answers[0] and "4" in answers[2], answers
