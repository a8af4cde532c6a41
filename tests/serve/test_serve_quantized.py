"""`omnijax serve` with a quantised checkpoint (issue 41): the demo chat checkpoint converted with `--quantize int8`
and `--quantize int4 --group-size 32`, and the tiny Qwen3-Omni MoE thinker with `--quantize int4` (experts too), are
served with their weights still quantised, and answer through the official openai SDK (whole and streamed) what
`omnijax.Chat` answers in process on the same quantised model; the `omnijax serve` command line itself loads an int4
checkpoint and answers alike."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="the openai SDK (the `test` extra) is the client")
pytest.importorskip("websockets", reason="websockets (the `serve` and `test` extras) runs the server")

import omnijax  # noqa: E402
from omnijax.convert import QuantizeOptions, convert_checkpoint  # noqa: E402
from omnijax.decoding import RowSampling  # noqa: E402
from omnijax.kernels.quant import QuantizedWeight  # noqa: E402
from omnijax.retention import SinkWindow  # noqa: E402
from omnijax.serve.app import BackgroundServer, build_context  # noqa: E402
from omnijax.serve.context import ServeOptions  # noqa: E402
from tests._support import ROOT  # noqa: E402
from tests._support.demo_server import demo_checkpoint  # noqa: E402

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERTS = ("expert_gate", "expert_up", "expert_down")
OPTIONS = {"int8": QuantizeOptions("int8"), "int4_g32": QuantizeOptions("int4", 32)}
QUESTION = "Tell me about the quick brown fox."


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The demo chat source converted float, int8 and int4 g32: name -> directory. The float one is the process's
    demo checkpoint (`build_demo_model`, converted once per process and shared with the other serving modules); the
    quantised ones convert its source."""
    root = tmp_path_factory.mktemp("served_quantized")
    flt = Path(demo_checkpoint())
    hf = flt.parent / "hf"  # where build_demo_model wrote the source (demo.write_chat_checkpoint)
    out = {"float": flt}
    for name, options in OPTIONS.items():
        out[name] = convert_checkpoint(hf, root / name, progress=False, log=lambda _: None, quantize=options)
    return out


def _stream_config():
    return omnijax.StreamConfig(policy=SinkWindow(sink=16, window=1024), num_pages=32, page_size=16,
                                max_answer_tokens=4)


# The engine as `test_the_command_line_serves_an_int4_checkpoint` starts `omnijax serve` (`--pages 32 --page-size 16
# --answer-tokens 4 --chunk-tokens 64 --buckets 1 2 --no-per-token`, its default decoding), so that the command line's
# process finds the int4 engine's programs in the persistent compilation cache instead of compiling them again.
SERVE_DECODING = RowSampling(temperature=0.0, top_p=1.0, seed=0)
CHUNK_TOKENS, BUCKETS = 64, (1, 2)


@pytest.fixture(scope="module")
def qwen3_moe_int4(tmp_path_factory):
    """The tiny Qwen3-Omni thinker (MoE layers of 8 experts beside a dense one) converted with `--quantize int4`:
    attention, dense MLP and expert stacks quantised."""
    pytest.importorskip("torch", reason="torch (the test extra) builds the tiny Hugging Face thinker")
    from tests._support import qwen3_omni_models as Q

    root = tmp_path_factory.mktemp("served_qwen3_int4")
    src = Q.save_thinker(Q.build_thinker(seed=3, scale=0.3, audio_overrides={"num_mel_bins": 128}), root / "hf")
    Q.write_tokenizer(src)
    return convert_checkpoint(src, root / "int4", progress=False, log=lambda _: None, quantize=OPTIONS["int4_g32"])


@pytest.fixture(scope="module", params=[*OPTIONS, "qwen3_moe_int4_g32"])
def served(request, checkpoints):
    path = (request.getfixturevalue("qwen3_moe_int4") if request.param == "qwen3_moe_int4_g32"
            else checkpoints[request.param])
    model = omnijax.load(path)
    frame_ms = 200 if request.param.startswith("qwen3") else 1000  # as test_openai_families serves each family
    context = build_context(model, options=ServeOptions(port=0, frame_ms=frame_ms, max_output_tokens=16),
                            stream=_stream_config().replace(decoding=SERVE_DECODING), chunk_tokens=CHUNK_TOKENS,
                            buckets=BUCKETS, aimd_target=0)
    with BackgroundServer(context) as server:
        yield request.param, model, server


