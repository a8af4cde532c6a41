"""Per-token streaming: the host-driven tick (`omnijax.serve.engine.decode_loop.host_tick`) draws the fused tick's
tokens, token for token, and hands each to its callback as it is decoded; token constraints
(`omnijax.serve.engine.constraint`) mask what a row may draw; through the server, a streamed chat completion read with
the official openai SDK arrives one chunk per token while a native session keeps its frames' cadence.

Tiny decoder for the engine tests (compiled: the fused step, the prefill and the token step with and without a mask,
for two strategies at bucket 4); the demo server for the HTTP tests.
"""

import dataclasses

import numpy as np
import pytest

import omnijax
from omnijax.chunks.chunk import text_chunk
from omnijax.decoding import RowSampling, Sampling, sampling_row
from omnijax.models.config import TINY_OMNI
from omnijax.retention.baselines import SinkWindow
from omnijax.serve.engine.constraint import TokenConstraint, pack_allowed, unpack_allowed
from omnijax.serve.engine.engine import Engine, EngineConfig
from tests._support import xla_flags

T, TAU, V = 8, 6, TINY_OMNI.vocab_size


@pytest.fixture(scope="module")
def decoder():
    return omnijax.Decoder(TINY_OMNI)


@pytest.fixture
def quick():
    """The engine tests compare two engines' tokens, never a time, so their programs compile quickly (LLVM
    optimisation off, `tests._support.xla_flags.quick_compile`) although this module is execution-bound for its
    served cadence test: cold, the fused, prefill and token programs of the tiny decoder took most of the module's
    compile time optimised."""
    import jax

    before = bool(jax.config.values["jax_disable_most_optimizations"])
    xla_flags.quick_compile(True)
    yield
    xla_flags.quick_compile(before)


def _config(decoding, per_token=False):
    stream = omnijax.StreamConfig(policy=SinkWindow(4, 24), num_pages=64, page_size=8, max_answer_tokens=TAU,
                                  impl="xla", decoding=decoding)
    return EngineConfig(stream, chunk_tokens=T, buckets=(4,), per_token=per_token)


# Four rows: greedy, sampled with penalties, sampled with top-k / min-p and log probabilities, default row.
ROWS = [sampling_row(0.0), sampling_row(0.9, 0.9, presence_penalty=0.8, frequency_penalty=0.5),
        sampling_row(1.1, top_k=40, min_p=0.02, repetition_penalty=1.3, top_logprobs=3), None]


def _run(decoder, config, stop_probe=False, ticks=5):
    """Ticks of four sessions with different asked counts (continuations without input between prompts); returns
    ({sid: [(tokens, logprobs), ...]}, the tokens streamed through on_token, per tick)."""
    engine, rng = Engine(decoder, config), np.random.default_rng(7)
    sids = [f"s{i}" for i in range(4)]
    for i, sid in enumerate(sids):
        engine.open(sid)
        engine.seed_session(sid, 11 + i)
    out = {sid: [] for sid in sids}
    streamed = []
    for tick in range(ticks):
        for i, sid in enumerate(sids):
            n = 0 if tick % 2 and i % 2 else int(rng.integers(3, T + 1))  # odd rows continue without input
            chunk = text_chunk(rng.integers(0, V, n), unit=tick) if n else dataclasses.replace(
                text_chunk(np.zeros(1, np.int64), unit=tick), valid=np.zeros((1, 1), bool),
                advance=np.zeros(1, np.int32))
            if ROWS[i] is not None and getattr(config.stream.decoding, "per_row", False):
                chunk = dataclasses.replace(chunk, sampling=ROWS[i][None])
            engine.submit(sid, chunk, [TAU, 2, TAU - 1, 0 if tick == 1 else TAU][i])
        got = []
        report = engine.tick(on_token=lambda sid, t, lp: got.append((sid, t, lp)) and False)
        streamed.append(got)
        for sid in sids:
            o = report.outputs[sid]
            out[sid].append((o.tokens, o.logprobs))
    return out, streamed


@pytest.mark.parametrize("decoding", [RowSampling(seed=5), Sampling(temperature=0.8, repetition_penalty=1.5, seed=2)],
                         ids=["row_sampling", "sampling"])
