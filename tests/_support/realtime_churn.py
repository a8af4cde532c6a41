"""Realtime clients and their alone-run oracle, for the churn and fault-injection tests of `omnijax serve`.

`Conn` is one `/v1/realtime` connection through the official `openai` SDK with a reader task: the text deltas and
`response.done` of the response in flight become a `Result`, every `error` event is kept (a late `response.cancel`'s
`response_cancel_not_active` only when a cancel was sent). `Flow` is one logical session across connections (its
resume token, instructions, and what it said and got back).

`AloneRun` is the oracle: the same conversation fed to its own batch-1 `omnijax.Session` (not the engine's batched
ticks), built by a fresh `omnijax.conversation.Conversation` exactly as the Realtime route builds it (the
instructions as a system message before the next item or response, each item a user message, each response the
template's generation prompt then tau tokens per tick until a stop token or the limit) and each chunk padded to the
engine's T. A cancelled response is replayed as the server defines it: the tokens it reported, plus whatever the
server had decoded into the cache when the cancel took effect (nothing, or the tick the cancel landed in, whose
tokens are not reported); which of the two happened is decided by the `kv_cells` the server reported, and every later
answer of the session checks that choice.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import omnijax
from omnijax.chunks.chunk import Chunk, pad_chunk
from omnijax.conversation import Conversation
from omnijax.decoding import answer_stop_ids
from tests._support.realtime_client import ask, user_item

WORDS = ("apple", "river", "quiet", "seven", "orbit", "lantern", "maple", "copper", "violet", "harbor", "pixel",
         "thunder", "velvet", "meadow", "cobalt", "ember", "glacier", "saffron", "tundra", "willow")


def sentence(rng: np.random.Generator, low: int = 2, high: int = 30) -> str:
    """A random sentence of `low`..`high` words (long ones span several T-token parts)."""
    return " ".join(str(w) for w in rng.choice(WORDS, int(rng.integers(low, high + 1)))).capitalize() + "."


@dataclasses.dataclass
class Result:
    """What the server said of one response."""

    status: str
    text: str
    done_text: str
    output_tokens: int
    kv_cells: int


@dataclasses.dataclass
class Turn:
    """One user item and the response asked after it."""

    text: str
    max_tokens: int
    instructions: str
    connection: int = 1  # which of its flow's connections asked it (2 and on: after a resume)
    cancel_sent: bool = False
    result: Result | None = None


@dataclasses.dataclass
class Flow:
    """One logical Realtime session: across its connections (a resume continues the flow)."""

    name: str
    instructions: str = ""
    token: str | None = None
    turns: list[Turn] = dataclasses.field(default_factory=list)
    connections: int = 0


class Conn:
    """One open `/v1/realtime` connection (see the module docstring)."""

    def __init__(self, manager: Any, conn: Any, created: Any):
        self.manager, self.conn, self.created = manager, conn, created
        self.token: str | None = created.session.model_extra["omnijax"].get("resume_token")
        self.errors: list[Any] = []
        self.late_cancels = 0  # response_cancel_not_active errors a cancel sent may still draw
        self.pending: asyncio.Future | None = None
        self.deltas: list[str] = []
        self.items_done = 0  # user items the server says are fed (`conversation.item.done`)
        self._item_done = asyncio.Event()
        self.reader = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, client: Any, resume: str | None = None) -> "Conn":
        """Connects (resuming `resume`), reads `session.created`; AssertionError with the event otherwise."""
        manager = client.realtime.connect(model="omnijax", extra_query={"resume": resume} if resume else {})
        conn = await manager.__aenter__()
        created = await conn.recv()
        if created.type != "session.created":
            await manager.__aexit__(None, None, None)
            raise AssertionError(f"connect{' (resume)' if resume else ''}: {created}")
        return cls(manager, conn, created)

    async def _read(self) -> None:
        try:
            async for event in self.conn:
                if event.type == "response.output_text.delta":
                    self.deltas.append(event.delta)
                elif event.type == "response.done" and self.pending is not None:
                    response = event.response
                    done_text = response.output[0].content[0].text if response.output else ""
                    self.pending.set_result(Result(response.status, "".join(self.deltas), done_text or "",
                                                   response.usage.output_tokens,
                                                   event.model_extra["omnijax"]["kv_cells"]))
                    self.pending = None
                elif event.type == "conversation.item.done" and event.item.role == "user":
                    self.items_done += 1
                    self._item_done.set()
                elif event.type == "error":
                    if event.error.code == "response_cancel_not_active" and self.late_cancels > 0:
                        self.late_cancels -= 1
                    else:
                        self.errors.append(event)
                        if self.pending is not None:
                            self.pending.set_exception(AssertionError(f"error event: {event}"))
                            self.pending = None
        except Exception:  # noqa: BLE001 - the connection closed (by the test, or the server died)
            pass
        finally:
            if self.pending is not None and not self.pending.done():
                self.pending.cancel()

    @property
    def responding(self) -> bool:
        return self.pending is not None and not self.pending.done()

    async def instruct(self, text: str) -> None:
        """`session.update` with instructions; waits for its `session.updated` (through the reader: not checked)."""
        await self.conn.session.update(session={"type": "realtime", "instructions": text})

    async def item(self, text: str) -> None:
        """Sends a user item and waits until the server says it is fed."""
        target = self.items_done + 1
        await self.conn.conversation.item.create(item=user_item(text))
        while self.items_done < target:
            self._item_done.clear()
            await asyncio.wait_for(self._item_done.wait(), 60)

    async def say(self, text: str, max_tokens: int) -> asyncio.Future:
        """Sends a user item and `response.create`; returns the future of the response's `Result`."""
        assert not self.responding
        self.deltas = []
        self.pending = asyncio.get_running_loop().create_future()
        await ask(self.conn, text, max_tokens)
        return self.pending

    async def cancel(self) -> None:
        self.late_cancels += 1
        await self.conn.response.cancel()

    async def close(self) -> None:
        await self.manager.__aexit__(None, None, None)
        await asyncio.wait_for(self.reader, 30)


