"""Sampling parameters, logprobs and n through the official openai SDK against `omnijax serve` on the tiny demo model
(issue 37 item 1): one server (RowSampling, so every request's settings are rows of the same compiled step)."""

import math

import pytest

openai = pytest.importorskip("openai")

from omnijax.decoding import RowSampling  # noqa: E402
from tests._support.demo_server import demo_model, demo_server  # noqa: E402

ASK = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def client():
    with demo_server(decoding=RowSampling(seed=7)) as server:
        yield openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def _ask(client, **kwargs):
    kwargs.setdefault("max_tokens", 10)
    return client.chat.completions.create(model="omnijax", messages=ASK, **kwargs)


def _stream(client, **kwargs):
    kwargs.setdefault("max_tokens", 10)
    return list(client.chat.completions.create(model="omnijax", messages=ASK, stream=True, **kwargs))


def test_logprobs_whole_and_streamed(client):
    """Greedy with logprobs: each content token is the top of its raw distribution (no setting changes it), its
    alternatives come sorted, bytes are the token's UTF-8; streamed chunks carry the same entries."""
    answer = _ask(client, logprobs=True, top_logprobs=3)
    choice = answer.choices[0]
    content = choice.logprobs.content
    assert content and len(content) <= answer.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token and math.isclose(entry.top_logprobs[0].logprob,
                                                                           entry.logprob, abs_tol=1e-6)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
        assert bytes(entry.bytes) == entry.token.encode("utf-8")
    assert "".join(e.token for e in content) == choice.message.content
    chunks = _stream(client, logprobs=True, top_logprobs=3)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = _ask(client, logprobs=True)  # no alternatives asked: none listed
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    assert plain.choices[0].message.content == choice.message.content  # logprobs change no answer


def test_logit_bias_penalties_top_k_min_p_take_effect_per_request(client):
    tokenizer = demo_model().tokenizer
    plain = _ask(client).choices[0].message.content
    token = tokenizer.encode(" sea")[0]
    forced = _ask(client, logit_bias={str(token): 100}).choices[0].message.content
    assert forced == tokenizer.decode([token]) * 10  # every token is the biased one
    penalised = _ask(client, frequency_penalty=2, presence_penalty=2,
                     extra_body={"repetition_penalty": 1.5}).choices[0].message.content
    assert penalised != plain
    assert _ask(client).choices[0].message.content == plain  # the next request is unchanged by the last one's
    # top_k 1 and min_p 1 keep only the most likely token: sampling at temperature 2 is then greedy
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        hot = _ask(client, temperature=2.0, seed=3, extra_body=extra).choices[0].message.content
        assert hot == plain, extra
    assert _ask(client, temperature=2.0, seed=3).choices[0].message.content != plain


def test_n_choices_seeded_reproducible_and_streamed(client):
    answer = _ask(client, n=3, temperature=1.5, seed=11, logprobs=True)
    texts = [c.message.content for c in answer.choices]
    assert [c.index for c in answer.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert all(c.logprobs.content for c in answer.choices)
    again = _ask(client, n=3, temperature=1.5, seed=11)
    assert [c.message.content for c in again.choices] == texts  # each choice draws with its own seeded key
    one = _ask(client, temperature=1.5, seed=11)
    assert one.choices[0].message.content == texts[0]  # choice 0 is the request with n 1
    chunks = _stream(client, n=3, temperature=1.5, seed=11, stream_options={"include_usage": True})
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)]
    assert streamed == texts
    assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens
    assert answer.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted (and computed) once
    greedy = _ask(client, n=2)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


@pytest.mark.parametrize("field,value", [
    ("n", 9), ("top_logprobs", 21), ("logit_bias", {"999999": 1}), ("logit_bias", {"5": 101}),
    ("logit_bias", {"x": 1}), ("presence_penalty", 2.5), ("frequency_penalty", -3), ("top_k", -2),
    ("min_p", 1.5), ("repetition_penalty", 0), ("top_logprobs", 2)])
def test_bad_values_are_refused_naming_the_field(client, field, value):
    kwargs = {field: value} if field in ("n", "top_logprobs", "logit_bias", "presence_penalty",
                                          "frequency_penalty") else {"extra_body": {field: value}}
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == field, e.value.body
