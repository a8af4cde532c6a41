"""Structured output (issue 37 item 3): `response_format` json_object / json_schema compiled by llguidance into the
token constraint the engine decodes under (`omnijax.serve.structured`).

The constraint is driven by random walks: at every step a token is drawn at random among those its bitmask allows
(seeded; half the draws among the allowed tokens that close something, so that the walks end), on the demo model's
tokenizer and on SmolLM2's. Oracles: every finished walk decodes (by the tokenizer) to text that `json.loads` reads
and `jsonschema` validates against the schema; at every step the end-of-answer token is allowed exactly when the text
so far is already such a document; no id past the tokenizer's vocabulary and no other special token is ever allowed;
the token bytes the grammar matches against concatenate to what the tokenizer decodes. Bad formats are refused by
name through the official openai SDK against the in-process demo server.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

jsonschema = pytest.importorskip("jsonschema")  # the test extra: the schema validator is the oracle
pytest.importorskip("llguidance")  # the serve and test extras

from omnijax.decoding import Greedy, answer_stop_ids  # noqa: E402
from omnijax.serve.engine.constraint import unpack_allowed  # noqa: E402
from omnijax.serve.structured import (  # noqa: E402
    FormatError,
    ResponseFormat,
    compile_format,
    parse_response_format,
    token_bytes,
)
from tests._support import real_model  # noqa: E402
from tests._support.demo_server import demo_model  # noqa: E402

RUNS = 50  # random walks per schema and tokenizer
MAX_STEPS = 4000  # a walk that has not ended by then fails the test

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "kind": {"enum": ["cat", "dog", "fish"]}},
        "required": ["name", "age", "kind"], "additionalProperties": False},
    "nested_array": {"type": "object", "properties": {
        "rows": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {
                "id": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
            "required": ["id", "tags"], "additionalProperties": False}}},
        "required": ["rows"], "additionalProperties": False},
    "json_object": None,  # {"type": "json_object"}: any JSON object
    "number_pattern": {"type": "object", "properties": {
        "price": {"type": "string", "pattern": "^-?[0-9]{1,4}(\\.[0-9]{2})?$"},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "count": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["price", "ratio", "count"], "additionalProperties": False},
    "recursive_tree": {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "boolean"},
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["v"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
}


def _format(name: str) -> ResponseFormat:
    if SCHEMAS[name] is None:
        return parse_response_format({"type": "json_object"})
    return parse_response_format({"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name],
                                                                         "strict": True}})


class _Served:
    """A tokenizer as the server holds it: the tokenizer, the logits' width, the answer's stop ids."""

    def __init__(self, tokenizer, vocab_size: int, stops):
        self.tokenizer, self.vocab_size, self.stops = tokenizer, vocab_size, tuple(stops)
        self.tokens, self.specials = token_bytes(tokenizer, vocab_size)
        # tokens that close a string, an object, an array or an item: half the draws come from these
        self.closers = np.array([any(c in t for c in b'"}],') for t in self.tokens])
        self.closers[list(self.stops)] = True
        # the special ids other than the stops, as a mask over the logits' width (a walk's mask must allow none)
        self.banned = np.zeros(vocab_size, bool)
        self.banned[[i for i in self.specials - set(self.stops) if i < vocab_size]] = True
        self.banned_ids = np.flatnonzero(self.banned)


@pytest.fixture(scope="module", params=["demo", "smollm2"])
def served(request) -> _Served:
    if request.param == "demo":
        model = demo_model()
    else:
        import omnijax

        model = omnijax.load(real_model.checkpoint())  # skips (fails under `make test`) without the GGUF
    return _Served(model.tokenizer, model.config.vocab_size, answer_stop_ids(Greedy(), model.config.eos_token_ids))


_VALIDATORS: dict[int, tuple[dict, object]] = {}  # id(schema) -> (schema, its validator), built once per schema


def _validator(schema: dict):
    """The schema's `Draft202012Validator` (stateless between validations, so one serves every walk)."""
    if id(schema) not in _VALIDATORS:
        jsonschema.Draft202012Validator.check_schema(schema)  # what jsonschema.validate checks first
        _VALIDATORS[id(schema)] = (schema, jsonschema.Draft202012Validator(schema))
    return _VALIDATORS[id(schema)][1]


