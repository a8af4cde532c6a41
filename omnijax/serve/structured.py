"""Structured output for chat completions: `response_format` `json_object` / `json_schema` by constrained decoding.

A request's `response_format` is parsed by `parse_response_format` (pure; a `FormatError` names the field), compiled
against the served model's tokenizer by `compile_format` (a `Grammar`, cached per schema and tokenizer content), and
each response draws under a fresh `JsonConstraint` (`Grammar.constraint()`), the
`omnijax.serve.engine.constraint.TokenConstraint` the engine asks before every token for the bitmask of the tokens
that keep the output a prefix of a document the schema accepts; the model's end-of-answer tokens are allowed exactly
when the document may end there, and the row stops (finish_reason "stop") once the document is complete.

The grammar library is llguidance (Microsoft, MIT; a structured-output backend of vLLM, SGLang and llama.cpp;
1.9.1 is its newest of 80+ PyPI releases), pinned in the `serve` and `test` extras and imported when a format is
first compiled (without it a json format is refused naming the extra; the rest of the server runs on the base
install). Chosen over the alternatives on what they install (`pip download --no-deps` metadata) and on what they
measured here (one schema of four required fields: a string, a bounded integer, an array of strings, an enum; 20
random walks of allowed tokens per tokenizer; one process on 2 cores shared at load ~12):

- llguidance 1.9.1: a 3.1 MB abi3 wheel with no Python dependencies. Mask per token: median 24 us (mean 0.22 ms,
  p99 7.9 ms) on SmolLM2's 49,152 tokens, median 28 us (mean 0.17 ms, p99 6.0 ms) on the demo model's 151,936 ids;
  `json_object` medians 4 and 9 us. The tokenizer's trie is built once per served tokenizer (1.6 s / 2.4 s, with
  the check of every token's bytes) and a schema compiles in ~1 ms. JSON Schema coverage: nested objects and arrays,
  `$ref`/`$defs` (recursive too), `anyOf`/`oneOf`/`allOf`, `enum`/`const`, string `pattern`/`format`/length bounds,
  numeric ranges and `multipleOf`, `minItems`/`maxItems`, `additionalProperties`, `patternProperties`; a keyword it
  does not implement (`uniqueItems`, `not`, `if`/`then`, `dependentRequired`) or an unknown `format` is an error
  naming it (a 400 here), never ignored.
- xgrammar 0.2.9: requires torch, transformers and (on Linux x86_64) triton, so it cannot join a venv that pins torch
  2.13.0 CPU without pip resolving a second torch stack; ruled out before measuring.
- outlines-core 0.2.14: a 2.3 MB wheel with no dependencies, and allowed-token lists read from a precomputed index,
  but the index is a DFA over the whole vocabulary built per schema: 1.1 s on 49K and 2.6 s on 152K tokens for the
  schema above, paid by the first request of every new schema; schemas go through a regular expression, so
  recursive schemas are out of reach.

Whitespace is fixed: items separated by ", ", keys by ": ", no other whitespace (llguidance's
`whitespace_flexible` false). With flexible whitespace a model can spend every remaining token on blanks and never
close the document (a known failure of small models); fixed separators bound the length of the output of a bounded
schema and read like the JSON models are trained on.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np

from omnijax.models.tokenizer import Tokenizer
from omnijax.serve.engine.constraint import mask_words

__all__ = ["FORMATS", "JSON_OBJECT", "JSON_OPTIONS", "FormatError", "Grammar", "JsonConstraint", "ResponseFormat",
           "compile_format", "parse_response_format", "token_bytes"]

FORMATS = ("text", "json_object", "json_schema")
# llguidance's JSON compile options, over any the schema sets (its "x-guidance"): fixed whitespace (module docstring).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class FormatError(ValueError):
    """A `response_format` the server refuses; `param` names the field (`response_format...`), `code` the OpenAI
    error code ("invalid_value", "unknown_parameter" or "unsupported")."""

    def __init__(self, message: str, param: str = "response_format", code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


@dataclasses.dataclass(frozen=True)
class ResponseFormat:
    """A parsed `response_format` that constrains the output (`text` parses to None).

    Attributes:
        type: "json_object" or "json_schema".
        schema: the JSON schema as compact JSON text, its keys in the order given (properties are written in that
            order); `{"type":"object"}` for `json_object`.
        name: `json_schema.name` (None for `json_object`).
        strict: `json_schema.strict` as given (the output is constrained to the schema either way).
    """

    type: str
    schema: str
    name: str | None = None
    strict: bool | None = None


JSON_OBJECT = ResponseFormat("json_object", '{"type":"object"}')  # what `{"type": "json_object"}` parses to


def parse_response_format(value: Any) -> ResponseFormat | None:
    """Validates a request's `response_format`: None or `{"type": "text"}` (no constraint), `{"type":
    "json_object"}`, or `{"type": "json_schema", "json_schema": {"name", "schema", "strict"?}}` (OpenAI's fields).

    Raises:
        FormatError: a wrong type, an unknown or missing field, a name OpenAI would refuse, a schema that is not a
            JSON object, or a `description` (the server does not show it to the model; omit it).
    """
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in FORMATS:
        got = value.get("type") if isinstance(value, dict) else value
        raise FormatError(f"'response_format.type' must be one of {', '.join(map(repr, FORMATS))}, got {got!r}",
                          "response_format.type" if isinstance(value, dict) else "response_format")
    kind = value["type"]
    _known(value, ("type", "json_schema") if kind == "json_schema" else ("type",), "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT
    spec = value.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise FormatError(f"'{where}' must be an object with 'name' and 'schema'", where)
    _known(spec, ("name", "schema", "strict", "description"), where)
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise FormatError(f"'{where}.name' must be 1-64 letters, digits, '_' or '-', got {name!r}", where + ".name")
    if spec.get("description") not in (None, ""):
        raise FormatError(f"'{where}.description' is not supported: the server constrains the output to the schema "
                          f"but does not show the model a description; omit it or put it in a message",
                          where + ".description", "unsupported")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise FormatError(f"'{where}.strict' must be a boolean, got {strict!r}", where + ".strict")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise FormatError(f"'{where}.schema' must be a JSON schema object, got "
                          f"{'nothing' if schema is None else type(schema).__name__}", where + ".schema")
    return ResponseFormat("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False), name, strict)


def _known(obj: dict, keys: tuple, where: str) -> None:
    for key in obj:
        if key not in keys:
            raise FormatError(f"unknown parameter '{where}.{key}': {where} takes {', '.join(keys)}",
                              f"{where}.{key}", "unknown_parameter")


def _byte_table() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): printable character -> the byte it stands for."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in kept}
    shifted = (b for b in range(256) if b not in set(kept))
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


_BYTES = _byte_table()
_TO_LATIN1 = str.maketrans({c: chr(b) for c, b in _BYTES.items()})  # byte-level text -> one char per byte


def _decoder_steps(spec: dict | None) -> list[dict]:
    if spec is None:
        return []
    if spec.get("type") == "Sequence":
        return [step for part in spec.get("decoders", []) for step in _decoder_steps(part)]
    return [spec]


def _piece_bytes(piece: str, steps: list[dict]) -> bytes:
    """One vocabulary entry's bytes, by the decoder's per-token steps in order."""
    out: str | bytes = piece
    for step in steps:
        kind = step.get("type")
        if isinstance(out, bytes):
            break
        if kind == "ByteFallback" and (m := _BYTE_TOKEN.fullmatch(out)):
            out = bytes([int(m.group(1), 16)])
        elif kind == "Replace" and "String" in step.get("pattern", {}):
            out = out.replace(step["pattern"]["String"], step["content"])
        elif kind == "Metaspace":
            out = out.replace(step.get("replacement", "\u2581"), " ")
        elif kind == "ByteLevel":
            mapped = out.translate(_TO_LATIN1)
            out = (mapped.encode("latin-1") if all(c in _BYTES for c in out)
                   else b"".join(bytes([_BYTES[c]]) if c in _BYTES else c.encode() for c in out))
    return out if isinstance(out, bytes) else out.encode()


_DIGESTS: weakref.WeakKeyDictionary[Tokenizer, str] = weakref.WeakKeyDictionary()
_DIGESTS_LOCK = threading.Lock()


class _Keyed:
    """A tokenizer as a cache key: equal to (and hashed as) any tokenizer whose backend serialises to the same
    `tokenizer.json` text (its SHA-256, computed once per `Tokenizer` object), so that every `Tokenizer` read from
    the same files, in any server or caller of this process, shares one token table, one llguidance tokenizer and
    one compiled matcher per schema. What is cached from it (token bytes, special ids, the trie, the encoder the
    grammar calls) is a function of that serialisation alone; `tokenizer` is the first object seen, kept for
    building. A backend changed after its first use here (`add_tokens`, ...) is outside this contract, as it is for
    `Tokenizer.vocab_size`."""

    __slots__ = ("digest", "tokenizer")

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        with _DIGESTS_LOCK:
            digest = _DIGESTS.get(tokenizer)
        if digest is None:  # ~0.05 s for a 152K vocabulary, outside the lock
            digest = hashlib.sha256(tokenizer.backend.to_str().encode()).hexdigest()
            with _DIGESTS_LOCK:
                _DIGESTS[tokenizer] = digest
        self.digest = digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Keyed) and other.digest == self.digest


def token_bytes(tokenizer: Tokenizer, vocab_size: int = 0) -> tuple[list[bytes], frozenset[int]]:
    """`(bytes of every id below the tokenizer's size or `vocab_size`, the special ids)`: what each token writes into
    the output, read from `tokenizer.json`'s vocabulary through its decoder's per-token steps (byte-level BPE,
    SentencePiece's byte fallback and meta-space); added tokens are their text; ids without a token are empty (never
    allowed). Checked against the tokenizer's own decoding of every token that is whole UTF-8.

    The table (~1 s for a 152K vocabulary) is built once per process for each `tokenizer.json` content and width
    (the last 4 kept); each call returns its own list.

    Raises:
        ValueError: a decoder whose tokens cannot be mapped to bytes, or a token whose mapped bytes differ from its
            decoding.
    """
    table, specials = _token_table(_Keyed(tokenizer), int(vocab_size))
    return list(table), specials


@functools.lru_cache(maxsize=4)
def _token_table(key: _Keyed, vocab_size: int) -> tuple[tuple[bytes, ...], frozenset[int]]:
    """`token_bytes` of `key`'s tokenizer, built (and checked) once per tokenizer content and width."""
    tokenizer = key.tokenizer
    backend = tokenizer.backend
    steps = _decoder_steps(json.loads(backend.to_str()).get("decoder"))
    unknown = {s.get("type") for s in steps} - {"ByteLevel", "ByteFallback", "Replace", "Metaspace", "Fuse", "Strip"}
    if unknown:
        raise ValueError(f"structured output cannot map the tokens of {tokenizer.source or 'this tokenizer'} to "
                         f"bytes: its decoder has {sorted(map(str, unknown))}")
    added = backend.get_added_tokens_decoder()
    vocab = backend.get_vocab(with_added_tokens=False)
    # `tokenizer.vocab_size` (1 + the largest id, ordinary or added) from the dictionary at hand, not a second one
    out = [b""] * max(1 + max([*vocab.values(), *added], default=-1), vocab_size)
    if [step.get("type") for step in steps] == ["ByteLevel"] and _BYTES.keys() >= set("".join(vocab)):
        # byte-level BPE alone (Qwen's, SmolLM2's, GPT-2's) and every piece in its alphabet: `_piece_bytes`' own
        # ByteLevel step, without its per-piece checks (~3x faster on 152K pieces)
        for piece, i in vocab.items():
            out[i] = piece.translate(_TO_LATIN1).encode("latin-1")
    else:
        for piece, i in vocab.items():
            out[i] = _piece_bytes(piece, steps)
    for i, token in added.items():
        out[i] = token.content.encode()
    specials = frozenset(i for i, t in added.items() if t.special)
    whole = [i for i, b in enumerate(out) if b and i not in specials and _utf8(b)]
    texts = backend.decode_batch([[i] for i in whole], skip_special_tokens=False)
    wrong = [(i, out[i], t) for i, t in zip(whole, texts)
             if t != (s := out[i].decode()) and not (s.startswith(" ") and t == s[1:])]
    if wrong:
        raise ValueError(f"structured output: {len(wrong)} tokens of {tokenizer.source or 'this tokenizer'} decode "
                         f"differently from their vocabulary entries, e.g. {wrong[:3]}")
    return tuple(out), specials


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


class _Vocabulary:
    """The tokenizer as llguidance's `TokenizerWrapper` reads it: token bytes, special ids, an encoder."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos: int):
        self.tokens, self.special_token_ids = token_bytes(tokenizer, vocab_size)
        self.special_token_ids = sorted(self.special_token_ids)
        self.eos_token_id, self.bos_token_id = eos, None
        self._tokenizer = tokenizer

    def __call__(self, text: bytes | str) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)


def _llguidance() -> Any:
    """The llguidance module; a `FormatError` naming the extra to install when it is missing."""
    try:
        import llguidance  # optional: the serve extra (structured output only)
    except ImportError:
        raise FormatError("'response_format' json_object / json_schema needs the llguidance package: pip install "
                          "'omnijax[serve]'", code="unsupported") from None
    return llguidance


@functools.lru_cache(maxsize=4)
def _ll_tokenizer(key: _Keyed, vocab_size: int, stop_ids: tuple[int, ...]) -> Any:
    """llguidance's tokenizer (its token trie; ~0.5 s for 49K tokens, ~1 s for 152K), once per tokenizer content."""
    llguidance = _llguidance()
    wrapper = llguidance.TokenizerWrapper(_Vocabulary(key.tokenizer, vocab_size, stop_ids[0]))
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=list(stop_ids))


