"""MiniCPM-o 4.5 prompts are the release's non-thinking ones by default. The release's template (Qwen3's layout)
ends the generation prompt with an empty think block only when `enable_thinking` is false, and its inference code
passes `enable_thinking=False`; omnijax passed nothing, so `Chat` and the server asked the model to think. The family
declares the default (`Family.template_defaults`), `Conversation` applies it, a caller can still ask for thinking."""

import pytest

import omnijax
from omnijax.chat import Chat
from omnijax.conversation import Conversation
from omnijax.convert import convert_checkpoint
from omnijax.models.family import family_for
from omnijax.models.tokenizer import MINICPMO_4_5_TEMPLATE
from tests._support import tiny_omni

pytestmark = pytest.mark.fast  # the quick tier (`make test-fast`): chat-template defaults, tiny checkpoint

RELEASE_STYLE = MINICPMO_4_5_TEMPLATE.replace("{%- if not (enable_thinking is defined and enable_thinking) %}",
                                              "{%- if enable_thinking is defined and enable_thinking is false %}")
QUESTION = [{"role": "user", "content": "Describe it."}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny MiniCPM-o 4.5 checkpoint whose release ships a template that thinks unless told not to."""
    root = tmp_path_factory.mktemp("minicpmo")
    src = tiny_omni.minicpmo_source(root)
    (src / "chat_template.jinja").write_text(RELEASE_STYLE)  # wins over the config's template, as in transformers
    return omnijax.load(convert_checkpoint(src, root / "omnijax", progress=False, log=lambda _: None))


def test_minicpmo_prompts_do_not_think_unless_asked(model):
    from transformers import AutoTokenizer

    assert RELEASE_STYLE != MINICPMO_4_5_TEMPLATE
    hf = AutoTokenizer.from_pretrained(model.source)
    # the loaded model's own tokenizer carries the family's default, so every rendering (Chat, the server's
    # routes, duplex, evaluation) gets it; the template alone, asked to, thinks
    assert model.tokenizer.template_defaults == {"enable_thinking": False}
    assert model.tokenizer.render(QUESTION, enable_thinking=True).endswith("<|im_start|>assistant\n")
    assert model.tokenizer.render(QUESTION).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert family_for("minicpmo").template_defaults == {"enable_thinking": False}
    release = hf.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert release.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    prepared = Conversation(model, model.tokenizer).prepare_ask("Describe it.", 4)
    (chunk,) = prepared.prompt.parts
    assert prepared.rendered == release
    assert model.tokenizer.decode(model.tokenizer.encode(prepared.rendered)) == release
    thinking = Conversation(model, model.tokenizer, template_variables={"enable_thinking": True})
    assert thinking.prepare_ask("Describe it.", 4).rendered == hf.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=False, enable_thinking=True)
    system = Conversation(model, model.tokenizer)  # the defaults reach every rendering, not only questions
    system.message("system", "Be brief.")
    assert system.prompt(2) and system.rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_chat_takes_template_variables_and_refuses_bad_ones(model):
    config = omnijax.StreamConfig(max_answer_tokens=4, num_pages=16)
    assert Chat(model, config).conversation.tokenizer.template_defaults == {"enable_thinking": False}
    chat = Chat(model, config, template_variables={"enable_thinking": True})
    assert chat.conversation.tokenizer.template_defaults == {"enable_thinking": True}
    assert chat.conversation.prepare_ask("Describe it.", 4).rendered.endswith("<|im_start|>assistant\n")
    assert model.tokenizer.template_defaults == {"enable_thinking": False}  # the model's tokenizer is left as it was
    with pytest.raises(ValueError, match="'messages' cannot be a template variable"):
        Chat(model, config, template_variables={"messages": []})


def test_families_without_defaults_render_as_before():
    assert family_for("qwen2_5_omni").template_defaults == {} and family_for("llama").template_defaults == {}