def _document(served: _Served, tokens: list[int], schema) -> bool:
    """Whether `tokens` decode to a complete JSON document that the schema accepts (the independent oracle)."""
    try:
        value = json.loads(served.tokenizer.decode(tokens))
    except ValueError:
        return False
    if schema is None:
        return isinstance(value, dict)
    return _validator(schema).is_valid(value)


def _walk(served: _Served, grammar, schema, rng) -> list[int]:
    """One random walk of the constraint to its end; checks every mask on the way. Returns its content tokens."""
    constraint, tokens = grammar.constraint(), []
    stops = list(served.stops)
    for _ in range(MAX_STEPS):
        allowed = unpack_allowed(constraint.bitmask(), served.vocab_size)
        ids = np.flatnonzero(allowed)
        assert ids.size and ids[-1] < served.tokenizer.vocab_size, "an id past the tokenizer's vocabulary"
        assert not allowed[served.banned_ids].any(), "a special token inside the document"
        complete = _document(served, tokens, schema)
        assert allowed[stops].all() == complete and allowed[stops].any() == complete, (
            f"end allowed {allowed[stops].tolist()} but the text so far is {'' if complete else 'not '}a document: "
            f"{served.tokenizer.decode(tokens)!r}")
        if constraint.finished():
            assert set(ids.tolist()) == set(stops), "a finished document allows only its end"
            return tokens
        pool = ids[served.closers[ids]] if rng.random() < 0.5 else ids
        token = int(rng.choice(pool if pool.size else ids))
        constraint.accept(token)
        if token in served.stops:
            assert constraint.finished()
            return tokens
        tokens.append(token)
    raise AssertionError(f"no end after {MAX_STEPS} tokens: {served.tokenizer.decode(tokens)[:200]!r}")


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_random_walks_decode_to_documents_the_schema_accepts(served, name):
    grammar = compile_format(_format(name), served.tokenizer, served.vocab_size, served.stops)
    rng = np.random.default_rng(sorted(SCHEMAS).index(name))
    schema = SCHEMAS[name]
    lengths = []
    for _ in range(RUNS):
        tokens = _walk(served, grammar, schema, rng)
        value = json.loads(served.tokenizer.decode(tokens))
        if schema is not None:
            _validator(schema).validate(value)  # jsonschema.validate(value, schema, cls=Draft202012Validator)
        else:
            assert isinstance(value, dict)
        lengths.append(len(tokens))
    assert len(set(lengths)) > 1  # the walks differ


def test_token_bytes_concatenate_to_the_decoded_text(served):
    """The bytes the grammar matches tokens against, concatenated, are what the tokenizer decodes (random sequences
    of ordinary tokens, whose pieces of UTF-8 characters only make sense together)."""
    tokens, specials = served.tokens, served.specials  # token_bytes(served.tokenizer, served.vocab_size)
    assert len(tokens) == served.vocab_size and set(served.stops) <= specials
    ordinary = np.array([i for i, t in enumerate(tokens) if t and i not in specials])  # drawn from 200 times
    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = [int(i) for i in rng.choice(ordinary, size=8)]
        data = b"".join(tokens[i] for i in ids)
        assert data.decode("utf-8", "replace") == served.tokenizer.decode(ids)


@pytest.mark.parametrize("value, param, code", [
    ("json", "response_format", "invalid_value"),
    ({"type": "json"}, "response_format.type", "invalid_value"),
    ({"type": "text", "strict": True}, "response_format.strict", "unknown_parameter"),
    ({"type": "json_object", "schema": {}}, "response_format.schema", "unknown_parameter"),
    ({"type": "json_schema"}, "response_format.json_schema", "invalid_value"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema", "invalid_value"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "response_format.json_schema.schema",
     "invalid_value"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name", "invalid_value"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "response_format.json_schema.name",
     "invalid_value"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
     "response_format.json_schema.strict", "invalid_value"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "description": "A person."}},
     "response_format.json_schema.description", "unsupported"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "schemas": {}}},
     "response_format.json_schema.schemas", "unknown_parameter"),
])
def test_bad_formats_are_refused_by_name(value, param, code):
    with pytest.raises(FormatError) as e:
        parse_response_format(value)
    assert (e.value.param, e.value.code) == (param, code), str(e.value)


def test_text_and_the_parsed_formats():
    assert parse_response_format(None) is None and parse_response_format({"type": "text"}) is None
    assert parse_response_format({"type": "json_object"}) == ResponseFormat("json_object", '{"type":"object"}')
    fmt = parse_response_format({"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object", "properties": {"z": {}, "a": {}}}, "strict": False}})
    assert fmt.name == "p" and fmt.strict is False
    assert list(json.loads(fmt.schema)["properties"]) == ["z", "a"]  # the order given is the order written


