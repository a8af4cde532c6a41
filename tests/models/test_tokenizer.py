"""`omnijax.models.tokenizer` against transformers' `AutoTokenizer` on the same files: encoding, decoding, chat
templates (ChatML of Qwen2.5-Omni and the MiniCPM-o 4.5 layout), special-token ids of the tiny tokenizers,
incremental decoding, the errors, and the tokenizer `omnijax.load` attaches."""

import json
import shutil
import warnings

import pytest

from omnijax.models.qwen2_5_omni.config import TOKEN_TEXT, OmniConfig
from omnijax.models.tokenizer import (
    CHATML_TEMPLATE,
    MINICPMO_4_5_TEMPLATE,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
    write_tiny_tokenizer,
)
from tests._support import DATA

GOLDEN = DATA / "minicpmo45"
# Qwen2.5-Omni's special ids (a 151,936-entry vocabulary), and the MiniCPM-o golden checkpoint's tiny ones (2,048).
QWEN_SPECIALS = {"<|endoftext|>": 151643, **{text: getattr(OmniConfig(), f) for f, text in TOKEN_TEXT.items()}}
MINICPM_SPECIALS = json.loads((GOLDEN / "info.json").read_text())["special_token_ids_tiny"]
TEXTS = ["Hello, world! How are you today?", "你好，世界！图片里有什么？", "emoji 😀🎉 and 👍🏽 and 𝄞 and 🦜",
         "a<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "   leading and trailing   ",
         "tabs\t\tand\n\n\nlines",
         "", "  ", "naïve café, Zürich — «quotes» ‘single’", "x = [i ** 2 for i in range(10)]  # 0123456789",
         "<|endoftext|><|endoftext|>", "<|im_end|>text<|IMAGE|><|VIDEO|>"]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3? 你好 😀"}],
    [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
     {"role": "user", "content": [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second."}]},
     {"role": "assistant", "content": [{"type": "text", "text": "Done."}]}],
    [{"role": "user", "content": "Think?"}, {"role": "assistant", "content": "<think>\nsure\n</think>\n\nYes."},
     {"role": "user", "content": "Again"}, {"role": "assistant", "content": "<think>\nok\n</think>\n\nNo."}],
    [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Looking.", "reasoning_content": "tool"},
     {"role": "tool", "content": '{"t": 21}'}, {"role": "tool", "content": "sunny"},
     {"role": "assistant", "content": "21, sunny."}],
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {"chatml": write_tiny_tokenizer(root / "chatml", vocab_size=151_936, special_tokens=QWEN_SPECIALS,
                                           chat_template=CHATML_TEMPLATE),
            "minicpmo": write_tiny_tokenizer(root / "minicpmo", vocab_size=2048, special_tokens=MINICPM_SPECIALS,
                                             chat_template=MINICPMO_4_5_TEMPLATE)}


@pytest.fixture(scope="module")
def pairs(dirs):
    from transformers import AutoTokenizer

    return {k: (Tokenizer.from_directory(d), AutoTokenizer.from_pretrained(str(d))) for k, d in dirs.items()}


def hf_ids(out):
    return list(out if isinstance(out, list) else out["input_ids"])  # transformers 5 returns a BatchEncoding


@pytest.mark.parametrize("kind", ["chatml", "minicpmo"])
def test_encode_decode_match_transformers(pairs, kind):
    ours, hf = pairs[kind]
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == hf.decode(ids) == text
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    assert ours.encode("<|im_start|>") == [ours.token_id("<|im_start|>")]


def test_special_tokens_sit_at_the_requested_ids(pairs, dirs):
    ours, hf = pairs["chatml"]
    for text, i in QWEN_SPECIALS.items():
        assert ours.token_id(text) == hf.convert_tokens_to_ids(text) == i
        assert ours.decode([i]) == text and ours.decode([i], skip_special_tokens=True) == ""
    assert ours.token_id("<|im_start|>") == 151644 and ours.token_id("<|im_end|>") == 151645
    assert ours.special_ids == frozenset(QWEN_SPECIALS.values())
    assert ours.vocab_size == max(QWEN_SPECIALS.values()) + 1 <= 151_936
    assert ours.eos_token_id == 151645 and hf.eos_token_id == 151645
    ordinary = ours.encode(" ".join(TEXTS).replace("<|", "<"))
    assert max(ordinary) < min(QWEN_SPECIALS.values())  # trained tokens stay below the specials
    small, _ = pairs["minicpmo"]
    assert {t: small.token_id(t) for t in MINICPM_SPECIALS} == MINICPM_SPECIALS
    with pytest.raises(KeyError, match="<\\|nope\\|>"):
        ours.token_id("<|nope|>")
    with pytest.raises(ValueError, match="distinct"):
        write_tiny_tokenizer(dirs["chatml"].parent / "bad", vocab_size=1000, special_tokens={"<a>": 1000},
                             chat_template=None)


@pytest.mark.parametrize("kind", ["chatml", "minicpmo"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_matches_transformers(pairs, kind, generation_prompt):
    ours, hf = pairs[kind]
    extras = [{}] if kind == "chatml" else [{}, {"enable_thinking": True}, {"use_tts_template": True}]
    conversations = CONVERSATIONS + ([[{"role": "user", "content": [
        {"type": "audio"}, {"type": "image"}, {"type": "video"}, {"type": "text", "text": "Describe."}]}]]
        if kind == "chatml" else [])
    for messages in conversations:
        for kwargs in extras:
            text = ours.render(messages, generation_prompt, **kwargs)
            assert text == hf.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                  tokenize=False, **kwargs)
            ids = ours.apply_chat_template(messages, add_generation_prompt=generation_prompt, **kwargs)
            assert ids == hf_ids(hf.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                        tokenize=True, **kwargs))
            assert ours.apply_chat_template(messages, generation_prompt, tokenize=False, **kwargs) == text
    first = ours.render(CONVERSATIONS[1])
    assert first.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>")
    assert first.endswith("<|im_start|>assistant\n" + ("" if kind == "chatml" else "<think>\n\n</think>\n\n"))


def test_minicpmo_template_reproduces_the_golden_prompt(pairs):
    ours, _ = pairs["minicpmo"]
    meta = json.loads((GOLDEN / "case5_chat.json").read_text())["meta"]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "audio"}, {
        "type": "text", "text": "What is shown in the picture? Describe it briefly."}]}]
    assert ours.render(messages, use_tts_template=True) == meta["prompt"]