class AloneRun:
    """One session's conversation replayed alone (see the module docstring).

    Args:
        model: the served model (with its tokenizer).
        stream: the server's `StreamConfig` (policy, pages, tau, decoding).
        chunk_tokens: the engine's T.
    """

    def __init__(self, model: Any, stream: omnijax.StreamConfig, chunk_tokens: int):
        self.conversation = Conversation(model, model.tokenizer, chunk_tokens)
        self.session = omnijax.Session(model, stream)
        self.tokenizer = model.tokenizer
        self.tau, self.T = stream.max_answer_tokens, chunk_tokens
        self.axes = self.session.config.position_axes
        self.stop = frozenset(answer_stop_ids(self.session.stream_config.decoding, model.config.eos_token_ids))
        self.instructions_fed = ""
        self.cancels = {"before decoding": 0, "in a tick": 0, "between ticks": 0}

    def _feed(self, chunk: Chunk, asked: int = 0) -> list[int]:
        chunk = dataclasses.replace(pad_chunk(chunk, self.T), answer_tokens=np.asarray([asked], np.int32))
        if chunk.positions.shape[0] != self.axes:  # as the engine broadcasts a text chunk's positions
            chunk = dataclasses.replace(chunk, positions=np.broadcast_to(chunk.positions, (self.axes, 1, self.T)))
        out = self.session.feed(chunk)
        return [int(t) for t in np.asarray(out.tokens[0]) if t >= 0]

    def cells(self) -> int:
        """The KV cells the session holds."""
        return int(np.asarray(self.session.state.kv.valid).sum())

    def _instructions(self, text: str) -> None:
        if text and text != self.instructions_fed:
            for part in self.conversation.message("system", text):
                self._feed(part)
            self.instructions_fed = text

    def item(self, text: str, instructions: str = "") -> None:
        """A user text item (after the instructions, when they changed)."""
        self._instructions(instructions)
        for part in self.conversation.message("user", text):
            self._feed(part)

    def _tick(self, chunk: Chunk, asked: int) -> tuple[list[int], bool]:
        tokens = self._feed(chunk, asked)
        cut = next((i + 1 for i, t in enumerate(tokens) if t in self.stop), None)
        return (tokens[:cut] if cut is not None else tokens), cut is not None

    def response(self, max_tokens: int, instructions: str, server: Result) -> tuple[list[int], str]:
        """Replays a response limited to `max_tokens` as the server served it; returns (tokens, status). A cancelled
        one stops where `server` (its reported tokens and cells) says the cancel took effect."""
        self._instructions(instructions)
        asked = min(self.tau, max_tokens)
        prompt = self.conversation.prompt(asked)
        for part in prompt.parts[:-1]:
            self._feed(part)

        def continuation(done: int) -> Chunk:
            return self.conversation.continuation(prompt.answer_unit, min(self.tau, max_tokens - done))

        if server.status == "cancelled":
            tokens = self._cancelled(prompt.parts[-1], asked, continuation, max_tokens, server)
            status = "cancelled"
        else:
            tokens, ended = self._tick(prompt.parts[-1], asked)
            while not ended and tokens and len(tokens) < max_tokens:
                new, ended = self._tick(continuation(len(tokens)), min(self.tau, max_tokens - len(tokens)))
                tokens += new
                if not new:
                    break
            status = "completed" if ended else "incomplete"
        self.conversation.answered(tokens)
        return tokens, status

    def _cancelled(self, last: Chunk, asked: int, continuation, max_tokens: int, server: Result) -> list[int]:
        reported = server.output_tokens
        if reported == 0:  # the cancel came before the prompt's last part was served, or during its tick
            saved = jax.tree.map(jnp.copy, self.session.state)
            self._feed(last, 0)
            before, kept = self.cells(), jax.tree.map(jnp.copy, self.session.state)
            self.session.state = saved
            self._feed(last, asked)
            if server.kv_cells == before:
                self.session.state = kept
                self.cancels["before decoding"] += 1
            else:
                assert server.kv_cells == self.cells(), ("cancelled", server, before, self.cells())
                self.cancels["in a tick"] += 1
            return []
        tokens, ended = self._tick(last, asked)
        while len(tokens) < reported:
            assert not ended and tokens, ("cancelled", tokens, server)
            new, ended = self._tick(continuation(len(tokens)), min(self.tau, max_tokens - len(tokens)))
            tokens += new
        assert len(tokens) == reported and not ended, ("cancelled", tokens, server)  # whole ticks, no stop
        saved, between = jax.tree.map(jnp.copy, self.session.state), self.cells()
        self._tick(continuation(reported), min(self.tau, max_tokens - reported))
        if server.kv_cells == self.cells():  # the cancel landed in this tick: decoded into the cache, unreported
            self.cancels["in a tick"] += 1
        else:  # taken up between ticks: nothing more decoded, and the cells the session holds are reported
            assert server.kv_cells == between, ("cancelled", server, between, self.cells())
            self.session.state = saved
            self.cancels["between ticks"] += 1
        return tokens

    def check(self, turn: Turn, where: str) -> list[int]:
        """Replays `turn` (its item and response) and checks the server's result against the alone-run."""
        server = turn.result
        assert server is not None, where
        self.item(turn.text, turn.instructions)
        tokens, status = self.response(turn.max_tokens, turn.instructions, server)
        decoder = self.tokenizer.stream_decoder(skip_special_tokens=True)
        text = decoder.push(tokens) + decoder.flush()
        assert server.text == server.done_text, (where, server)
        assert (server.status, server.output_tokens, server.text) == (status, len(tokens), text), \
            (where, server, status, tokens, text)
        if status != "cancelled":
            assert server.kv_cells == self.cells(), (where, server.kv_cells, self.cells())
        return tokens