def _chat_answer(model, max_tokens: int) -> str:
    chat = omnijax.Chat(model, _stream_config())
    return "".join(chat.ask(QUESTION, max_tokens=max_tokens))


def test_the_server_holds_the_weights_quantised(served, checkpoints):
    """What the server runs is the quantised model: every linear weight a `QuantizedWeight` of the manifest's scheme
    (no float copy made at load or warm-up)."""
    name, model, server = served
    moe = name.startswith("qwen3_moe")
    linear = (*LINEAR, *EXPERTS) if moe else LINEAR
    found = _linear_leaves(server.context.model)
    assert sorted(found) == sorted(linear)
    for n, leaves in found.items():  # stacked over layers, or one per layer (per-layer storage)
        assert leaves and all(isinstance(qw, QuantizedWeight) for qw in leaves), n
        assert {qw.scheme.bits for qw in leaves} == {8 if name == "int8" else 4}, n
    if not moe:
        manifest = json.loads((checkpoints[name] / "omnijax.json").read_text())["quantization"]
        assert sorted(manifest) == sorted(f"layers.{n}" for n in LINEAR)


def _linear_leaves(model) -> dict:
    """The decoder's linear weights by name: every leaf under a linear's name (stacked or per-layer layout)."""
    import jax
    from flax import nnx

    pure = nnx.to_pure_dict(nnx.state(model.decoder))
    found: dict = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(pure, is_leaf=lambda a: isinstance(a, QuantizedWeight))[0]:
        names = [getattr(k, "key", None) for k in path]
        for n in (*LINEAR, *EXPERTS):
            if n in names:
                found.setdefault(n, []).append(leaf)
    return found


def test_chat_completions_answer_as_the_in_process_chat(served, checkpoints):
    """Whole and streamed chat completions through the SDK equal `Chat.ask` on the same quantised model (greedy), and
    the quantised answer is not the float model's (the quantisation changed something the client sees)."""
    name, model, server = served
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300.0)
    messages = [{"role": "user", "content": QUESTION}]
    want = _chat_answer(model, 12)
    assert want
    whole = client.chat.completions.create(model="omnijax", messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == want, name
    stream = client.chat.completions.create(model="omnijax", messages=messages, max_tokens=12, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want, name


def test_quantised_answers_differ_from_float_somewhere(checkpoints):
    """The oracle above would pass vacuously if quantisation changed nothing: the int4 model's logits differ from the
    float model's (by 3.2 of a 5.1 peak on these random weights)."""
    import numpy as np

    flt, q4 = omnijax.load(checkpoints["float"]), omnijax.load(checkpoints["int4_g32"])
    ids = np.asarray(flt.tokenizer.encode(QUESTION))[None]
    a, b = np.asarray(flt(input_ids=ids)), np.asarray(q4(input_ids=ids))
    diff = np.abs(a - b).max()
    assert diff > 1e-2, diff


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_command_line_serves_an_int4_checkpoint(checkpoints):
    """`omnijax serve CKPT` (the command line, its own process) loads the int4 checkpoint, warms up and answers a
    chat completion through the SDK with `Chat`'s greedy answer under the same settings."""
    path, port = checkpoints["int4_g32"], _free_port()
    command = [sys.executable, "-m", "omnijax.cli", "serve", str(path), "--port", str(port), "--pages", "32",
               "--page-size", "16", "--answer-tokens", "4", "--chunk-tokens", str(CHUNK_TOKENS), "--buckets",
               *map(str, BUCKETS), "--no-per-token", "--warmup-sessions", "1", "--aimd-target", "0"]
    # the test process's matmul precision, so that the served programs are the ones the fixture above compiled
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_DEFAULT_MATMUL_PRECISION="highest")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    try:
        lines, deadline = [], time.monotonic() + 600
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("omnijax serve:"):
                break
        assert lines and lines[-1].startswith(f"omnijax serve: {path}"), "".join(lines)[-3000:]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=3,
                               timeout=300.0)
        got = client.chat.completions.create(model="omnijax", messages=[{"role": "user", "content": QUESTION}],
                                             max_tokens=12)
        model = omnijax.load(path)
        assert got.choices[0].message.content == _chat_answer(model, 12)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
