"""What every route of `omnijax serve` shares: the settings (`ServeOptions`), the model, the engine worker, the
per-client session counts (`ServeContext`)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hmac
import math
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from omnijax.conversation import Conversation
from omnijax.models.family import OmniModel
from omnijax.models.talker_kv import talker_policy
from omnijax.serve.audio_frames import AudioFrameEncoder
from omnijax.serve.engine.admission import Overloaded
from omnijax.serve.prompt_scores import PromptScorer

if TYPE_CHECKING:
    from omnijax.serve.engine.snapshot import SessionSnapshot
    from omnijax.serve.engine.worker import EngineWorker


FIRST_CHUNK = 4  # default codec frames of the vocoder's first call of a spoken answer (320 ms for Qwen3-Omni)
CHUNK = 25  # default codec frames of each later call (2 s)


def model_not_found(asked: object, served: str) -> str:
    """The message every route gives a request naming another model than the served one (code
    `model_not_found`)."""
    return f"model {asked!r} does not exist: this server serves {served!r}"


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
        max_outbox_bytes: bytes of serialized server events queued unread for one client (Realtime or native) before
            it is dropped as a slow consumer (`omnijax.serve.outbox`; one event alone may pass it).
        max_request_audio_s: the most seconds of audio one chat completion may carry (all its `input_audio` parts),
            refused by name before any is resampled or encoded.
        max_request_video_s: the most seconds of video one chat completion may carry (all its `video_url` parts, in
            whole units of the family), refused by name once each file's header is read, before its frames decode.
        decode_wait_fraction: a native frame's reply waits at most this fraction of B after the frame arrived
            (Metronome's worker: 0.8 B); a tick still running then gives an empty reply on time, marked `late`,
            and its tokens follow in a `late_tokens` message. 0 waits for the tick however long it takes.
        snapshot_dir: where Realtime sessions are snapshotted when their connection ends (and at shutdown), to be
            resumed with their token; None disables resuming.
        snapshot_every_s, snapshot_every_turns: also snapshot a Realtime session this many seconds after its last
            snapshot, or after this many responses (`--snapshot-every 30s` / `5turns`): a snapshot due when a
            response ends is on disk before that response's `response.done` is sent (the client's next event waits
            for it to be taken, not written; ~0.2 s a save on the demo model), one due later is taken when the
            session is next idle; 0: only when the connection ends. Native `/session` sessions too, a served frame
            counting as a response (`omnijax.serve.native.snapshots`).
        snapshot_max_bytes: the cap on the snapshot directory's total size (oldest unheld sessions are evicted to
            make room; None: no cap).
        snapshot_max_age_s: snapshots not written for this long are deleted (None: kept until resumed or evicted).
        idle_timeout_s: a Realtime connection whose client sends nothing for this long (no response decoding) is
            snapshotted and closed with an `idle_timeout` error; a native `/session` one (no frame being served) is
            closed the same way; 0 disables.
        queue_timeout_s: how long a chat completion or completion the server cannot admit waits for room before its
            429 (0: no waiting).
        max_queued: the most requests waiting at once; beyond it a request gets its 429 at once.
        max_scored_tokens: the most tokens (prompt plus completion) a completions request's `logprobs` may score
            (one full-context forward: `omnijax.serve.prompt_scores`).
        shutdown_timeout_s: on SIGTERM, responses in flight end at once and connections get this long to close
            (snapshots included) before their handlers are cancelled.
        max_speech_tokens: the talker's tokens at most for one spoken answer (chat completions' audio output, one
            per 80 ms codec frame for Qwen3-Omni; the reference's `talker_max_new_tokens`).
        talker_window: None (the talker's KV holds its prompt and every token), or the newest talker KV cells
            kept beside its 4 oldest (`omnijax.models.talker_kv`): the speech pool's rows and the thread path alike.
        speak_early: Qwen2.5-Omni: chat completions' audio output and Realtime's spoken responses speak the answer
            while it is written (the speech pool built with `SpeechConfig(early_start=True)`; the engine's decode
            programs then also return each answer token's row, and recall is refused). False: the finished answer is
            spoken. Qwen3-Omni's always speaks while written.
        speech_first_chunk, speech_chunk: codec frames of the vocoder's first call of each spoken answer, then of
            each later call (`SpeakOptions.first_chunk` / `chunk`; 4 then 25 by default; Qwen2.5-Omni rounds them up
            to whole DiT blocks): the speech pool's (`SpeechConfig.first_chunk` / `chunk`) and the thread path's.
            At least 1: the streamed vocoders carry their state from call to call, so any size gives the same PCM.
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
    max_outbox_bytes: int = 64 * 2 ** 20
    max_request_audio_s: float = 600.0
    max_request_video_s: float = 120.0
    decode_wait_fraction: float = 0.8
    snapshot_dir: str | None = None
    snapshot_every_s: float = 0.0
    snapshot_every_turns: int = 0
    snapshot_max_bytes: int | None = 16 * 2 ** 30
    snapshot_max_age_s: float | None = 7 * 86400.0
    idle_timeout_s: float = 600.0
    queue_timeout_s: float = 10.0
    max_queued: int = 64
    max_scored_tokens: int = 2048
    shutdown_timeout_s: float = 30.0
    max_speech_tokens: int = 4096
    talker_window: int | None = None
    speak_early: bool = False
    speech_first_chunk: int = FIRST_CHUNK
    speech_chunk: int = CHUNK

    def __post_init__(self):
        for name in ("max_message_bytes", "max_sessions_per_client", "max_output_tokens", "max_outbox",
                     "max_outbox_bytes", "max_scored_tokens", "max_speech_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        talker_policy(self.talker_window, what="talker_window (--talker-window)")  # refused by name
        for name in ("speech_first_chunk", "speech_chunk"):  # the streamed vocoders carry their state: any >= 1
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be an int of at least 1 codec frame, "
                                 f"got {value!r}")
        if not isinstance(self.speak_early, bool):
            raise ValueError(f"speak_early must be True or False, got {self.speak_early!r}")
        if not 0 <= self.decode_wait_fraction <= 1:
            raise ValueError(f"decode_wait_fraction must lie in [0, 1], got {self.decode_wait_fraction}")
        if not 0 < self.max_request_audio_s < float("inf"):
            raise ValueError(f"max_request_audio_s must be a positive number of seconds, got "
                             f"{self.max_request_audio_s}")
        if not 0 < self.max_request_video_s < float("inf"):
            raise ValueError(f"max_request_video_s must be a positive number of seconds, got "
                             f"{self.max_request_video_s}")
        if not self.frame_ms > 0 or not self.max_audio_buffer_s > 0:
            raise ValueError(f"frame_ms and max_audio_buffer_s must be positive, got {self.frame_ms}, "
                             f"{self.max_audio_buffer_s}")
        if not self.queue_timeout_s >= 0 or self.max_queued < 0 or not self.shutdown_timeout_s > 0:
            raise ValueError(f"queue_timeout_s and max_queued must be >= 0 and shutdown_timeout_s > 0, got "
                             f"{self.queue_timeout_s}, {self.max_queued}, {self.shutdown_timeout_s}")
        if not self.snapshot_every_s >= 0 or self.snapshot_every_turns < 0 or (self.snapshot_every_s
                                                                               and self.snapshot_every_turns):
            raise ValueError(f"snapshot_every_s and snapshot_every_turns must be >= 0 and at most one of them set, "
                             f"got {self.snapshot_every_s}, {self.snapshot_every_turns}")
        if self.snapshot_max_bytes is not None and self.snapshot_max_bytes < 1:
            raise ValueError(f"snapshot_max_bytes must be >= 1 (None: no cap), got {self.snapshot_max_bytes}")
        if self.snapshot_max_age_s is not None and not self.snapshot_max_age_s > 0:
            raise ValueError(f"snapshot_max_age_s must be > 0 (None: no expiry), got {self.snapshot_max_age_s}")
        if not 0 <= self.idle_timeout_s < float("inf"):
            raise ValueError(f"idle_timeout_s must be >= 0 seconds (0: no timeout), got {self.idle_timeout_s}")
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
        self.queued = 0  # chat completions waiting for room (`admit`)

    @functools.cached_property
    def frame_encoder(self) -> AudioFrameEncoder:
        """The native protocol's `AudioFrameEncoder` (built on first use)."""
        return AudioFrameEncoder(self.model, chunk_tokens=self.chunk_tokens, answer_tokens=self.worker.tau)

    @functools.cached_property
    def prompt_scorer(self) -> PromptScorer:
        """The completions route's `PromptScorer` (built on first use; texts up to `max_scored_tokens`)."""
        return PromptScorer(self.model, max_tokens=self.options.max_scored_tokens)

    def new_session_id(self, prefix: str) -> str:
        self._next += 1
        return f"{prefix}{self._next}"

    def conversation(self) -> Conversation:
        return Conversation(self.model, self.tokenizer, self.chunk_tokens)

    @property
    def retry_after_s(self) -> int:
        """The `Retry-After` a refused request is given: a whole number of seconds, at least one frame budget."""
        return max(1, math.ceil(self.options.frame_ms / 1000.0))

    @contextlib.asynccontextmanager
    async def session(self, client: str, prefix: str, snapshot: SessionSnapshot | None = None, *,
                      queue: bool = False) -> AsyncIterator[str]:
        """Opens an engine session for `client` (raises `Overloaded`), resuming `snapshot` when given; yields its
        id, closes it. With `queue`, a session the server cannot admit now waits up to `queue_timeout_s` for room
        (at most `max_queued` waiting at once) before `Overloaded`, whose message then names the wait."""
        timeout = self.options.queue_timeout_s if queue else 0.0
        deadline = time.monotonic() + timeout
        waiting = False
        try:
            while True:
                try:
                    sid = await self._open(client, prefix, snapshot)
                    break
                except Overloaded as e:
                    left = deadline - time.monotonic()
                    if self.worker.stopping:
                        raise
                    if left <= 0:
                        if not waiting:
                            raise
                        raise Overloaded(f"{e}; no room came within the queue timeout of {timeout:g} s "
                                         f"(--queue-timeout)", cap=e.cap, current=e.current) from e
                    if not waiting:
                        if self.queued >= self.options.max_queued:
                            raise Overloaded(f"{e}; and {self.queued} requests already wait for room, the most the "
                                             f"server queues (max_queued)", cap=e.cap, current=e.current) from e
                        waiting, self.queued = True, self.queued + 1
                    await self.worker.wait_capacity(left)
        finally:
            if waiting:
                self.queued -= 1
        try:
            yield sid
        finally:
            try:
                await self.worker.close(sid)
            finally:
                self.per_client[client] -= 1
                if self.per_client[client] <= 0:
                    del self.per_client[client]

    async def _open(self, client: str, prefix: str, snapshot: SessionSnapshot | None) -> str:
        cap = self.options.max_sessions_per_client
        if self.per_client[client] >= cap:
            raise Overloaded(f"this client already holds {self.per_client[client]} sessions, the most one client "
                             f"may hold ({cap}); close one first", cap=cap, current=self.per_client[client])
        sid = self.new_session_id(prefix)
        self.per_client[client] += 1
        try:
            await self.worker.open(sid, snapshot)
        except BaseException:
            self.per_client[client] -= 1
            if self.per_client[client] <= 0:
                del self.per_client[client]
            raise
        return sid
