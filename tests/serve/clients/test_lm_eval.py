"""lm-evaluation-harness 0.4.13 against `omnijax serve` (issue 37 item 7): lm-eval runs in a process of its own
(`lm_eval_run.py`, its Python API) on two small offline tasks written here (a local JSONL dataset and task YAMLs),
against the demo model served in this process, with `num_concurrent` 2:

- a multiple-choice log-likelihood task through `local-completions` (token-id prompts, `echo`, `logprobs`): the
  log-likelihoods lm-eval reports are transformers' on the same weights for the same tokens;
- a `generate_until` task through `local-chat-completions` (it sends `stop` on every request): its answers are what
  the chat route returns for the same messages and stops, each ended before a stop.

The server counts the requests it answers (a wrapper around the two routes), so every request lm-eval sent is known
to have had a 200 and two were in flight at once."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lm_eval", reason="lm-evaluation-harness (the `test` extra) is the client under test")
openai = pytest.importorskip("openai", reason="the openai SDK (the `test` extra) replays lm-eval's chat requests")
pytest.importorskip("torch", reason="transformers (the `test` extra) is the log-likelihoods' oracle")
pytest.importorskip("websockets", reason="websockets (the `serve` and `test` extras) runs the server")

from tests._support.demo_server import demo_checkpoint, demo_server, transformers_logprobs  # noqa: E402

# (question, choices, answer): 4 documents, 10 log-likelihood requests
DOCS = [("The capital of France is", ["Paris", "Berlin", "Rome"], 0),
        ("Two plus two equals", ["four", "five"], 0),
        ("The sky is", ["blue", "green", "loud"], 0),
        ("Water is", ["wet", "dry"], 0)]
GEN_DOCS = 3  # the generate_until task reads the first 3
MAX_GEN = 12  # max_gen_toks of the generate_until task
SEED = 1234  # lm-eval's default seed, sent with every request
LM_EVAL_TIMEOUT_S = 600


class RouteCounter:
    """Wraps the server's chat-completions and completions handlers (looked up per request in `omnijax.serve`'s
    modules) to count each route's answers by status and the most requests in flight at once."""

    def __init__(self) -> None:
        self.statuses: dict[str, list[int]] = {"chat": [], "completions": []}
        self.in_flight = 0
        self.peak = 0

    def wrap(self, route: str, handler):
        async def counted(request, context):
            self.in_flight += 1  # the server's event loop is one thread: no lock needed
            self.peak = max(self.peak, self.in_flight)
            try:
                response = await handler(request, context)
            finally:
                self.in_flight -= 1
            self.statuses[route].append(response.status_code)
            return response
        assert asyncio.iscoroutinefunction(handler)
        return counted


@pytest.fixture(scope="module")
def lm_eval_process(tmp_path_factory):
    """`lm_eval_run.py` started offline, importing lm-eval while the server warms up; it waits for its spec's path
    on standard input."""
    folder = tmp_path_factory.mktemp("lm_eval")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(folder / "datasets-cache"), "OPENAI_API_KEY": "unused",
           "TOKENIZERS_PARALLELISM": "false"}
    process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("lm_eval_run.py"))], env=env, text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.folder = folder  # type: ignore[attr-defined]
    yield process
    if process.poll() is None:  # a test failed before it was given its spec
        process.kill()
        process.communicate()


@pytest.fixture(scope="module")
def served(lm_eval_process):
    """The demo model with per-request sampling (RowSampling, as `omnijax serve` runs), its two OpenAI routes
    counted (`RouteCounter` as `served.counter`)."""
    from omnijax.decoding import RowSampling
    from omnijax.serve import chat_completions, completions

    counter = RouteCounter()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chat_completions, "chat_completions", counter.wrap("chat", chat_completions.chat_completions))
        patch.setattr(completions, "completions", counter.wrap("completions", completions.completions))
        # Two rows per tick (not the default four): lm-eval runs two requests at once (num_concurrent 2) and the
        # tests' own requests come one at a time, so more rows would only decode the 152K-wide lm_head for nothing.
        with demo_server(decoding=RowSampling(), max_output_tokens=64, buckets=(2,)) as server:
            server.counter = counter
            yield server


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=300.0)


