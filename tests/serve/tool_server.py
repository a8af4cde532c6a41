"""A server whose model answers with scripts (`omnijax.testing.scripted`), for the tool-calling tests of chat
completions and Realtime: the demo checkpoint with a tools chat template, decoding `ScriptedDecoding`, so that its
answers hold tool calls as a real model's would. A request's temperature picks the script (`SCRIPTS` order)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'
SCRIPTS = (
    "Let me check.\n" + CALL,  # temperature 0: text, then one call
    "It is sunny in Paris.",  # temperature 1: an answer in words
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',  # temperature 2: two calls
)
TAU = 16  # answer tokens per tick: the scripts (15-96 tokens) span several ticks, so a call streams in pieces
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "array", "items": {"type": "integer"}}},
                   "required": ["city"]}}}


@contextlib.contextmanager
def tool_server(directory: Path, *, buckets: tuple[int, ...] = (1,), **options: Any) -> Iterator[Any]:
    """Serves a copy of the demo checkpoint (written under `directory`) with the tools template and scripted
    answers (`SCRIPTS`); `buckets` are the engine's batch buckets (default (1,): the tool tests' clients send one
    request at a time, so each tick decodes one row of the 152K-wide lm_head, not two); `options` are `ServeOptions`
    fields.
    Yields the `BackgroundServer`."""
    import omnijax
    from omnijax.retention import SinkWindow
    from omnijax.serve.app import BackgroundServer, build_context
    from omnijax.serve.context import ServeOptions
    from omnijax.testing.scripted import ScriptedDecoding, scripts_of, tool_checkpoint
    from tests._support.demo_server import demo_checkpoint

    model = omnijax.load(tool_checkpoint(demo_checkpoint(), directory / "tools-checkpoint"))
    end = model.tokenizer.token_id("<|im_end|>")
    decoding = ScriptedDecoding(scripts_of(model.tokenizer, SCRIPTS, end))
    stream = omnijax.StreamConfig(policy=SinkWindow(4, 508), num_pages=96, page_size=16, max_answer_tokens=TAU,
                                  decoding=decoding)
    context = build_context(model, options=ServeOptions(**{"port": 0, "frame_ms": 250.0, **options}), stream=stream,
                            chunk_tokens=64, buckets=buckets, aimd_target=0)
    with BackgroundServer(context) as server:
        yield server
