"""A checkpoint's tokenizer and chat templates, without transformers or torch.

`Tokenizer.from_directory` reads a Hugging Face tokenizer directory: `tokenizer.json` (required; run by the Rust
`tokenizers` engine behind transformers' fast tokenizers, and the source of the added tokens), `tokenizer_config.json`
(optional: `chat_template` as a string or a list of named templates, named special tokens such as `eos_token`) and
the template files. Which templates a directory has follows transformers 5.2.0, preferring the processor's (an omni
model's prompts are rendered by its processor, e.g. through qwen-omni-utils): the legacy processor file
`chat_template.json` when present (alone; `AutoTokenizer` ignores it, `AutoProcessor` prefers it to
`chat_template.jinja`), else `chat_template.jinja` with `additional_chat_templates/*.jinja`, else the config's
`chat_template` (template files replace the config's templates as a whole, as in `AutoTokenizer`). Not read: a
`chat_template` key of `processor_config.json` (the converter does not copy that file).

Templates render in a sandboxed Jinja environment set up as transformers 5.2 sets it up (`trim_blocks`,
`lstrip_blocks`, `loopcontrols`, a `{% generation %}` tag, `raise_exception`, `strftime_now`, a `tojson` that keeps
non-ASCII text) with the named special tokens as variables, then the tokenizer's `template_defaults` (a family's
defaults, e.g. MiniCPM-o 4.5's `enable_thinking=False`), then the caller's. Not done: `clean_up_tokenization_spaces`
(the Qwen releases turn it off) and the legacy `added_tokens.json` / `special_tokens_map.json`.

The chat templates omnijax ships (`CHATML_TEMPLATE`, `MINICPMO_4_5_TEMPLATE`) live in `omnijax.models.chat_templates`.
`write_tiny_tokenizer` trains a tiny byte-level BPE in milliseconds with special tokens at chosen ids, so tiny test
checkpoints get a tokenizer that transformers' `AutoTokenizer` loads too.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from omnijax.models.chat_templates import CHATML_TEMPLATE, MINICPMO_4_5_TEMPLATE

__all__ = ["CHATML_TEMPLATE", "MINICPMO_4_5_TEMPLATE", "ROLES", "StreamDecoder", "Tokenizer", "TokenizerError",
           "load_tokenizer", "write_tiny_tokenizer"]

TOKENIZER_FILE, CONFIG_FILE, TEMPLATE_FILE, TEMPLATE_DIR = (
    "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "additional_chat_templates")
LEGACY_TEMPLATE_FILE = "chat_template.json"  # the processor format of transformers 4: {"chat_template": "..."}
ROLES = ("system", "user", "assistant", "tool")
REPLACEMENT = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence

# Pre-tokenization of the Qwen2 tokenizers (split pattern, then bytes to printable characters), used by the tiny one.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
_TINY_CORPUS = (
    "The quick brown fox jumps over the lazy dog. What is shown in the picture? Describe it briefly.",
    "Streaming models hear audio, watch video frames and answer questions in real time.",
    "def main():\n    return [x * 2 for x in range(10)]  # code, indentation and numbers 0123456789",
    "你好，世界！这是一个测试。图片里有什么？", "こんにちは、世界。ありがとう。", "안녕하세요 세계",
    "Emoji: 😀 🎉 👍🏽 ❤️ and accents: café, naïve, Zürich, São Paulo.", "  spaces\tand\ttabs\n\nnew lines  ",
)


class TokenizerError(ValueError):
    """A tokenizer directory, file or chat template that cannot be used (the message names the file)."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers uses it to mark assistant text)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _read(path: Path, as_json: bool = False):
    """A file's text, or its JSON object; a `TokenizerError` naming the file when it cannot be."""
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if as_json else text
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: cannot read: {e}") from e
    if as_json and not isinstance(data, dict):
        raise TokenizerError(f"{path}: not a JSON object")
    return data


