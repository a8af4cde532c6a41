"""The `hostile_probe` cases of chat completions' tools, log probabilities, `n` and the per-request sampling fields
(`omnijax.serve.chat_sampling`): valid values are honoured ("accept"), out-of-range ones refused naming the field.
The probe's server is `omnijax serve --demo-model`, whose ChatML template renders no tools: valid tools are refused
naming the model, as a checkpoint without a tools template is."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from omnijax.decoding import MAX_TOP_LOGPROBS
from omnijax.serve.chat_sampling import MAX_N


def tools_and_sampling_cases(add: Callable[..., None], body: Callable[..., dict]) -> None:
    """Adds the cases through `add(name, summary, payload, expected, *codes, param=...)` (the chat-fields
    category's helper); `body(**changes)` is a valid request with `changes`."""
    for name, v, exp in [("2", 2, "accept"), ("max", MAX_N, "accept"), ("over_cap", MAX_N + 1, "refuse"),
                         ("0", 0, "refuse"), ("string", "1", "refuse"), ("float", 1.0, "either"),
                         ("null", None, "either")]:
        add(f"n_{name}", f"n = {v!r} (cap {MAX_N})", body(n=v), exp, "invalid_value",
            param="n" if exp == "refuse" else None)
    # Tools: checked when the request is parsed, then rendered by the model's chat template. The demo model's
    # ChatML template renders none, so valid tools are refused naming `tools` and the model.
    tool: dict[str, Any] = {"type": "function",
                            "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    add("tools", "a valid tool (the demo model's template renders no tools: refused naming the model)",
        body(tools=[tool]), "refuse", "unsupported", param="tools")
    add("tools_bad_schema", "a tool whose parameters are not a JSON schema (type 'town')",
        body(tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"city": {"type": "town"}}}}}]), "refuse", "invalid_value",
        param="tools[0]")
    add("tools_schema_not_object", "a tool whose parameters are a list", body(tools=[
        {"type": "function", "function": {"name": "f", "parameters": [1]}}]), "refuse", "invalid_value",
        param="tools[0]")
    add("tool_choice", "tool_choice 'auto' without tools (nothing to call: answered in words)",
        body(tool_choice="auto"), "accept")
    # Log probabilities and the sampling fields omnijax serve's RowSampling honours per request
    add("logprobs", "logprobs true", body(logprobs=True), "accept")
    add("logprobs_top", f"logprobs true, top_logprobs {MAX_TOP_LOGPROBS} (the cap)",
        body(logprobs=True, top_logprobs=MAX_TOP_LOGPROBS), "accept")
    add("top_logprobs", "top_logprobs 2 without logprobs", body(top_logprobs=2), "refuse", "invalid_value",
        param="top_logprobs")
    add("top_logprobs_over_cap", f"top_logprobs {MAX_TOP_LOGPROBS + 1} (over the cap)",
        body(logprobs=True, top_logprobs=MAX_TOP_LOGPROBS + 1), "refuse", "invalid_value", param="top_logprobs")
    honoured = [("frequency_penalty", 1.5), ("presence_penalty", -2), ("logit_bias", {"50256": -100}), ("top_k", 5),
                ("repetition_penalty", 1.3), ("min_p", 0.1)]
    for name, v in honoured:
        add(f"sampling_{name}", f"{name} = {json.dumps(v)} (honoured per request)", body(**{name: v}), "accept")
    bad_sampling = [("frequency_penalty", 2.5), ("presence_penalty", "1"), ("top_k", -2), ("repetition_penalty", 0),
                    ("min_p", 1.5), ("logit_bias", {"999999999": 5}), ("logit_bias", {"-1": 5}),
                    ("logit_bias", {"5": 101}), ("logit_bias", {"5": -100.5}), ("logit_bias", {"x": 1}),
                    ("logit_bias", [5])]
    for i, (name, v) in enumerate(bad_sampling):
        add(f"sampling_bad_{name}_{i}", f"{name} = {json.dumps(v)} (out of its range; logit_bias: token ids of "
            f"the vocabulary, biases in [-100, 100])", body(**{name: v}), "refuse", "invalid_value", param=name)