@functools.lru_cache(maxsize=128)
def _compiled(key: _Keyed, vocab_size: int, stop_ids: tuple[int, ...], schema: str) -> Any:
    """The schema's matcher at the start of a document (`llguidance.LLMatcher`), compiled once per schema and
    tokenizer content."""
    llguidance = _llguidance()
    ll = _ll_tokenizer(key, vocab_size, stop_ids)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    error = llguidance.LLMatcher.validate_grammar(grammar, ll)
    if error:
        raise FormatError(f"'response_format.json_schema.schema' cannot be compiled: {error.strip()}",
                          "response_format.json_schema.schema")
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    if matcher.is_error():
        raise FormatError(f"'response_format.json_schema.schema' cannot be compiled: {matcher.get_error()}",
                          "response_format.json_schema.schema")
    return matcher


class Grammar:
    """A response format compiled for one tokenizer: `constraint()` starts one response's `JsonConstraint`."""

    def __init__(self, fmt: ResponseFormat, matcher: Any, vocab_size: int):
        self.format, self.vocab_size = fmt, vocab_size
        self._matcher, self._lock = matcher, threading.Lock()

    def constraint(self) -> JsonConstraint:
        """A fresh constraint at the start of the document (a copy of the compiled matcher)."""
        with self._lock:
            return JsonConstraint(self._matcher.deep_copy(), self.vocab_size)


