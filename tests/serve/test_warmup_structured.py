"""`omnijax serve`'s warm-up makes structured output ready (issue 37 leftovers): after `warm_up`, the first
`response_format` request compiles nothing and builds no llguidance tokenizer.

Oracles, none of them a wall clock: jax's own compile events (`jax.monitoring`'s backend-compile duration, one per
program handed to the backend, persistent-cache hits included) counted while the request runs; the in-memory caches of
the engine's jitted programs (`engine_step`, `token_step`); and the llguidance tokenizer cache's misses. The engine
here has its own shapes (one bucket of 3 rows, fused ticks; the control's, 5), so its masked one-token program exists
in no other test's cache: the warm-up's own growth of `token_step`'s cache shows that it compiled that program, and
the control (a server warmed up without structured output) shows the same request compiling it (or loading it from
the kept executables of an earlier run).
"""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("llguidance")  # the serve and test extras
openai = pytest.importorskip("openai")

from jax._src import monitoring  # noqa: E402  (unregister_* are not re-exported by jax.monitoring)

from omnijax.serve import structured  # noqa: E402
from omnijax.serve.engine.decode_loop import engine_step, token_step  # noqa: E402
from tests._support.demo_server import FRAME_MS, demo_model  # noqa: E402

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                             "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "flags", "schema": SCHEMA, "strict": True}}
ASK = [{"role": "user", "content": "Answer as JSON."}]


class _Compiles:
    """Counts the programs jax hands to its backend (from any thread) while registered."""

    def __init__(self):
        self.count, self._lock = 0, threading.Lock()

    def __call__(self, event: str, seconds: float, **_) -> None:
        if event == BACKEND_COMPILE:
            with self._lock:
                self.count += 1

    def __enter__(self) -> "_Compiles":
        monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *_) -> None:
        monitoring.unregister_event_duration_listener(self)


def _sizes() -> tuple[int, int, int]:
    """(engine_step's and token_step's in-memory cache entries, llguidance tokenizer builds so far)."""
    return engine_step._cache_size(), token_step._cache_size(), structured._ll_tokenizer.cache_info().misses


def _context(bucket: int):
    import omnijax
    from omnijax.decoding import RowSampling
    from omnijax.retention import SinkWindow
    from omnijax.serve.app import build_context
    from omnijax.serve.context import ServeOptions

    stream = omnijax.StreamConfig(policy=SinkWindow(4, 48), num_pages=32, page_size=16, max_answer_tokens=2,
                                  decoding=RowSampling(seed=5))
    return build_context(demo_model(), options=ServeOptions(port=0, frame_ms=FRAME_MS), stream=stream,
                         chunk_tokens=8, buckets=(bucket,), aimd_target=0, per_token=False)


def _json_request(context) -> tuple[str, int]:
    """One streamed json_schema request against `context`'s server: (its text, programs compiled meanwhile)."""
    from omnijax.serve.app import BackgroundServer

    with BackgroundServer(context) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        with _Compiles() as compiles:
            chunks = list(client.chat.completions.create(model="omnijax", messages=ASK, max_tokens=60, stream=True,
                                                         response_format=FORMAT))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop", text
    return text, compiles.count


def test_a_json_request_after_warm_up_compiles_nothing():
    """Warm-up (fused ticks) builds the tokenizer and compiles the host-driven prefill and the masked token step;
    then a streamed json_schema request hands no program to the backend, adds no entry to the engine's jitted
    programs and builds no tokenizer; its answer validates against the schema."""
    from omnijax.serve.app import warm_up

    context = _context(3)
    before = _sizes()
    warm_up(context, 3)
    warmed = _sizes()
    # this engine's shapes are new to the process: the fused step and the prefill without an answer, and the masked
    # one-token step (fused ticks compile no unmasked one)
    assert warmed[0] - before[0] == 2 and warmed[1] - before[1] == 1, (before, warmed)
    assert warmed[2] - before[2] <= 1  # the demo tokenizer's trie (another test of this process may have built it)
    text, compiled = _json_request(context)
    assert compiled == 0 and _sizes() == warmed, (compiled, warmed, _sizes())
    value = json.loads(text)
    assert isinstance(value["ok"], bool) and 0 <= value["n"] <= 9 and set(value) == {"ok", "n"}, text


def test_without_the_structured_warm_up_the_request_compiles_the_masked_step():
    """The control: warmed up without structured output, the same request compiles the masked token step (so the
    check above can fail). Its bucket (5 rows) is its own, so no other test compiled those programs."""
    from omnijax.serve.app import warm_up

    context = _context(5)
    warm_up(context, 5, structured=False)
    warmed, loads = _sizes(), token_step.stats["loaded"]
    _, compiled = _json_request(context)
    after = _sizes()
    # the program is compiled, or loaded from the kept executables a run before compiled (omnijax.compilation_cache)
    fetched = compiled + token_step.stats["loaded"] - loads
    assert fetched >= 1 and after[1] - warmed[1] == 1, (warmed, after, compiled, loads)