def _chat(client, messages, stop=None):
    """The chat route's answer as lm-eval's `local-chat-completions` asks for it."""
    return client.chat.completions.create(model="omnijax", messages=messages, max_tokens=MAX_GEN, temperature=0,
                                          seed=SEED, stop=stop).choices[0]


def _stop_inside(text: str) -> str:
    """A one-character stop string found in `text` after its first character: printable (or a newline), not the
    replacement character a split UTF-8 sequence decodes to."""
    for ch in text[1:]:
        if ch == "\n" or (ch.isprintable() and not ch.isspace() and ch != "\ufffd"):
            return ch
    raise AssertionError(f"no usable stop string in the demo model's answer {text!r}")


@pytest.fixture(scope="module")
def stops(client):
    """The generate_until task's stop strings: one character from each document's answer without stops, so that
    every answer lm-eval gets is cut by a stop."""
    return [_stop_inside(_chat(client, [{"role": "user", "content": q}]).message.content) for q, _, _ in
            DOCS[:GEN_DOCS]]


def _task_files(folder: Path, stops: list[str]) -> None:
    """The data (JSONL) and the two tasks' YAMLs (JSON is YAML) under `folder`."""
    import yaml

    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in DOCS))
    common = {"dataset_path": "json", "test_split": "test", "doc_to_text": "{{question}}"}
    mc = {**common, "task": "omnijax_mc", "dataset_kwargs": {"data_files": {"test": str(data)}},
          "output_type": "multiple_choice", "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
          "metric_list": [{"metric": "acc"}]}
    gen_data = folder / "gen_docs.jsonl"
    gen_data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                                for q, c, a in DOCS[:GEN_DOCS]))
    gen = {**common, "task": "omnijax_gen", "dataset_kwargs": {"data_files": {"test": str(gen_data)}},
           "output_type": "generate_until", "doc_to_target": "{{choices[answer]}}",
           "generation_kwargs": {"until": stops, "max_gen_toks": MAX_GEN, "do_sample": False},
           "metric_list": [{"metric": "exact_match"}]}
    for config in (mc, gen):
        (folder / f"{config['task']}.yaml").write_text(yaml.safe_dump(config, allow_unicode=True))


@pytest.fixture(scope="module")
def lm_eval_reports(served, stops, lm_eval_process):
    """lm-eval's two runs (`lm_eval_run.py` in a subprocess, offline): [the multiple-choice run, the generate_until
    run], each `{"results", "samples"}`."""
    folder = lm_eval_process.folder
    _task_files(folder, stops)
    common = {"model": "omnijax", "num_concurrent": 2, "max_retries": 1, "seed": SEED}
    spec = {"include_path": str(folder), "out": str(folder / "reports.json"), "runs": [
        {"model": "local-completions", "tasks": ["omnijax_mc"],
         "model_args": {**common, "base_url": f"{served.base_url}/completions", "tokenizer": demo_checkpoint(),
                        "tokenizer_backend": "huggingface"}},
        {"model": "local-chat-completions", "tasks": ["omnijax_gen"], "apply_chat_template": True,
         "model_args": {**common, "base_url": f"{served.base_url}/chat/completions", "max_gen_toks": MAX_GEN}}]}
    (folder / "spec.json").write_text(json.dumps(spec))
    _, stderr = lm_eval_process.communicate(f"{folder / 'spec.json'}\n", timeout=LM_EVAL_TIMEOUT_S)
    assert lm_eval_process.returncode == 0, f"lm-eval failed (exit {lm_eval_process.returncode}):\n{stderr[-6000:]}"
    return json.loads((folder / "reports.json").read_text())


