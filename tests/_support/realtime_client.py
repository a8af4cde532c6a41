"""One Realtime turn through the official `openai` SDK's `/v1/realtime` connection, for the serving tests: `ask`
sends a user message and `response.create`; `say` asks and reads the connection to the response's `response.done`.
`tests._support.realtime_churn.Conn`, whose reader task reads instead, asks with the same `ask`."""

from __future__ import annotations

from typing import Any


def user_item(text: str) -> dict[str, Any]:
    """A `conversation.item.create` item: one user message of `text`."""
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def ask(conn: Any, text: str, max_tokens: int) -> None:
    """Sends a user message of `text`, then `response.create` capped at `max_tokens` output tokens."""
    await conn.conversation.item.create(item=user_item(text))
    await conn.response.create(response={"max_output_tokens": max_tokens})


async def say(conn: Any, text: str, max_tokens: int) -> tuple[str, int]:
    """Asks (`ask`) and reads the events up to the response's `response.done`, none of them an `error`.

    Args:
        conn: an open SDK Realtime connection (`client.realtime.connect(...)`) nothing else reads.
        text: the user's message.
        max_tokens: the response's `max_output_tokens`.

    Returns:
        The answer's text (its deltas joined) and the KV cells its session holds at the end (omnijax's
        `response.done` field).

    Raises:
        AssertionError: an `error` event, or the connection closed before `response.done`.
    """
    await ask(conn, text, max_tokens)
    deltas = []
    async for event in conn:
        assert event.type != "error", event
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        elif event.type == "response.done":
            return "".join(deltas), event.model_extra["omnijax"]["kv_cells"]
    raise AssertionError(f"the connection closed before response.done (deltas so far: {''.join(deltas)!r})")
