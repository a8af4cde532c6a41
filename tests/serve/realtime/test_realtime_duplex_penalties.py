"""A duplex Realtime session's `presence_penalty` / `frequency_penalty` reach its decisions, and its other sampling
settings are refused by name (issue 37 leftovers), through the official `openai` SDK against the MiniCPM-o 4.5 server
of `test_openai_duplex` (its fixtures and conversation). The penalties' arithmetic across units is checked against a
plain-Python walk in `tests/serve/engine/test_duplex_penalties.py`; here: given with duplex or in a later update, the
spoken text is the same, and not the unpenalised text `DuplexSession` decides."""

import asyncio
import base64

import pytest

openai = pytest.importorskip("openai")

from tests.serve.realtime.test_openai_duplex import (  # noqa: E402, F401 - fixtures
    FRAME_UNIT,
    INSTRUCTIONS,
    UNITS,
    _inputs,
    _reference,
    model,
    server,
)

PENALTIES = {"presence_penalty": 1.5, "frequency_penalty": 1.0}


async def _spoken(running, updates: list[dict]) -> tuple[str, list]:
    """The text a duplex session streams over the four units after `updates` (`session.omnijax` objects, each its
    own session.update); returns it with the replies to the updates."""
    pcm24, png = _inputs()
    client = openai.AsyncOpenAI(base_url=running.base_url, api_key="unused", max_retries=0)
    async with client.realtime.connect(model="omnijax") as conn:
        await conn.recv()
        replies = []
        for ext in updates:
            await conn.session.update(session={"type": "realtime", "instructions": INSTRUCTIONS, "omnijax": ext})
            replies.append(await conn.recv())
        for u in range(UNITS):
            if u == FRAME_UNIT:
                url = "data:image/png;base64," + base64.b64encode(png).decode()
                await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                    {"type": "input_image", "image_url": url}]})
            part = pcm24[u * 24000:(u + 1) * 24000]
            await conn.input_audio_buffer.append(audio=base64.b64encode(part.tobytes()).decode())
        await conn.input_audio_buffer.commit()
        text = []
        async for event in conn:
            assert event.type != "error", event
            if event.type == "response.output_text.delta":
                text.append(event.delta)
            if event.type == "input_audio_buffer.committed":
                return "".join(text), replies
    raise AssertionError("the connection closed")


def test_penalties_reach_the_decisions_and_other_settings_are_refused(server, model):  # noqa: F811 - fixtures
    together, replies = asyncio.run(_spoken(server, [{"duplex": True, **PENALTIES}]))
    assert replies[0].type == "session.updated"
    echoed = replies[0].session.model_extra["omnijax"]
    assert echoed["duplex"] and {k: echoed[k] for k in PENALTIES} == PENALTIES
    later, replies = asyncio.run(_spoken(server, [{"duplex": True}, {"temperature": 0.5, **PENALTIES}, PENALTIES]))
    refused = replies[1]
    assert refused.type == "error" and refused.error.code == "unsupported"
    assert refused.error.param == "session.omnijax.temperature", refused
    assert [r.type for r in replies] == ["session.updated", "error", "session.updated"]
    turns, open_turn = _reference(model, *_inputs())
    unpenalised = model.tokenizer.decode(sum(turns, []) + (open_turn or []), skip_special_tokens=True)
    assert together == later and together != unpenalised, (together, unpenalised)