def test_host_driven_ticks_draw_the_fused_tokens(quick, decoder, decoding):
    """Greedy and seeded sampled rows with penalties, several asked counts, a stop token mid-answer: the host-driven
    engine's tokens and log probabilities equal the fused engine's, and on_token saw each token as decoded."""
    # The probe runs host-driven: its prefill and token programs hold no stop id (the host checks stops), so the
    # stop run below reuses them, where a fused probe would compile a fused program of its own (no stop) that no
    # assertion reads. It draws what the fused tick draws (asserted below, with the stop).
    probe, _ = _run(decoder, _config(decoding, per_token=True))
    # a stop id that the probe decodes mid-answer, so that some row stops early below
    stop = next(toks[1] for ticks in probe.values() for toks, _ in ticks if len(toks) >= 4)
    decoding = dataclasses.replace(decoding, stop=(stop,))
    fused, none_streamed = _run(decoder, _config(decoding))
    host, streamed = _run(decoder, _config(decoding, per_token=True))
    assert host == fused
    assert all(not got for got in none_streamed)  # a fused tick streams nothing
    stopped = 0
    for tick, got in enumerate(streamed):
        for sid in fused:
            tokens, logprobs = fused[sid][tick]
            assert [t for s, t, _ in got if s == sid] == tokens
            assert [lp for s, _, lp in got if s == sid] == (logprobs or [None] * len(tokens))
            stopped += bool(tokens) and tokens[-1] == stop and len(tokens) < TAU
    assert stopped >= 1  # the stop token did end a row early
    if isinstance(decoding, RowSampling):
        assert any(lps for ticks in fused.values() for _, lps in ticks)  # the logprobs row returned some


class _Digits:
    """Only the allowed `digits`, `n` of them, then the stop token; finished after it."""

    def __init__(self, digits, n, stop):
        self.digits, self.n, self.stop, self.seen = list(digits), n, stop, []

    def bitmask(self):
        return pack_allowed(self.digits if len(self.seen) < self.n else [self.stop], V)

    def accept(self, token):
        assert unpack_allowed(self.bitmask(), V)[token], f"token {token} was not allowed"
        self.seen.append(token)

    def finished(self):
        return len(self.seen) > self.n


def test_constraints_mask_the_draw_and_end_the_row(quick, decoder):
    """A constrained row draws only what its bitmask allows and ends when its constraint is finished (complete);
    an unconstrained row of the same tick draws what the fused engine draws; a constraint that raises fails its row
    only, naming the error."""
    decoding = RowSampling(seed=1)
    engine, fused = Engine(decoder, _config(decoding)), Engine(decoder, _config(decoding))
    digits = [3, 17, 99, 250, 299]
    constraint = _Digits(digits, 3, stop=5)
    assert isinstance(constraint, TokenConstraint)

    class Broken(_Digits):
        def bitmask(self):
            return np.zeros(3, np.int32)

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, V, 6) for _ in range(3)]
    for e in (engine, fused):
        for i, p in enumerate(prompts):
            e.open(f"s{i}")
            e.submit(f"s{i}", dataclasses.replace(text_chunk(p, unit=0), sampling=sampling_row(1.0)[None]), TAU)
    report = engine.tick(constraints={"s0": constraint, "s2": Broken(digits, 1, 5)})
    ref = fused.tick()
    assert report.per_token and not ref.per_token
    a = report.outputs["s0"]
    assert a.tokens == constraint.seen and len(a.tokens) == 4 and a.complete and a.error is None
    assert set(a.tokens[:3]) <= set(digits) and a.tokens[3] == 5
    assert report.outputs["s1"].tokens == ref.outputs["s1"].tokens and not report.outputs["s1"].complete
    broken = report.outputs["s2"]
    assert broken.tokens == [] and "int32 [" in broken.error and "got int32 (3,)" in broken.error


# ------------------------------------------------------------------------------------------------- through HTTP
ASK = [{"role": "user", "content": "Tell me about the sea."}]
SERVED_TAU = 4