def test_template_environment_matches_transformers(tmp_path, pairs):
    """Globals, filters, whitespace settings and tags as transformers sets them, the special-token variables, the
    template files transformers 5 writes (`chat_template.jinja` wins over the config), and named templates."""
    from transformers import AutoTokenizer

    template = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}\n"
                "  {{ m['role'] | upper }}: {{ m['content'] | tojson }} {{ eos_token }}\n"
                "{% generation %}[{{ m['content'] }}]{% endgeneration %}\n{% endfor %}"
                "{{ strftime_now('%Y') }}{% if add_generation_prompt %}>{% endif %}")
    d = write_tiny_tokenizer(tmp_path / "t", vocab_size=600, special_tokens={"<e>": 599}, chat_template="unused",
                             eos_token="<e>")
    (d / "chat_template.jinja").write_text(template)
    ours, hf = Tokenizer.from_directory(d), AutoTokenizer.from_pretrained(str(d))
    messages = [{"role": "user", "content": "ünï \"q\" <b>"}, {"role": "assistant", "content": "x"},
                {"role": "user", "content": "dropped"}]
    assert ours.render(messages) == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert '"ünï \\"q\\" <b>" <e>' in ours.render(messages) and "dropped" not in ours.render(messages)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "D"}, {"name": "other", "template": "O"}]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "chat_template.jinja").unlink()
    named = Tokenizer.from_directory(d)
    assert named.render(messages) == "D" and named.render(messages, chat_template="other") == "O"
    assert named.render(messages, chat_template="{{ messages | length }}") == "3"


def test_incremental_decoding_equals_full_decode(pairs):
    ours, _ = pairs["chatml"]
    text = "Hi 😀 你好 𝄞🦜 naïve <|im_end|> ok"
    ids = ours.encode(text)
    assert any("\ufffd" in ours.decode([i]) for i in ids)  # some tokens end inside a character
    for step in (1, 2, 3):
        decoder = ours.stream_decoder()
        pieces = [decoder.push(ids[k:k + step]) for k in range(0, len(ids), step)]
        assert not any("\ufffd" in p for p in pieces)  # a character appears once it is complete
        assert "".join(pieces) + decoder.flush() == ours.decode(ids) == text
    decoder = ours.stream_decoder(skip_special_tokens=True)
    assert "".join(decoder.push([i]) for i in ids) + decoder.flush() == ours.decode(ids, skip_special_tokens=True)
    partial = ours.encode("ab🦜")[:-1]  # ends inside the emoji: held back, then flushed as decode gives it
    decoder = ours.stream_decoder()
    held = "".join(decoder.push([i]) for i in partial)
    assert "\ufffd" not in held and held + decoder.flush() == ours.decode(partial)
    assert ours.decode(partial).endswith("\ufffd")


