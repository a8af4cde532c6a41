"""`omnijax serve --recall` (issue 40 on the server's surfaces): the command line's settings, through `app._loaded`
(what `omnijax serve` runs once its arguments pass), serve the demo checkpoint; a chat completion through the official
`openai` SDK answers as a batch-1 `omnijax.Session` with the same `StreamConfig` (recall included) fed the same
chunks, its recall held over the answer as the worker and `Chat` hold it, and the response carries that session's
`RecallStats` beside `kv_cells` (`"omnijax": {"recall": {...}}`; each choice's with n = 2); so does a Realtime
`response.done`. Bad `--recall` values are refused by name before any model loads, and `response_format` (which the
engine cannot constrain with recall yet) per request, naming the field."""

import asyncio
import dataclasses

import numpy as np
import openai
import pytest

from omnijax.chunks.chunk import pad_chunk
from omnijax.decoding import Greedy
from omnijax.serve import app, launch
from omnijax.serve.context import ServeOptions
from omnijax.streaming.session import Session
from tests._support.demo_server import demo_checkpoint
from tests._support.openai_server import KEY, sdk_async_client, sdk_client, until

T, TAU, MAX_TOKENS = 64, 4, 10
ARGS = ["--policy", "sink_window", "--sink", "4", "--window", "40", "--pages", "32", "--page-size", "16",
        "--chunk-tokens", str(T), "--answer-tokens", str(TAU), "--buckets", "1", "2", "--warmup-sessions", "1",
        "--aimd-target", "0", "--recall", "budget=96,top_units=3"]
SYSTEM = "You keep track of numbers. " * 6
CONTEXT = ("The pass key is 7 1 4 2. Remember it, the rest is filler about grass and sky and the sea. " * 3).strip()
QUESTION = "What is the pass key?"


@pytest.fixture(scope="module")
def served():
    path = demo_checkpoint()
    args = launch.build_parser("").parse_args([path, *ARGS])
    options = ServeOptions(port=0, api_key=KEY, frame_ms=250.0, max_output_tokens=MAX_TOKENS)
    context, summary = app._loaded(path, args, options, None, 4000)
    assert "Recall(budget=96, top_units=3" in summary, summary
    with app.BackgroundServer(context) as running:
        yield context, running


def _oracle(context, messages):
    """The tokens and `RecallStats` of a batch-1 Session with the served StreamConfig (greedy, as the server's
    RowSampling at temperature 0) fed the chunks a chat completion feeds, padded to T."""
    config = context.worker.engine.config.stream.replace(decoding=Greedy())
    assert config.recall is not None
    conversation = context.conversation()
    parts = [c for role, text in messages for c in conversation.message(role, text)]
    prompt = conversation.prompt(TAU)
    session = Session(context.model, config)
    for chunk in parts:
        session.feed(pad_chunk(chunk, T))
    stop = set(context.worker.stop_ids)
    session.hold_recall()
    (chunk,), tokens = prompt.parts, []
    while True:
        asked = min(TAU, MAX_TOKENS - len(tokens))
        chunk = dataclasses.replace(pad_chunk(chunk, T), answer_tokens=np.asarray([asked], np.int32))
        new = [int(t) for t in np.asarray(session.feed(chunk).tokens[0])[:asked] if t >= 0]
        cut = next((i + 1 for i, t in enumerate(new) if t in stop), None)
        tokens += new[:cut]
        if cut is not None or not new or len(tokens) >= MAX_TOKENS:
            break
        chunk = conversation.continuation(prompt.answer_unit, asked)
    session.release_recall()
    return tokens, session.recall_stats()


def test_a_chat_completion_answers_as_a_recall_session_and_carries_its_recall_figures(served):
    context, server = served
    messages = [("system", SYSTEM), ("user", CONTEXT), ("user", QUESTION)]
    got = sdk_client(server).chat.completions.create(
        model="omnijax", messages=[{"role": r, "content": t} for r, t in messages], max_tokens=MAX_TOKENS)
    tokens, stats = _oracle(context, messages)
    figures = got.model_extra["omnijax"]["recall"]
    # the server's session evicted, stored, and recalled at the question what the oracle did
    assert figures == dataclasses.asdict(stats), (figures, stats)
    assert stats.questions == 1 and stats.captured_units > 0 and stats.recalled_cells > 0, stats
    assert got.choices[0].message.content == context.tokenizer.decode(
        [t for t in tokens if t not in context.worker.stop_ids], skip_special_tokens=True)
    assert got.usage.completion_tokens == len(tokens) > 0
    assert got.model_extra["omnijax"]["kv_cells"] > 0
    # n = 2 (forks of the prompt's session, each with its tier; greedy): each choice reports its own figures
    two = sdk_client(server).chat.completions.create(
        model="omnijax", messages=[{"role": r, "content": t} for r, t in messages], max_tokens=MAX_TOKENS, n=2)
    assert [c.message.content for c in two.choices] == [got.choices[0].message.content] * 2
    assert two.model_extra["omnijax"]["choices_recall"] == [figures] * 2 == [two.model_extra["omnijax"]["recall"]] * 2


def test_response_format_is_refused_by_name_with_recall(served):
    _, server = served
    with pytest.raises(openai.BadRequestError, match="--recall") as refused:
        sdk_client(server).chat.completions.create(model="omnijax", messages=[{"role": "user", "content": "hi"}],
                                                   response_format={"type": "json_object"})
    assert refused.value.param == "response_format"


def test_a_realtime_response_done_carries_the_recall_figures(served):
    context, server = served

    async def one():
        async with sdk_async_client(server).realtime.connect(model="omnijax") as conn:
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
            for text in (CONTEXT, QUESTION):
                await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": text}]})
            await conn.response.create(response={"max_output_tokens": MAX_TOKENS})
            return (await until(conn, "response.done"))[-1]

    done = asyncio.run(one())
    figures = done.model_extra["omnijax"]["recall"]
    assert figures["questions"] == 1 and figures["captured_units"] > 0 and figures["recalled_cells"] > 0, figures
    assert figures["stored_units"] >= figures["recalled_units"] > 0


@pytest.mark.parametrize("value, named", [
    ("budget=0", "budget must be a positive int"),
    ("top_units=4", "needs budget=CELLS"),
    ("budget=1024", "larger than the KV pool (512 cells"),
    ("budget=64,speed=3", "'speed=3' is not key=value"),
    ("budget=64,host_bytes=0", "host_bytes must be a positive int"),
    ("budget=64,keep=maybe", "keep must be true or false"),
    ("budget=64,disk_dir=/tmp/x,disk_bytes=4096 --snapshot-dir /tmp/y", "disk_dir does not work with --snapshot-dir"),
])
def test_bad_recall_values_are_refused_by_name_before_the_model_loads(value, named, tmp_path, monkeypatch, capsys):
    value, *more = value.split(" ")
    more = [m.replace("/tmp/y", str(tmp_path / "snaps")) for m in more]
    argv = ["--demo-model", "--pages", "32", "--page-size", "16", "--recall", value, *more]
    with pytest.raises(ValueError, match="--recall") as refused:
        launch.recall_option(launch.build_parser("").parse_args(argv))
    assert named in str(refused.value)
    # the command line itself: exit 2 naming the flag, before the demo model is built
    monkeypatch.setattr(app, "build_demo_model", lambda _: pytest.fail("the model was built"))
    with pytest.raises(SystemExit) as stopped:
        app.main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "--recall" in err and named in err, err