@pytest.fixture(scope="module")
def served():
    """The demo checkpoint served per token (tau 4, T 8, bucket 4, RowSampling, no AIMD), warmed for 4 sessions."""
    from omnijax.serve.app import BackgroundServer, build_context, warm_up
    from omnijax.serve.context import ServeOptions
    from tests._support.demo_server import FRAME_MS, demo_model

    stream = omnijax.StreamConfig(policy=SinkWindow(4, 48), num_pages=32, page_size=16, max_answer_tokens=SERVED_TAU,
                                  decoding=RowSampling(seed=3))
    context = build_context(demo_model(), options=ServeOptions(port=0, frame_ms=FRAME_MS, max_output_tokens=64),
                            stream=stream, chunk_tokens=8, buckets=(4,), aimd_target=0, per_token=True)
    warm_up(context, 4)
    with BackgroundServer(context) as server:
        yield server


def _set_per_token(server, on: bool) -> None:
    engine = server.context.worker.engine
    engine.config = dataclasses.replace(engine.config, per_token=on)


def test_streamed_chat_arrives_one_chunk_per_token_through_the_openai_sdk(served):
    """With logprobs each streamed chunk names its tokens: per token, every content chunk carries exactly one, and
    they add up to the completion's tokens (its stop token aside); the same request per tick (tau 4) arrives in
    chunks of several tokens, with the same tokens (greedy: the two paths decode alike)."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served.base_url, api_key="none", max_retries=0)

    def stream():
        chunks = list(client.chat.completions.create(
            model="omnijax", messages=ASK, stream=True, max_tokens=12, temperature=0, logprobs=True,
            stream_options={"include_usage": True}))
        per_chunk = [[e.token for e in c.choices[0].logprobs.content] for c in chunks
                     if c.choices and c.choices[0].logprobs is not None and c.choices[0].logprobs.content]
        return per_chunk, chunks[-1].usage.completion_tokens, chunks

    per_token, used, chunks = stream()
    assert [len(tokens) for tokens in per_token] == [1] * len(per_token)
    reason = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    assert len(per_token) == used - (reason == "stop") and len(per_token) >= 4
    _set_per_token(served, False)
    try:
        per_tick, used_tick, _ = stream()
    finally:
        _set_per_token(served, True)
    assert sum(per_tick, []) == sum(per_token, []) and used_tick == used
    assert max(len(tokens) for tokens in per_tick) > 1


def test_a_native_session_keeps_its_cadence_while_chats_stream(served):
    """A native session streams frames for 3 s while four chat completions stream per token: every frame is
    answered in order, its tokens in its one reply at the end of its tick (or answered empty on time with its tokens
    following late); the chats' text arrives in one chunk per token."""
    import asyncio

    from omnijax.serve import loadgen
    from tests._support.demo_server import FRAME_MS

    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=served.base_url, api_key="none", max_retries=0)

    async def chat():
        chunks = await client.chat.completions.create(model="omnijax", messages=ASK, stream=True, max_tokens=16,
                                                      logprobs=True)
        return [len(c.choices[0].logprobs.content) async for c in chunks
                if c.choices and c.choices[0].logprobs is not None and c.choices[0].logprobs.content]

    async def scenario():
        loop, rows = asyncio.get_running_loop(), []
        native = asyncio.create_task(loadgen.run_client(served.native_url, client=0, frame_ms=FRAME_MS,
                                                        duration_s=3.0, t0=loop.time(), phase_s=0.0, seed=1,
                                                        frames=rows))
        await asyncio.sleep(0.5)
        chats = await asyncio.gather(*(chat() for _ in range(3)))
        return await native, rows, chats

    served.wait_idle()
    client_row, rows, chats = asyncio.run(scenario())
    assert client_row["admitted"] and client_row["error"] is None and client_row["received"] == len(rows)
    # cadence: every frame answered or superseded by a later one (none lost), and at least half answered. Not a count
    # of replies: on 2 cores shared with the suite's other worker a tick can outlast a frame, and a frame arriving
    # while the previous one waits supersedes it (7 of 12 answered once under load; 12 of 12 on a quiet machine)
    assert client_row["received"] + sum(r["skipped"] for r in rows) == client_row["sent"] == 12, client_row
    assert client_row["received"] >= client_row["sent"] / 2, client_row
    assert [r["seq"] for r in rows] == sorted(r["seq"] for r in rows)
    # a frame asks for tau tokens; the demo model may end a frame's answer early with its end token
    assert all((1 <= r["tokens"] <= SERVED_TAU and not r["empty"]) or (r["late"] and r["empty"]) for r in rows)
    assert client_row.get("late_tokens", 0) >= sum(r["late"] for r in rows)
    assert all(chat and set(chat) == {1} for chat in chats)