def test_errors_are_clear(tmp_path, pairs):
    ours, _ = pairs["chatml"]
    with pytest.raises(ValueError, match="unknown role 'narrator'"):
        ours.render([{"role": "narrator", "content": "Once"}])
    with pytest.raises(ValueError, match="content"):
        ours.render([{"role": "user", "content": 3}])
    plain = Tokenizer.from_directory(write_tiny_tokenizer(tmp_path / "plain", vocab_size=300,
                                                          special_tokens={"<s>": 299}, chat_template=None))
    assert plain.encode("<s>hi") == [299, *plain.encode("hi")]
    with pytest.raises(TokenizerError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(TokenizerError, match="tools"):
        pairs["minicpmo"][0].render([{"role": "user", "content": "hi"}], tools=[{"name": "f"}])
    broken = shutil.copytree(tmp_path / "plain", tmp_path / "broken")
    (broken / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(TokenizerError, match="broken/tokenizer.json"):
        Tokenizer.from_directory(broken)
    (broken / "tokenizer.json").write_text('{"model": {"type": "Nope"}}')
    with pytest.raises(TokenizerError, match="broken/tokenizer.json"):
        load_tokenizer(broken)
    shutil.copy(tmp_path / "plain" / "tokenizer.json", broken / "tokenizer.json")
    (broken / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerError, match="tokenizer_config.json: not a JSON object"):
        Tokenizer.from_directory(broken)
    (broken / "tokenizer_config.json").write_text('{"chat_template": 7}')
    with pytest.raises(TokenizerError, match="chat_template must be"):
        Tokenizer.from_directory(broken)
    (broken / "tokenizer_config.json").write_text('{"chat_template": "{% if %}"}')
    with pytest.raises(TokenizerError, match="does not parse"):
        Tokenizer.from_directory(broken).render([{"role": "user", "content": "hi"}])
    (broken / "tokenizer.json").unlink()
    assert load_tokenizer(broken) is None
    with pytest.raises(TokenizerError, match="tokenizer.json: not found"):
        Tokenizer.from_directory(broken)


def test_load_attaches_the_tokenizer(tmp_path):
    """A converted tiny checkpoint whose release had tokenizer files gets a working `model.tokenizer`; one without
    loads with exactly one UserWarning and no tokenizer."""
    import omnijax
    from omnijax.convert import convert_checkpoint
    from omnijax.testing import checkpoints as demo

    src = demo.write_tiny_hf_checkpoint(tmp_path / "hf", encoders=False)
    write_tiny_tokenizer(src, vocab_size=512, special_tokens={"<|endoftext|>": 509, "<|im_start|>": 510,
                                                             "<|im_end|>": 511}, chat_template=CHATML_TEMPLATE)
    (src / "chat_template.jinja").write_text(CHATML_TEMPLATE.replace("assistant", "bot"))
    out = convert_checkpoint(src, tmp_path / "out", progress=False)
    assert (out / "chat_template.jinja").is_file()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model = omnijax.load(out)
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
    assert ids[0] == 510 and model.tokenizer.decode(ids).endswith("<|im_start|>bot\n")  # the .jinja file wins
    bare = shutil.copytree(out, tmp_path / "bare")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (bare / name).unlink()
    with pytest.warns(UserWarning) as caught:
        model = omnijax.load(bare)
    assert len(caught) == 1 and "no tokenizer files" in str(caught[0].message)
    assert caught[0].filename == __file__  # points at the caller of load
    assert model.tokenizer is None


def test_load_attaches_the_tokenizer_to_minicpmo(tmp_path):
    """The MiniCPM-o load path too: the golden tiny checkpoint with a tokenizer at its tiny special ids."""
    import omnijax
    from omnijax.convert import convert_checkpoint

    src = tmp_path / "hf"
    src.mkdir()
    for name in ("config.json", "model.safetensors"):
        (src / name).symlink_to(GOLDEN / "checkpoint" / name)
    write_tiny_tokenizer(src, vocab_size=2048, special_tokens=MINICPM_SPECIALS, chat_template=MINICPMO_4_5_TEMPLATE)
    out = convert_checkpoint(src, tmp_path / "out", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model = omnijax.load(out)
    assert type(model).__name__ == "MiniCPMOModel"
    assert model.tokenizer.token_id("<|im_start|>") == model.tokens.im_start == 1921
    assert model.tokenizer.render([{"role": "user", "content": "hi"}]).endswith("<think>\n\n</think>\n\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).unlink()
    with pytest.warns(UserWarning, match="no tokenizer files") as caught:
        assert omnijax.load(out).tokenizer is None
    assert len(caught) == 1


# The MiniCPM-o 4.5 release's template ends its generation prompt as Qwen3's does: the empty think block only when
# enable_thinking is false, so a rendering without the variable asks the model to think.
RELEASE_STYLE = MINICPMO_4_5_TEMPLATE.replace("{%- if not (enable_thinking is defined and enable_thinking) %}",
                                              "{%- if enable_thinking is defined and enable_thinking is false %}")


def test_template_defaults_apply_unless_the_caller_passes_the_variable(tmp_path):
    """What a family declares (MiniCPM-o 4.5: enable_thinking=False) reaches every rendering as transformers renders
    it with that keyword; an explicit keyword still wins. The tokenizer read from a directory has no defaults."""
    from transformers import AutoTokenizer

    assert RELEASE_STYLE != MINICPMO_4_5_TEMPLATE
    d = write_tiny_tokenizer(tmp_path / "release", vocab_size=2048, special_tokens=MINICPM_SPECIALS,
                             chat_template=RELEASE_STYLE)
    plain, hf = Tokenizer.from_directory(d), AutoTokenizer.from_pretrained(str(d))
    quiet = plain.with_template_defaults({"enable_thinking": False})
    messages = CONVERSATIONS[1]
    assert plain.template_defaults == {} and quiet.template_defaults == {"enable_thinking": False}
    assert plain.render(messages).endswith("<|im_start|>assistant\n")  # the release template thinks by default
    assert quiet.render(messages) == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                            enable_thinking=False)
    assert quiet.render(messages).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert quiet.render(messages, enable_thinking=True) == plain.render(messages)
    assert quiet.apply_chat_template(messages) == hf_ids(hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, enable_thinking=False))
    assert quiet.backend is plain.backend and quiet.with_template_defaults({"x": 1}).template_defaults == {
        "enable_thinking": False, "x": 1}
    for bad in ({"messages": []}, {"add_generation_prompt": False}, {3: True}):
        with pytest.raises(ValueError, match="cannot be a template variable"):
            plain.with_template_defaults(bad)
    with pytest.raises(ValueError, match="must be a mapping"):
        plain.with_template_defaults([("enable_thinking", False)])


def test_chat_template_json_is_read_with_transformers_precedence(tmp_path):
    """The processor format `chat_template.json` ({"chat_template": ...}) was ignored. transformers 5.2.0's processor
    takes it before `chat_template.jinja`, and refuses it beside `additional_chat_templates/`; template files replace
    the config's templates as a whole (`AutoTokenizer`)."""
    from transformers import AutoTokenizer
    from transformers.processing_utils import ProcessorMixin

    def processor_template(directory):
        return ProcessorMixin.get_processor_dict(str(directory))[0].get("chat_template")

    messages = CONVERSATIONS[1]
    d = write_tiny_tokenizer(tmp_path / "json", vocab_size=151_936, special_tokens=QWEN_SPECIALS,
                             chat_template="config {{ messages | length }}")
    (d / "chat_template.json").write_text(json.dumps({"chat_template": CHATML_TEMPLATE}))
    ours, hf = Tokenizer.from_directory(d), AutoTokenizer.from_pretrained(str(d))
    assert processor_template(d) == CHATML_TEMPLATE == ours.chat_templates["default"]
    assert ours.render(messages) == hf.apply_chat_template(messages, chat_template=processor_template(d),
                                                           add_generation_prompt=True, tokenize=False)
    (d / "chat_template.jinja").write_text("jinja")  # the processor still prefers the json file
    assert processor_template(d) == CHATML_TEMPLATE and Tokenizer.from_directory(d).chat_templates == {
        "default": CHATML_TEMPLATE}
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool_use.jinja").write_text("tools")
    with pytest.raises(ValueError, match="legacy chat_template.json"):
        processor_template(d)
    with pytest.raises(TokenizerError, match="chat_template.json: a legacy chat_template.json cannot be combined"):
        Tokenizer.from_directory(d)
    (d / "chat_template.json").unlink()  # without it: the .jinja files, the config's template dropped
    assert processor_template(d) == {"default": "jinja", "tool_use": "tools"}
    assert Tokenizer.from_directory(d).chat_templates == {"default": "jinja", "tool_use": "tools"}
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "D"}, {"name": "rag", "template": "R"}]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "additional_chat_templates" / "tool_use.jinja").unlink()
    assert AutoTokenizer.from_pretrained(str(d)).chat_template == "jinja"  # "rag" is gone in transformers too
    assert Tokenizer.from_directory(d).chat_templates == {"default": "jinja"}
    (d / "chat_template.json").write_text(json.dumps({"template": "misnamed"}))
    with pytest.raises(TokenizerError, match=r'chat_template.json: expected \{"chat_template"'):
        Tokenizer.from_directory(d)
