"""`POST /v1/completions` through the official openai SDK (`client.completions.create`), on one demo-model server:
prompt log-probabilities checked against transformers, lm-eval's log-likelihood request, generation whole and
streamed, stop strings, several prompts, bad input refused by name; the bounded queue before a 429 (completions and
chat); a wrong model name refused alike on every route, and Realtime input transcription refused by name."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the openai SDK (the `test` extra) is the client")
httpx = pytest.importorskip("httpx", reason="httpx (the openai SDK's HTTP client) is the test client")
pytest.importorskip("websockets", reason="websockets (the `serve` and `test` extras) runs the server")

from tests._support.demo_server import FRAME_MS, demo_server, transformers_logprobs  # noqa: E402

TEXT = "hello world, the quick brown fox jumps"


@pytest.fixture(scope="module")
def served():
    """The demo model with per-request sampling (RowSampling, as `omnijax serve` runs)."""
    from omnijax.decoding import RowSampling

    with demo_server(decoding=RowSampling(), max_output_tokens=64) as server:
        yield server


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=300.0)


@pytest.fixture(scope="module")
def reference():
    """transformers' Qwen2.5-Omni thinker with the demo checkpoint's weights (its tied lm_head included): `[n, V]`
    log-probabilities of a token list."""
    pytest.importorskip("torch")
    return transformers_logprobs()


def _ids(served, text=TEXT):
    return served.context.tokenizer.encode(text)


# ------------------------------------------------------------------------------------------- prompt logprobs
def test_echo_logprobs_of_the_prompt_match_transformers(served, client, reference):
    """echo + max_tokens 0 + logprobs 3: every prompt token's log-probability and its top 3 are transformers' (full
    context), the first token's entries are null, `text_offset` locates each token in the echoed text."""
    ids = _ids(served)
    out = client.completions.create(model="omnijax", prompt=TEXT, echo=True, max_tokens=0, logprobs=3)
    choice = out.choices[0]
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0
    lp = choice.logprobs
    tok = served.context.tokenizer
    assert lp.tokens == [tok.decode([i]) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference(ids)
    want = ref[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(lp.token_logprobs[1:], want, atol=1e-3)
    for i in range(1, len(ids)):
        best = np.argsort(ref[i - 1])[::-1][:3]
        expected: dict = {}
        for t in [*best, ids[i]]:  # ids that decode alike share a key, holding the likeliest's value
            expected.setdefault(tok.decode([int(t)]), float(ref[i - 1, t]))
        assert lp.top_logprobs[i].keys() == expected.keys()
        np.testing.assert_allclose([lp.top_logprobs[i][k] for k in expected], list(expected.values()), atol=1e-3)
    assert lp.text_offset[0] == 0
    for i, start in enumerate(lp.text_offset):
        assert choice.text[start:start + len(lp.tokens[i])] == lp.tokens[i]


def test_lm_eval_loglikelihood_request(served, client):
    """lm-eval's `local-completions` log-likelihood payload (token-id prompts in a list, echo, max_tokens 1,
    logprobs 1, temperature 0, seed): the prompt's entries (the full forward's), then the generated token's (the
    engine's streamed step's, as it drew it): the greedy token, with the log-probability the full forward gives it
    after the prompt."""
    ids = _ids(served)
    out = client.completions.create(model="omnijax", prompt=[ids], echo=True, max_tokens=1, logprobs=1,
                                    temperature=0, seed=1234)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and out.usage.completion_tokens == 1
    plain = client.completions.create(model="omnijax", prompt=[ids], echo=True, max_tokens=0, logprobs=1)
    np.testing.assert_allclose(lp.token_logprobs[1:-1], plain.choices[0].logprobs.token_logprobs[1:], atol=1e-5)
    alone = client.completions.create(model="omnijax", prompt=ids, max_tokens=1, temperature=0)
    assert out.choices[0].text == served.context.tokenizer.decode(ids) + alone.choices[0].text
    assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()))  # greedy
    scores = served.context.prompt_scorer.score(list(ids) + [0])  # the full forward's prediction after the prompt
    assert lp.tokens[-1] == served.context.tokenizer.decode([int(scores.top_ids[len(ids), 0])])
    assert lp.token_logprobs[-1] == pytest.approx(float(scores.top_logprobs[len(ids), 0]), abs=1e-3)
    continuation = sum(lp.token_logprobs[len(ids) - 3:-1])  # how lm-eval sums a 3-token continuation
    assert np.isfinite(continuation) and continuation < 0