def compile_format(fmt: ResponseFormat, tokenizer: Tokenizer, vocab_size: int, stop_ids: Iterable[int]) -> Grammar:
    """Compiles `fmt` for a model's tokenizer (cached per schema and tokenizer content; blocking: call it from a
    worker thread).

    Args:
        fmt: the parsed `response_format`.
        tokenizer: the served model's tokenizer.
        vocab_size: the width of the model's logits (ids past the tokenizer's are never allowed).
        stop_ids: the tokens that end an answer (allowed exactly where the document may end).

    Raises:
        FormatError: a schema llguidance cannot compile (`response_format.json_schema.schema`, its message kept).
        ValueError: a tokenizer whose tokens cannot be mapped to bytes (`token_bytes`).
    """
    stops = tuple(sorted({int(t) for t in stop_ids}))
    if not stops:
        raise ValueError("structured output needs at least one stop token to end the document")
    return Grammar(fmt, _compiled(_Keyed(tokenizer), int(vocab_size), stops, fmt.schema), int(vocab_size))


class JsonConstraint:
    """One response's grammar state: `bitmask()` of the next allowed tokens, `accept(token)`, `finished()` (an
    `omnijax.serve.engine.constraint.TokenConstraint`; used from one thread at a time)."""

    def __init__(self, matcher: Any, vocab_size: int):
        self._matcher = matcher  # an `llguidance.LLMatcher` of its own
        self._mask = np.zeros(mask_words(vocab_size), np.int32)  # [ceil(V / 32)]

    def bitmask(self) -> np.ndarray:
        """int32 `[ceil(V / 32)]`: bit `j % 32` of word `j // 32` set when token `j` may come next."""
        self._raise_on_error()
        self._matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)  # writes the whole mask
        return self._mask.copy()

    def accept(self, token: int) -> None:
        """Advances past `token`; ValueError when the grammar does not allow it."""
        if not self._matcher.consume_token(int(token)):
            raise ValueError(f"token {int(token)} is not allowed by the response format: {self._matcher.get_error()}")

    def finished(self) -> bool:
        """Whether the document is complete (nothing but an end-of-answer token may follow)."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    def accepting(self) -> bool:
        """Whether the document may end here (an end-of-answer token is allowed)."""
        return self._matcher.is_accepting()

    def _raise_on_error(self) -> None:
        if self._matcher.is_error():
            raise ValueError(f"the response format's grammar failed: {self._matcher.get_error()}")