def _file_templates(directory: Path) -> dict[str, str]:
    """The chat templates of a directory's template files, as transformers 5.2's processor loads them: the legacy
    `chat_template.json` (`{"chat_template": "..."}`) alone when present (with `additional_chat_templates/` beside it
    transformers refuses the directory, and so does this), else `chat_template.jinja` as "default" and each
    `additional_chat_templates/NAME.jinja` as NAME. Empty when there are none."""
    extras = sorted((directory / TEMPLATE_DIR).glob("*.jinja")) if (directory / TEMPLATE_DIR).is_dir() else []
    legacy = directory / LEGACY_TEMPLATE_FILE
    if legacy.is_file():
        template = _read(legacy, as_json=True).get("chat_template")
        if not isinstance(template, str):
            raise TokenizerError(f"{legacy}: expected {{\"chat_template\": \"<Jinja source>\"}}, got a "
                                 f"{type(template).__name__} under 'chat_template'")
        if extras:
            raise TokenizerError(f"{legacy}: a legacy {LEGACY_TEMPLATE_FILE} cannot be combined with the template "
                                 f"files in {directory / TEMPLATE_DIR} (transformers refuses this too); replace it "
                                 f"with a {TEMPLATE_FILE} holding the same template")
        return {"default": template}
    templates = {extra.name.removesuffix(".jinja"): _read(extra) for extra in extras}
    if (directory / TEMPLATE_FILE).is_file():
        templates["default"] = _read(directory / TEMPLATE_FILE)
    return templates


def _template_variables(variables: Mapping[str, Any], what: str) -> dict[str, Any]:
    """`variables` as a dict of template variables; a ValueError for a name that is not one."""
    if not isinstance(variables, Mapping):
        raise ValueError(f"{what} must be a mapping of template variable names to values, got "
                         f"{type(variables).__name__}")
    for name in variables:
        if not isinstance(name, str) or name in ("messages", "add_generation_prompt"):
            raise ValueError(f"{what}: {name!r} cannot be a template variable (names are strings; messages and "
                             "add_generation_prompt are render's own arguments)")
    return dict(variables)