@pytest.mark.parametrize("schema, says", [
    ({"type": "strng"}, "strng"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}, "look"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),  # not implemented by llguidance: refused, not ignored
])
def test_schemas_llguidance_cannot_compile_name_the_schema(served, schema, says):
    fmt = parse_response_format({"type": "json_schema", "json_schema": {"name": "bad", "schema": schema}})
    with pytest.raises(FormatError) as e:
        compile_format(fmt, served.tokenizer, served.vocab_size, served.stops)
    assert e.value.param == "response_format.json_schema.schema" and says in str(e.value), str(e.value)


def test_token_bytes_of_a_sentencepiece_style_tokenizer():
    """The decoders besides byte-level BPE (Llama 2's and Mistral's kind: `▁` for a space, `<0xNN>` byte-fallback
    tokens, fused, the first space stripped): named pieces map to their bytes, and random sequences of tokens (byte
    tokens in whole UTF-8 pairs) concatenate to what the tokenizer decodes."""
    import tokenizers

    from omnijax.models.tokenizer import Tokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("\u2581hello", "\u2581world", "\u2581", "ello", "wor", "ld", "h", "é", "\u2581{", "}"):
        vocab[piece] = len(vocab)
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    D = tokenizers.decoders
    backend.decoder = D.Sequence([D.Replace("\u2581", " "), D.ByteFallback(), D.Fuse(), D.Strip(" ", 1, 0)])
    tokenizer = Tokenizer(backend)
    tokens, specials = token_bytes(tokenizer)
    assert specials == {0, 1, 2} and len(tokens) == len(vocab)
    named = (tokens[vocab["\u2581hello"]], tokens[vocab["<0x41>"]], tokens[vocab["é"]])
    assert named == (b" hello", b"A", "é".encode())
    units = [[vocab[p]] for p in vocab if not p.startswith("<")] + [[vocab["<0xC3>"], vocab["<0xA9>"]],
                                                                    [vocab["<0x41>"]], [vocab["<0x0A>"]]]
    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = [i for k in rng.integers(len(units), size=6) for i in units[k]]
        text = b"".join(tokens[i] for i in ids).decode()
        assert tokenizer.decode(ids) == (text[1:] if text.startswith(" ") else text), ids


def test_tokenizer_tables_are_shared_by_content_only(tmp_path):
    """The token tables, llguidance tokenizers and compiled matchers are cached per tokenizer content: two
    `Tokenizer` objects read from the same files share one build (the caches' own miss counts); a tokenizer whose
    files differ by one special token gets its own table, which holds that token; a caller's list is its own; the
    tables kept are bounded. Oracle for a shared table: the same table built again, uncached, from the other
    object."""
    from omnijax.models.tokenizer import Tokenizer, write_tiny_tokenizer
    from omnijax.serve import structured

    def read(name: str, specials: dict[str, int]) -> Tokenizer:
        folder = write_tiny_tokenizer(tmp_path / name, vocab_size=300, special_tokens=specials, chat_template=None)
        return Tokenizer.from_directory(folder)

    base = {"<|im_end|>": 297}
    one, two, other = read("a", base), read("b", base), read("c", {**base, "<|x|>": 299})
    tables, tries = structured._token_table.cache_info().misses, structured._ll_tokenizer.cache_info().misses
    fmt = parse_response_format({"type": "json_object"})
    first = compile_format(fmt, one, 300, [297])
    second = compile_format(fmt, two, 300, [297])
    assert second._matcher is first._matcher  # one compiled matcher for the same content
    assert structured._ll_tokenizer.cache_info().misses == tries + 1
    mine, specials = token_bytes(two, 300)
    assert structured._token_table.cache_info().misses == tables + 1  # built for `one`'s trie, reused for `two`
    fresh = structured._token_table.__wrapped__(structured._Keyed(two), 300)  # built again, uncached, for `two`
    assert (mine, specials) == (list(fresh[0]), fresh[1])
    assert mine[297] == b"<|im_end|>" and specials == {297} and mine[299] == b""  # no token 299 in these files
    mine[0] = b"changed"
    assert token_bytes(one, 300)[0][0] == one.decode([0]).encode() != b"changed"  # the cached table is untouched
    theirs, their_specials = token_bytes(other, 300)
    assert structured._token_table.cache_info().misses == tables + 2
    assert theirs[299] == b"<|x|>" and their_specials == {297, 299}
    assert compile_format(fmt, other, 300, [297])._matcher is not first._matcher
    assert structured._token_table.cache_info().currsize <= structured._token_table.cache_info().maxsize == 4