def test_a_buckets_first_scoring_runs_off_the_engine_thread(served, client, monkeypatch):
    """A length bucket's first scoring (which compiles) runs on a thread of its own, not holding the engine's ticks;
    later ones of that bucket run on the engine's thread, between ticks. The scorer refuses what it cannot score by
    name."""
    from omnijax.serve.prompt_scores import PromptScorer, bucket_length

    context = served.context
    scorer = PromptScorer(context.model, max_tokens=40)
    monkeypatch.setitem(context.__dict__, "prompt_scorer", scorer)  # a fresh one: no bucket scored yet
    through_engine = []
    in_engine = context.worker.in_engine

    async def recording(fn, *args):
        through_engine.append(getattr(fn, "__name__", ""))
        return await in_engine(fn, *args)
    monkeypatch.setattr(context.worker, "in_engine", recording)
    n = len(_ids(served))
    assert not scorer.compiled(n) and bucket_length(n) == 16 and bucket_length(17) == 32
    first = client.completions.create(model="omnijax", prompt=TEXT, echo=True, max_tokens=0, logprobs=1)
    assert "score" not in through_engine and scorer.compiled(n) and scorer.compiled(1) and not scorer.compiled(17)
    again = client.completions.create(model="omnijax", prompt=TEXT, echo=True, max_tokens=0, logprobs=1)
    assert through_engine.count("score") == 1
    assert again.choices[0].logprobs.token_logprobs == first.choices[0].logprobs.token_logprobs
    with pytest.raises(ValueError, match="--max-scored-tokens"):
        scorer.score([1] * 41)
    with pytest.raises(ValueError, match="must lie in"):
        scorer.score([1, 10 ** 9])