@pytest.fixture(scope="module")
def reference():
    """transformers' Qwen2.5-Omni thinker with the demo checkpoint's weights: the log-likelihood of `ids[start:]`
    after `ids[:start]`."""
    logprobs_of = transformers_logprobs()

    def loglikelihood(ids: list[int], start: int) -> float:
        logprobs = logprobs_of(ids)
        return float(sum(logprobs[i - 1, ids[i]] for i in range(start, len(ids))))
    return loglikelihood


def _arguments(sample: dict) -> list:
    """A sample's request arguments, one list per request: `[context, continuation]` or `[prompt, gen_kwargs]`."""
    args = sample["arguments"]
    if isinstance(args, dict):  # {"gen_args_0": {"arg_0": ..., "arg_1": ...}, ...}
        return [[a[k] for k in sorted(a)] for _, a in sorted(args.items(), key=lambda kv: int(kv[0].split("_")[-1]))]
    return args


def test_lm_eval_log_likelihoods_are_transformers(served, lm_eval_reports, reference):
    """The multiple-choice task: one 200 per (document, choice) from `/v1/completions`, two in flight at once, and
    each log-likelihood lm-eval reports is transformers' on the demo weights for the same context and continuation
    tokens (lm-eval's split: the context's tokens, then the whole text's tokens after as many)."""
    from transformers import AutoTokenizer

    report = lm_eval_reports[0]
    samples = sorted(report["samples"]["omnijax_mc"], key=lambda s: s["doc_id"])
    assert [s["doc"]["question"] for s in samples] == [q for q, _, _ in DOCS]
    assert served.counter.statuses["completions"] == [200] * sum(len(c) for _, c, _ in DOCS)
    assert served.counter.peak >= 2
    assert math.isfinite(report["results"]["omnijax_mc"]["acc,none"])
    tokenizer = AutoTokenizer.from_pretrained(demo_checkpoint())
    got, want = [], []
    for sample, (_, choices, _) in zip(samples, DOCS):
        requests = _arguments(sample)
        assert [cont.strip() for _, cont in requests] == choices
        assert len(sample["resps"]) == len(choices)
        for (context, continuation), resp in zip(requests, sample["resps"]):
            loglikelihood = resp[0][0]
            context_ids = tokenizer(context, add_special_tokens=False).input_ids
            whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
            got.append(float(loglikelihood))
            want.append(reference(context_ids + whole[len(context_ids):], len(context_ids)))
    assert all(math.isfinite(g) and g < 0 for g in got)
    np.testing.assert_allclose(got, want, atol=2e-3)


def test_lm_eval_generate_until_answers_are_the_chat_routes(served, client, lm_eval_reports, stops):
    """The generate_until task: one 200 per document from `/v1/chat/completions` with the task's stops, each answer
    lm-eval reports is the chat route's for the same messages, stops, max_tokens, temperature 0 and seed, and it
    ended at a stop: it is the answer without stops cut before the first stop string in it."""
    report = lm_eval_reports[1]
    samples = sorted(report["samples"]["omnijax_gen"], key=lambda s: s["doc_id"])
    assert len(samples) == GEN_DOCS
    chats_before = len(served.counter.statuses["chat"])
    for sample in samples:
        [([prompt], gen_kwargs)] = _arguments(sample)  # the prompt: a JsonChatStr, a named tuple of the JSON
        messages = json.loads(prompt)
        assert messages[-1] == {"role": "user", "content": sample["doc"]["question"]}
        assert gen_kwargs["until"] == stops
        [[answer]] = sample["resps"]
        stopped = _chat(client, messages, stop=stops)
        assert stopped.finish_reason == "stop"
        assert answer == stopped.message.content
        whole = _chat(client, messages).message.content
        cut = min(whole.index(s) for s in stops if s in whole)
        assert answer == whole[:cut]
    # lm-eval's requests: the stops fixture's GEN_DOCS, then lm-eval's GEN_DOCS, then this test's 2 per document
    assert served.counter.statuses["chat"][:chats_before] == [200] * (2 * GEN_DOCS)
