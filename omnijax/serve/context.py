"""What every route of `omnijax serve` shares: the settings (`ServeOptions`), the model, the engine worker, the
per-client session counts (`ServeContext`)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hmac
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from omnijax.conversation import Conversation
from omnijax.models.family import OmniModel
from omnijax.serve.audio_frames import AudioFrameEncoder
from omnijax.serve.engine.admission import Overloaded

if TYPE_CHECKING:
    from omnijax.serve.engine.snapshot import SessionSnapshot
    from omnijax.serve.engine.worker import EngineWorker


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """Settings of the OpenAI-compatible server.

    Attributes:
        host, port: where it listens (loopback by default; port 0 picks a free one).
        api_key: when set, every route requires `Authorization: Bearer <api_key>` (401 otherwise).
        model_name: the model id `/v1/models` lists and sessions report.
        frame_ms: the frame budget B: input audio is fed in frames of B ms.
        max_message_bytes: the largest WebSocket message or HTTP body accepted.
        max_audio_buffer_s: the most seconds of input audio a Realtime session may hold not yet fed.
        max_sessions_per_client: the most sessions one client address may hold at once.
        max_output_tokens: the most tokens of one response (a client's "inf" means this).
        max_outbox: server events queued unread for one client before it is dropped as a slow consumer.
        decode_wait_fraction: a native frame's reply waits at most this fraction of B after the frame arrived
            (Metronome's worker: 0.8 B); a tick still running then gives an empty reply on time, marked `late`,
            and its tokens follow in a `late_tokens` message. 0 waits for the tick however long it takes.
        snapshot_dir: where Realtime sessions are snapshotted when their connection ends (and at shutdown), to be
            resumed with their token; None disables resuming.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str = "omnijax"
    frame_ms: float = 1000.0
    max_message_bytes: int = 16 * 1024 * 1024
    max_audio_buffer_s: float = 60.0
    max_sessions_per_client: int = 16
    max_output_tokens: int = 512
    max_outbox: int = 1024
    decode_wait_fraction: float = 0.8
    snapshot_dir: str | None = None

    def __post_init__(self):
        for name in ("max_message_bytes", "max_sessions_per_client", "max_output_tokens", "max_outbox"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.decode_wait_fraction <= 1:
            raise ValueError(f"decode_wait_fraction must lie in [0, 1], got {self.decode_wait_fraction}")
        if not self.frame_ms > 0 or not self.max_audio_buffer_s > 0:
            raise ValueError(f"frame_ms and max_audio_buffer_s must be positive, got {self.frame_ms}, "
                             f"{self.max_audio_buffer_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be a non-empty string (or None for no key)")

    def authorized(self, header: str | None) -> bool:
        """Whether an `Authorization` header value carries the key (always True without a key)."""
        if self.api_key is None:
            return True
        scheme, _, token = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())


class ServeContext:
    """The served model and worker, and the per-client session counts.

    Args:
        model: the `omnijax.Model`; its tokenizer renders chat templates.
        worker: the `EngineWorker` over the model's engine.
        options: `ServeOptions`.
    """

    def __init__(self, model: OmniModel, worker: EngineWorker, options: ServeOptions):
        self.model, self.worker, self.options = model, worker, options
        self.tokenizer = model.tokenizer
        self.chunk_tokens = worker.engine.config.chunk_tokens
        self.per_client: collections.Counter = collections.Counter()
        self.started = int(time.time())
        self._next = 0

    @functools.cached_property
    def frame_encoder(self) -> AudioFrameEncoder:
        """The native protocol's `AudioFrameEncoder` (built on first use)."""
        return AudioFrameEncoder(self.model, chunk_tokens=self.chunk_tokens, answer_tokens=self.worker.tau)

    def new_session_id(self, prefix: str) -> str:
        self._next += 1
        return f"{prefix}{self._next}"

    def conversation(self) -> Conversation:
        return Conversation(self.model, self.tokenizer, self.chunk_tokens)

    @contextlib.asynccontextmanager
    async def session(self, client: str, prefix: str,
                      snapshot: SessionSnapshot | None = None) -> AsyncIterator[str]:
        """Opens an engine session for `client` (raises `Overloaded`), resuming `snapshot` when given; yields its
        id, closes it."""
        cap = self.options.max_sessions_per_client
        if self.per_client[client] >= cap:
            raise Overloaded(f"this client already holds {self.per_client[client]} sessions, the most one client "
                             f"may hold ({cap}); close one first", cap=cap, current=self.per_client[client])
        sid = self.new_session_id(prefix)
        self.per_client[client] += 1
        try:
            await self.worker.open(sid, snapshot)
            try:
                yield sid
            finally:
                await self.worker.close(sid)
        finally:
            self.per_client[client] -= 1
            if self.per_client[client] <= 0:
                del self.per_client[client]