# Through the official openai SDK against the demo server (random weights: the answers are garbage, but constrained).
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pet": {"enum": ["cat", "dog", "fish"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "pet", "tags", "ok"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def server():
    openai = pytest.importorskip("openai")
    from omnijax.decoding import RowSampling
    from tests._support.demo_server import demo_server

    # two rows: the clients below send one request at a time, with at most n=2 choices
    with demo_server(decoding=RowSampling(seed=7), buckets=(2,)) as running:
        running.client = openai.OpenAI(base_url=running.base_url, api_key="none", max_retries=0)
        yield running


@pytest.mark.parametrize("response_format, param, says", [
    ({"type": "json"}, "response_format.type", "must be one of"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "strng"}}},
     "response_format.json_schema.schema", "strng"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": [PERSON]}},
     "response_format.json_schema.schema", "JSON schema object"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(?=x)"}}}}}, "response_format.json_schema.schema", "look"),
])
def test_bad_formats_are_400s_naming_the_field_through_the_sdk(server, response_format, param, says):
    """Each refused with a 400 naming the field (nothing fed, no session left open), and the server answers the
    next request."""
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(model="omnijax", messages=ASK, max_tokens=4,
                                              response_format=response_format)
    assert e.value.status_code == 400 and e.value.param == param and says in e.value.message, e.value.message
    assert not server.context.worker.lanes  # no session was opened for it
    assert server.client.chat.completions.create(model="omnijax", messages=ASK, max_tokens=2).choices


def _check(content: str | None, finish_reason: str) -> None:
    assert finish_reason == "stop", (finish_reason, content)
    jsonschema.validate(json.loads(content), PERSON, cls=jsonschema.Draft202012Validator)


def test_json_schema_answers_parse_and_validate_whole_and_streamed(server):
    """The demo model's random weights answer garbage, but under the schema: every choice (n 2, sampled at
    temperature 1.3 so they differ; whole and streamed) is a document that parses and validates, finish "stop"."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    contents = []
    for seed in (1, 2):
        whole = server.client.chat.completions.create(model="omnijax", messages=ASK, max_tokens=200, n=2,
                                                      temperature=1.3, seed=seed, response_format=fmt)
        assert len(whole.choices) == 2
        for choice in whole.choices:
            _check(choice.message.content, choice.finish_reason)
            contents.append(choice.message.content)
    assert len(set(contents)) > 1
    one = server.client.chat.completions.create(model="omnijax", messages=ASK, max_tokens=200, response_format=fmt)
    _check(one.choices[0].message.content, one.choices[0].finish_reason)
    for n in (1, 2):
        chunks = list(server.client.chat.completions.create(model="omnijax", messages=ASK, max_tokens=200, n=n,
                                                            temperature=1.3, seed=3, stream=True,
                                                            response_format=fmt))
        texts, reasons = [""] * n, [None] * n
        for chunk in chunks:
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                reasons[c.index] = c.finish_reason or reasons[c.index]
        for text, reason in zip(texts, reasons):
            _check(text, reason)


def test_json_object_answer_ends_as_an_object(server):
    """json_object on the demo model, steered by logit_bias (applied before the mask): '"' first, then '}', so the
    greedy answer opens the first key and closes it at once, takes a value (the model's choice among the tokens that
    start with the forced space), then closes the object: a complete JSON object that ends the answer (finish "stop")
    long before max_tokens."""
    tokenizer = demo_model().tokenizer
    quote, close = tokenizer.encode('"'), tokenizer.encode("}")
    assert len(quote) == len(close) == 1
    answer = server.client.chat.completions.create(model="omnijax", messages=ASK, max_tokens=50, temperature=0,
                                                   logit_bias={str(quote[0]): 90, str(close[0]): 80},
                                                   response_format={"type": "json_object"})
    choice = answer.choices[0]
    assert choice.finish_reason == "stop" and answer.usage.completion_tokens < 50
    value = json.loads(choice.message.content)
    assert isinstance(value, dict) and list(value) == [""], choice.message.content