# -------------------------------------------------------------------------------------------------- generation
def test_generation_whole_streamed_stop_and_several_prompts(served, client):
    """A completion whole equals the same streamed; a stop string cuts it (finish_reason stop); two prompts give
    two choices equal to their single answers; generated logprobs (no echo) cover exactly the completion."""
    whole = client.completions.create(model="omnijax", prompt=TEXT, max_tokens=12, temperature=0)
    text = whole.choices[0].text
    assert whole.usage.completion_tokens >= 1 and len(text) >= 4, whole
    pieces, finish, usage = [], None, None
    for chunk in client.completions.create(model="omnijax", prompt=TEXT, max_tokens=12, temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.text)
            finish = c.finish_reason or finish
    assert "".join(pieces) == text and finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens

    stop = text[2:4]
    cut = client.completions.create(model="omnijax", prompt=TEXT, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"

    echoed = client.completions.create(model="omnijax", prompt=[TEXT, "abc def"], max_tokens=12, temperature=0,
                                       echo=True)
    other = client.completions.create(model="omnijax", prompt="abc def", max_tokens=12, temperature=0)
    assert [c.index for c in echoed.choices] == [0, 1]
    assert [c.text for c in echoed.choices] == [TEXT + text, "abc def" + other.choices[0].text]

    scored = client.completions.create(model="omnijax", prompt=TEXT, max_tokens=12, temperature=0, logprobs=2)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == text and len(lp.tokens) == scored.usage.completion_tokens
    assert all(v is not None and v <= 0 for v in lp.token_logprobs) and lp.text_offset[0] == 0
    assert all(1 <= len(top) <= 3 and v == pytest.approx(max(top.values())) for v, top in
               zip(lp.token_logprobs, lp.top_logprobs))  # greedy: the chosen token is the most likely
    tokens, values = [], []
    for chunk in client.completions.create(model="omnijax", prompt=TEXT, max_tokens=12, temperature=0, logprobs=2,
                                           stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
    assert tokens == lp.tokens and values == pytest.approx(lp.token_logprobs)


def test_streamed_echo_with_prompt_logprobs(served, client):
    ids = _ids(served)
    chunks = list(client.completions.create(model="omnijax", prompt=TEXT, echo=True, max_tokens=0, logprobs=1,
                                            stream=True))
    assert chunks[0].choices[0].text == TEXT and len(chunks[0].choices[0].logprobs.tokens) == len(ids)
    assert chunks[-1].choices[0].finish_reason == "length"


# --------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("extra, param, words", [
    ({"suffix": "end"}, "suffix", "fill-in-the-middle"),
    ({"n": 2}, "n", "one completion"),
    ({"best_of": 3}, "best_of", "one completion"),
    ({"logprobs": 6}, "logprobs", "[0, 5]"),
    ({"max_tokens": -1}, "max_tokens", ">= 0"),
    ({"prompt": []}, "prompt", "must be a string"),
    ({"prompt": ""}, "prompt", "is empty"),
    ({"prompt": [1, "a"]}, "prompt", "must be a string"),
    ({"prompt": [10 ** 9]}, "prompt", "outside the vocabulary"),
    ({"logit_bias": {"1000000000": 1}}, "logit_bias", "not a token id"),
    ({"stop": [""]}, "stop", "empty"),
    ({"frequency_penalty": 3}, "frequency_penalty", "[-2, 2]"),
    ({"echoo": True}, "echoo", "did you mean 'echo'"),
    ({"prompt": "x " * 3000, "logprobs": 1, "echo": True}, "prompt", "--max-scored-tokens"),
])
def test_bad_input_is_refused_by_name(client, extra, param, words):
    body = {"model": "omnijax", "prompt": "hi", "max_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as refusal:
        client.post("/completions", body=body, cast_to=object)
    error = refusal.value.body
    assert error["param"] == param and words in error["message"], error


# ------------------------------------------------------------------------------------------------------- queue
@contextlib.contextmanager
def _the_only_slot_held(served):
    """A native session holding the engine's only slot (the worker admits one session) until the block ends."""
    from websockets.sync.client import connect

    served.wait_idle()
    served.context.worker.max_sessions = 1
    with connect(served.native_url) as ws:
        ws.send(json.dumps({"type": "hello", "sample_rate": 16000, "frame_ms": FRAME_MS}))
        assert json.loads(ws.recv(timeout=60))["type"] == "ready"
        yield


def _wait_for(condition, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_a_request_waits_in_the_queue_then_is_served_or_refused(served, route):
    """The only slot held: a request waits (queued, not refused); the slot released, it is served. With a queue
    timeout of 0.3 s it gets a 429 with Retry-After naming the queue timeout; with 0 it is refused at once."""
    context, options = served.context, served.context.options
    body = ({"model": "omnijax", "prompt": "hi", "max_tokens": 2} if route == "completions" else
            {"model": "omnijax", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    post = lambda: httpx.post(f"{served.base_url}/{route}", json=body, timeout=120)  # noqa: E731
    try:
        with _the_only_slot_held(served):
            context.options = dataclasses.replace(options, queue_timeout_s=60.0)
            result = {}
            waiting = threading.Thread(target=lambda: result.setdefault("r", post()))
            waiting.start()
            _wait_for(lambda: context.queued == 1)
            assert "r" not in result
        waiting.join(120)  # the slot is free: the request waiting is served
        assert result["r"].status_code == 200, result["r"].text

        with _the_only_slot_held(served):
            context.options = dataclasses.replace(options, queue_timeout_s=0.3)
            start = time.monotonic()
            late = post()
            assert time.monotonic() - start >= 0.3 and late.status_code == 429
            assert "queue timeout of 0.3 s (--queue-timeout)" in late.json()["error"]["message"]
            assert int(late.headers["Retry-After"]) >= 1

            context.options = dataclasses.replace(options, queue_timeout_s=0.0)
            at_once = post()
            assert at_once.status_code == 429 and "queue timeout" not in at_once.json()["error"]["message"]
    finally:
        context.options = options
        context.worker.max_sessions = 4
        served.wait_idle()


# ---------------------------------------------------------------------------------------------- model names
def test_a_wrong_model_is_refused_alike_on_every_route(served, client):
    """chat, completions, models.retrieve, Realtime `?model=` and session.update, native `?model=`: the same code
    and the same message."""
    from websockets.sync.client import connect

    message = "model 'nope' does not exist: this server serves 'omnijax'"
    for call in (lambda: client.completions.create(model="nope", prompt="hi", max_tokens=1),
                 lambda: client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}]),
                 lambda: client.models.retrieve("nope")):
        with pytest.raises(openai.NotFoundError) as refusal:
            call()
        assert refusal.value.body["code"] == "model_not_found" and refusal.value.body["message"].startswith(message)
    ws_url = served.native_url.rsplit("/", 1)[0]
    for url in (f"{ws_url}/v1/realtime?model=nope", f"{ws_url}/session?model=nope"):
        with connect(url) as ws:  # refused on connecting: an error, then close 1008
            event = json.loads(ws.recv(timeout=60))
            error = event.get("error", event)
            assert error["code"] == "model_not_found" and error["message"].startswith(message), event
    with connect(f"{ws_url}/v1/realtime?model=omnijax") as ws:
        assert json.loads(ws.recv(timeout=60))["type"] == "session.created"
        ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime", "model": "nope"}}))
        error = json.loads(ws.recv(timeout=60))["error"]
        assert error["code"] == "model_not_found" and error["message"].startswith(message)


@pytest.mark.parametrize("session, param, code", [
    ({"audio": {"input": {"transcription": {"model": "whisper-1"}}}}, "session.audio.input.transcription",
     "unsupported"),
    ({"input_audio_transcription": {"model": "whisper-1"}}, "session.input_audio_transcription",
     "unknown_parameter"),  # the beta API's name
])
def test_realtime_input_transcription_is_refused_by_name(served, session, param, code):
    from websockets.sync.client import connect

    url = served.native_url.rsplit("/", 1)[0] + "/v1/realtime?model=omnijax"
    with connect(url) as ws:
        assert json.loads(ws.recv(timeout=60))["type"] == "session.created"
        ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime", **session}}))
        error = json.loads(ws.recv(timeout=60))["error"]
        assert error["code"] == code and error["param"] == param, error
        assert "input transcription is not supported" in error["message"], error
