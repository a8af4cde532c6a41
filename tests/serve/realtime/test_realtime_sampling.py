"""A Realtime session's sampling settings (`session.omnijax`: temperature, top_p, seed, presence / frequency /
repetition penalties, top_k, min_p, logit_bias) reach the engine row its responses draw with, as chat completions'
do (issue 37 leftovers).

Oracles: the row chat completions builds from the same values (`omnijax.serve.chat_sampling.request_sampling`, the
path whose processors are checked against transformers'), and end to end, the answer the same server gives a chat
completion with the same message and settings (greedy, so no key is involved), which the penalties must change.
Bad values are refused by name, and a refused update changes nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import numpy as np
import pytest

from omnijax.decoding import RowSampling
from omnijax.serve.chat_sampling import request_sampling
from omnijax.serve.realtime import client_events as rte
from omnijax.serve.realtime import server_events as rse
from omnijax.serve.realtime.resume import settings_of
from omnijax.serve.realtime.sampling import check_sampling, session_row

V = 1000
ALL = {"temperature": 0.7, "top_p": 0.9, "seed": 4, "presence_penalty": 1.5, "frequency_penalty": -0.5,
       "repetition_penalty": 1.3, "top_k": 20, "min_p": 0.05, "logit_bias": {"17": 5.5, "3": -100}}


def _settings(ext: dict) -> rte.SessionSettings:
    update = rte.parse_client_event({"type": "session.update", "session": {"omnijax": ext}})
    return update.apply(rte.SessionSettings())


def test_every_setting_is_parsed_echoed_and_kept_by_a_snapshot():
    settings = _settings(ALL)
    assert settings.logit_bias == ((17, 5.5), (3, -100.0))
    assert {k: getattr(settings, k) for k in ALL if k != "logit_bias"} == {k: v for k, v in ALL.items()
                                                                           if k != "logit_bias"}
    echoed = rse.session_updated(settings)["session"]["omnijax"]
    assert echoed == {"input_audio_rate": 24000, "duplex": False, **ALL}
    # a snapshot stores the settings as JSON and reads them back by name
    assert settings_of(json.loads(json.dumps(dataclasses.asdict(settings)))) == settings


@pytest.mark.parametrize("ext, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"min_p": True}, "min_p"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": [[5, 1]]}, "logit_bias"), ({"top_logprobs": 2}, ""),
])
def test_bad_settings_are_refused_by_name(ext, param):
    with pytest.raises(rte.RealtimeEventError) as e:
        _settings(ext)
    assert e.value.param == "session.omnijax" + (f".{param}" if param else ""), e.value.param


def _chat_row(body: dict, decoding) -> np.ndarray | None:
    def refuse(*_):
        raise AssertionError("a RowSampling server checks no single strategy")
    return request_sampling(body, decoding, V, refuse).row


@pytest.mark.parametrize("ext", [
    ALL, {"presence_penalty": 2}, {"frequency_penalty": 1, "top_k": 3}, {"logit_bias": {"999": 1}},
    {"temperature": 0}, {"min_p": 0.2, "repetition_penalty": 1.1}, {"top_p": 0.5},
])
@pytest.mark.parametrize("decoding", [RowSampling(), RowSampling(temperature=0.8, top_p=0.95, top_k=40, min_p=0.1,
                                                                 repetition_penalty=1.2, seed=3)])
def test_the_session_row_is_the_chat_completions_row(ext, decoding):
    """Every setting, and the server's defaults for those not given, as chat completions' request row."""
    row = session_row(_settings(ext), decoding, V)
    assert row is not None and np.array_equal(row, _chat_row(ext, decoding))
    assert not np.array_equal(row, np.asarray(decoding.rows(1))[0]) or ext == {"temperature": decoding.temperature}


def test_no_setting_or_a_seed_alone_keeps_the_servers_row():
    assert session_row(rte.SessionSettings(), RowSampling(), V) is None
    assert session_row(_settings({"seed": 9}), RowSampling(), V) is None


def test_what_a_session_cannot_honour_is_refused_by_name():
    with pytest.raises(rte.RealtimeEventError) as e:  # a server with one strategy for every session
        check_sampling(_settings({"top_k": 5}), per_row=False, duplex=False, vocab_size=V)
    assert e.value.code == "unsupported" and e.value.param == "session.omnijax.top_k"
    with pytest.raises(rte.RealtimeEventError) as e:
        check_sampling(_settings({"logit_bias": {str(V): 1}}), per_row=True, duplex=False, vocab_size=V)
    assert e.value.code == "invalid_value" and e.value.param == "session.omnijax.logit_bias"
    assert f"{V - 1}" in e.value.message
    many = {str(i): 1 for i in range(300)}
    with pytest.raises(rte.RealtimeEventError) as e:
        check_sampling(_settings({"logit_bias": many}), per_row=True, duplex=False, vocab_size=V)
    assert e.value.param == "session.omnijax.logit_bias" and "300" in e.value.message
    # a duplex session decides with the release's greedy rule: the penalties only
    check_sampling(_settings({"presence_penalty": 1, "frequency_penalty": 0.5}), per_row=True, duplex=True,
                   vocab_size=V)
    for name in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty"):
        with pytest.raises(rte.RealtimeEventError) as e:
            check_sampling(_settings({name: ALL[name], "presence_penalty": 1}), per_row=True, duplex=True,
                           vocab_size=V)
        assert e.value.code == "unsupported" and e.value.param == f"session.omnijax.{name}", name


# ---------------------------------------------------------------------------------------------- end to end
ASK = "Tell me about the sea."


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("openai")
    from tests._support.demo_server import demo_server

    with demo_server(decoding=RowSampling(seed=7)) as running:
        yield running


async def _realtime(server, ext: dict | None, bad: dict | None = None) -> tuple[str, list]:
    """A Realtime answer to `ASK` (10 tokens at most) under `session.omnijax` `ext`; `bad` is sent first (its
    refusal events are returned)."""
    import openai

    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    async with client.realtime.connect(model="omnijax") as conn:
        assert (await conn.recv()).type == "session.created"
        refusals = []
        if bad is not None:
            await conn.session.update(session={"type": "realtime", "omnijax": bad})
            refusals.append(await conn.recv())
        if ext is not None:
            await conn.session.update(session={"type": "realtime", "omnijax": ext})
            assert (await conn.recv()).type == "session.updated"
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": ASK}]})
        await conn.response.create(response={"max_output_tokens": 10})
        async for event in conn:
            if event.type == "response.output_text.done":
                return event.text, refusals
            assert event.type != "error", event
    raise AssertionError("the connection closed before the answer")


def _chat(server, **kwargs) -> str:
    import openai

    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    answer = client.chat.completions.create(model="omnijax", messages=[{"role": "user", "content": ASK}],
                                            max_tokens=10, **kwargs)
    return answer.choices[0].message.content


def test_a_sessions_penalties_and_bias_give_the_chat_completions_answer(server):
    """Greedy under penalties and a bias: the Realtime answer is the chat completion's with the same settings, and
    not the plain greedy one (so the settings reached the row)."""
    from tests._support.demo_server import demo_model

    token = demo_model().tokenizer.encode(" sea")[0]
    settings = {"presence_penalty": 1.0, "frequency_penalty": 2.0, "repetition_penalty": 1.5, "top_k": 5,
                "logit_bias": {str(token): 4.0}}
    penalised, _ = asyncio.run(_realtime(server, {"temperature": 0, **settings}))
    chat = _chat(server, temperature=0, presence_penalty=1.0, frequency_penalty=2.0, logit_bias={str(token): 4.0},
                 extra_body={"repetition_penalty": 1.5, "top_k": 5})
    plain, _ = asyncio.run(_realtime(server, {"temperature": 0}))
    assert penalised == chat and penalised != plain, (penalised, chat, plain)
    assert plain == _chat(server, temperature=0)


def test_a_refused_update_changes_nothing(server):
    """A logit_bias id past the vocabulary is an error event naming the field; the session answers as before."""
    from tests._support.demo_server import demo_model

    vocab = demo_model().config.vocab_size
    text, refusals = asyncio.run(_realtime(server, None, bad={"temperature": 0, "frequency_penalty": 2,
                                                              "logit_bias": {str(vocab): 3}}))
    (error,) = refusals
    assert error.type == "error" and error.error.param == "session.omnijax.logit_bias", error
    assert text == asyncio.run(_realtime(server, None))[0]  # the server's own row: the update did not apply