def _token_text(value) -> str | None:
    """A special token as a config stores it: a string or an added-token object `{"content": ...}`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """A checkpoint's tokenizer: text <-> token ids and its chat template(s).

    Attributes:
        backend: the `tokenizers.Tokenizer` doing the work.
        template_defaults: template variables every `render` gets unless its caller passes them (see
            `with_template_defaults`); empty for a tokenizer read from a directory.
        chat_templates: template name -> Jinja source ("default" is used unless a name is asked for); empty when
            the checkpoint ships none.
        special_tokens: named special tokens (`eos_token`, `bos_token`, `pad_token`, model-specific `*_token`
            entries) -> token text; each is a variable of the chat templates.
        source: where it was read from (for messages), or None.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, chat_templates: Mapping[str, str] | None = None,
                 special_tokens: Mapping[str, str] | None = None, source: str | None = None,
                 template_defaults: Mapping[str, Any] | None = None):
        self.backend = backend
        self.chat_templates = dict(chat_templates or {})
        self.special_tokens = dict(special_tokens or {})
        self.source = source
        self.template_defaults = _template_variables(template_defaults or {}, "template_defaults")

    def with_template_defaults(self, defaults: Mapping[str, Any]) -> Tokenizer:
        """This tokenizer (the same backend, templates and special tokens) rendering with `defaults` as template
        variables (over its own `template_defaults`) wherever a caller of `render` does not pass them, e.g. a
        family's `{"enable_thinking": False}`.

        Raises:
            ValueError: a name that is not a string, or one `render` sets itself (`messages`,
                `add_generation_prompt`).
        """
        merged = {**self.template_defaults, **_template_variables(defaults, "template defaults")}
        return Tokenizer(self.backend, chat_templates=self.chat_templates, special_tokens=self.special_tokens,
                         source=self.source, template_defaults=merged)

    @classmethod
    def from_directory(cls, path: str | Path) -> Tokenizer:
        """Reads `tokenizer.json`, `tokenizer_config.json` and the chat template files of a directory.

        Raises:
            TokenizerError: the directory or `tokenizer.json` is missing, or a file is unreadable or malformed.
        """
        directory = Path(path)
        file = directory / TOKENIZER_FILE
        if not file.is_file():
            raise TokenizerError(f"{file}: not found (a tokenizer directory needs {TOKENIZER_FILE})")
        text = _read(file)
        try:
            backend = tokenizers.Tokenizer.from_str(text)
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a malformed file
            raise TokenizerError(f"{file}: not a valid tokenizers file: {e}") from e
        config_file = directory / CONFIG_FILE
        config = _read(config_file, as_json=True) if config_file.is_file() else {}
        templates = _file_templates(directory)
        raw = config.get("chat_template")
        if isinstance(raw, str):
            configured = {"default": raw}
        elif isinstance(raw, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                           and isinstance(t.get("template"), str) for t in raw):
            configured = {t["name"]: t["template"] for t in raw}
        elif raw is not None:
            raise TokenizerError(f"{config_file}: chat_template must be a string or a list of "
                                 f"{{'name': ..., 'template': ...}} objects, got {type(raw).__name__}")
        else:
            configured = {}
        templates = templates or configured  # template files replace the config's templates, not merge with them
        specials = {k: t for k, v in config.items() if k.endswith("_token") and (t := _token_text(v)) is not None}
        extra = config.get("extra_special_tokens")
        if isinstance(extra, dict):
            specials.update({k: t for k, v in extra.items() if (t := _token_text(v)) is not None})
        return cls(backend, chat_templates=templates, special_tokens=specials, source=str(directory))

    @functools.cached_property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce: 1 + its largest id (ordinary and added tokens)."""
        largest = max(self.backend.get_vocab(with_added_tokens=True).values(), default=-1)
        return largest + 1

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special (e.g. `<|im_start|>`, `<|endoftext|>`)."""
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    @property
    def eos_token_id(self) -> int | None:
        """Id of the config's `eos_token`, or None when it names none."""
        eos = self.special_tokens.get("eos_token")
        return None if eos is None else self.backend.token_to_id(eos)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no BOS/EOS added; special token text such as `<|im_start|>` maps to its id)."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids (`[T]` ints, numpy ints accepted); ids without a token contribute nothing."""
        ids = [int(i) for i in ids]
        if any(i < 0 for i in ids):
            raise ValueError(f"token ids must be non-negative, got {min(ids)}")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, text: str) -> int:
        """Id of one token given by its text (e.g. "<|im_end|>").

        Raises:
            KeyError: the vocabulary has no such token.
        """
        found = self.backend.token_to_id(text)
        if found is None:
            raise KeyError(f"token {text!r} is not in the vocabulary of {self.source or 'this tokenizer'}")
        return found

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        """An incremental decoder of a growing id sequence (see `StreamDecoder`)."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    def render(self, messages: Sequence[Mapping], add_generation_prompt: bool = True, *,
               chat_template: str | None = None, **kwargs: Any) -> str:
        """The prompt text of a conversation, by the checkpoint's chat template.

        Args:
            messages: `[{"role": "system" | "user" | "assistant" | "tool", "content": str | [{"type": "text",
                "text": str}, ...]}, ...]` (other keys, e.g. `reasoning_content`, reach the template as they are).
            add_generation_prompt: end with the header of an assistant turn.
            chat_template: the name of one of `chat_templates`, or a template's own Jinja source; default the
                "default" template.
            **kwargs: further template variables (e.g. `enable_thinking`, `tools`, `documents`); they override the
                named special tokens and `template_defaults`.

        Raises:
            ValueError: a malformed message or an unknown role (named).
            TokenizerError: no chat template, or the template fails (its message is kept).
        """
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
                raise ValueError(f"message {i} must be a mapping with 'role' and 'content', got {message!r}")
            if message["role"] not in ROLES:
                raise ValueError(f"message {i} has unknown role {message['role']!r}; roles are {', '.join(ROLES)}")
            content = message["content"]
            if not (isinstance(content, str) or isinstance(content, Sequence)
                    and all(isinstance(p, Mapping) and "type" in p for p in content)):
                raise ValueError(f"message {i} content must be a string or a list of {{'type': ...}} parts, "
                                 f"got {content!r}")
        source = self._template(chat_template, kwargs.get("tools"))
        try:
            compiled = _compile(source)
        except jinja2.TemplateSyntaxError as e:
            raise TokenizerError(f"chat template of {self.source or 'this tokenizer'} does not parse: {e}") from e
        variables = {**self.special_tokens, "tools": None, "documents": None, **self.template_defaults, **kwargs}
        try:
            return compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template of {self.source or 'this tokenizer'} failed: {e}") from e

    def apply_chat_template(self, messages: Sequence[Mapping], add_generation_prompt: bool = True,
                            tokenize: bool = True, **kwargs: Any) -> list[int] | str:
        """`render` then `encode` (`[T]` ids; special token text becomes its ids), or the text when not
        `tokenize`. Keyword arguments are those of `render`."""
        text = self.render(messages, add_generation_prompt, **kwargs)
        return self.encode(text) if tokenize else text

    def _template(self, name_or_source: str | None, tools) -> str:
        if name_or_source is not None and name_or_source not in self.chat_templates:
            return name_or_source  # a template's own source
        if name_or_source is None and tools is not None and "tool_use" in self.chat_templates:
            name_or_source = "tool_use"
        name = name_or_source or "default"
        if name not in self.chat_templates:
            where = self.source or "this tokenizer"
            if not self.chat_templates:
                raise TokenizerError(f"{where} has no chat template (no chat_template in {CONFIG_FILE}, no "
                                     f"{TEMPLATE_FILE} or {LEGACY_TEMPLATE_FILE}): pass chat_template=... or "
                                     "render the prompt yourself")
            raise TokenizerError(f"{where} has no default chat template; its templates are "
                                 f"{sorted(self.chat_templates)}: pass chat_template=NAME")
        return self.chat_templates[name]


class StreamDecoder:
    """Decodes ids as they are generated, returning only text that is complete.

    Byte-level BPE tokens can end inside a multi-byte UTF-8 character; such a tail (text ending in U+FFFD) is held
    back until a later id completes it. Only a window of ids is decoded: those since the last emitted text, after
    the ids emitted last time (context for decoders that treat the start of a text specially), so a `push` costs
    the window, not the sequence. `"".join(pushes) + flush()` equals `tokenizer.decode(all_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self._window: list[int] = []  # the ids emitted last time, then those not emitted yet
        self._emitted = 0  # how many ids of the window were emitted

    def _texts(self) -> tuple[str, str]:
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=self.skip_special_tokens)
        return decode(self._window[:self._emitted]), decode(self._window)

    def push(self, ids: Sequence[int]) -> str:
        """Adds `[n]` ids; returns the text they complete ("" while it is incomplete)."""
        self._window.extend(int(i) for i in ids)
        before, text = self._texts()
        if len(text) <= len(before) or text.endswith(REPLACEMENT):
            return ""
        self._window = self._window[self._emitted:]
        self._emitted = len(self._window)
        return text[len(before):]

    def flush(self) -> str:
        """Returns the held-back text (incomplete characters decode as U+FFFD) and resets the decoder."""
        before, text = self._texts()
        self._window, self._emitted = [], 0
        return text[len(before):]


def load_tokenizer(directory: str | Path) -> Tokenizer | None:
    """The tokenizer of a directory when it has `tokenizer.json`, else None (a malformed one raises)."""
    directory = Path(directory)
    return Tokenizer.from_directory(directory) if (directory / TOKENIZER_FILE).is_file() else None


def write_tiny_tokenizer(directory: str | Path, *, vocab_size: int, special_tokens: Mapping[str, int],
                         chat_template: str | None, corpus: Sequence[str] | None = None,
                         eos_token: str | None = None) -> Path:
    """Trains a tiny byte-level BPE (Qwen2-style pre-tokenization) and writes a tokenizer directory.

    Ordinary tokens take the ids below the smallest special id (and below `vocab_size`); each special token gets
    exactly its given id (it is written into the model vocabulary as well as the added tokens, since `tokenizers`
    gives an added token absent from the vocabulary the next free id instead). The ids between the trained tokens
    and the specials hold unreachable placeholders `<|unused_N|>` (`tokenizers` warns about a vocabulary with holes
    whenever it is saved, as transformers does on loading). Writes `tokenizer.json` and `tokenizer_config.json` (class
    `PreTrainedTokenizerFast`, the chat template, `eos_token`), which transformers' `AutoTokenizer` loads.

    Args:
        directory: created if needed.
        vocab_size: the model's vocabulary; every id must lie below it.
        special_tokens: token text -> id, e.g. `{"<|im_start|>": 151644, "<|im_end|>": 151645}`.
        chat_template: Jinja source stored as the config's `chat_template` (None: no template).
        corpus: training texts; default a small multilingual built-in set.
        eos_token: default `<|im_end|>`, else `<|endoftext|>`, when among the special tokens.

    Returns:
        The directory.
    """
    ids = list(special_tokens.values())
    if len(set(ids)) != len(ids) or not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids):
        raise ValueError(f"special token ids must be distinct ints in [0, {vocab_size}), got {dict(special_tokens)}")
    text, config_text = _tiny_tokenizer_files(vocab_size, tuple(special_tokens.items()), chat_template,
                                              None if corpus is None else tuple(corpus), eos_token)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / TOKENIZER_FILE).write_text(text, encoding="utf-8")
    (directory / CONFIG_FILE).write_text(config_text, encoding="utf-8")
    return directory


@functools.lru_cache(maxsize=8)
def _tiny_tokenizer_files(vocab_size: int, special_tokens: tuple[tuple[str, int], ...], chat_template: str | None,
                          corpus: tuple[str, ...] | None, eos_token: str | None) -> tuple[str, str]:
    """`write_tiny_tokenizer`'s two files' text (`tokenizer.json`, `tokenizer_config.json`). Training and filling
    the vocabulary's gaps up to a 152K-id special token takes a second or two, and the result depends only on the
    arguments, so a process that writes the same tokenizer again reuses it."""
    specials = dict(special_tokens)
    ids = list(specials.values())
    limit = min([vocab_size, *ids])
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    if limit <= len(alphabet):
        raise ValueError(f"the byte alphabet needs {len(alphabet)} ids below the smallest special id, got {limit}")
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.normalizer = tokenizers.normalizers.NFC()
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Split(tokenizers.Regex(_QWEN2_SPLIT), behavior="isolated"),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=limit, initial_alphabet=alphabet, show_progress=False)
    backend.train_from_iterator(list(_TINY_CORPUS if corpus is None else corpus), trainer)
    data = json.loads(backend.to_str())
    vocab = data["model"]["vocab"]
    for token, i in specials.items():
        if token in vocab:
            raise ValueError(f"special token {token!r} is also an ordinary token of the trained vocabulary")
        vocab[token] = i
    used = set(vocab.values())  # fill the gaps: a vocabulary with holes makes `tokenizers` warn at every save
    vocab.update({f"<|unused_{i}|>": i for i in range(max(used) + 1) if i not in used})
    entry = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    data["added_tokens"] = [{"id": i, "content": t, **entry} for t, i in sorted(specials.items(), key=lambda x: x[1])]
    text = json.dumps(data, ensure_ascii=False)
    check = tokenizers.Tokenizer.from_str(text)
    wrong = {t: check.token_to_id(t) for t, i in specials.items() if check.token_to_id(t) != i}
    assert not wrong, f"special tokens landed on other ids: {wrong}"
    if eos_token is None:
        eos_token = next((t for t in ("<|im_end|>", "<|endoftext|>") if t in specials), None)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "model_max_length": 32768,
              "added_tokens_decoder": {str(i): {"content": t, **entry} for t, i in specials.items()}}
    if eos_token is not None:
        config["eos_token"] = eos_token
    if chat_template is not None:
        config["chat_template"] = chat_template
    return text, json.dumps(config, ensure_ascii=False, indent=2)
