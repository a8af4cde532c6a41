"""`omnijax serve`: the OpenAI-compatible server on one port (Starlette on uvicorn) in front of the Metronome engine.

Routes (every one behind the API key when one is set):

- `WS /v1/realtime` — the OpenAI Realtime API (GA events), text output (`omnijax.serve.realtime.session`);
- `POST /v1/chat/completions` — chat completions, `stream: true` as server-sent events
  (`omnijax.serve.chat_completions`);
- `POST /v1/completions` — text completions of raw prompts (strings or token ids), `echo` and `logprobs` of the
  prompt's tokens, streaming (`omnijax.serve.completions`);
- `GET /v1/models`, `GET /v1/models/{model}` — the served model (the SDK's `models.list` / `models.retrieve`);
- `WS /session` — omnijax's native per-frame protocol, the lowest-overhead path (`omnijax.serve.native.session`).

One `EngineWorker` runs the engine's ticks as a background task of the server's event loop, the model step in an
executor thread, so sockets keep being served while a tick runs. Security: loopback by default; `--api-key` (or
`OMNIJAX_API_KEY`) is checked on the `Authorization: Bearer` header of every request and WebSocket handshake (401
otherwise); caps on message size, audio buffer length, sessions per client and in total (AIMD admission, then the
engine's largest bucket): a refused session gets HTTP 429 or an `error` event and close code 1013.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import uvicorn
from starlette.applications import Starlette

from omnijax import compilation_cache
from omnijax.checkpoint.format import read_manifest_dict
from omnijax.convert import convert_checkpoint
from omnijax.decoding import RowSampling
from omnijax.models.family import OmniModel
from omnijax.models.frontend import bucket, units_for
from omnijax.models.registry import load
from omnijax.retention import get_policy
from omnijax.serve import launch
from omnijax.serve.asgi import BROWSER_KEY_PREFIX, REALTIME_SUBPROTOCOL, ApiKeyMiddleware, build_app, is_loopback
from omnijax.serve.audio_frames import frame_tokens
from omnijax.serve.cluster import launch as cluster
from omnijax.serve.cluster import replica as cluster_replica
from omnijax.serve.context import ServeContext, ServeOptions
from omnijax.serve.engine.admission import AIMD
from omnijax.serve.engine.engine import Engine, EngineConfig
from omnijax.serve.engine.recall_warmup import warm_up_recall
from omnijax.serve.engine.worker import EngineWorker
from omnijax.serve.launch import API_KEY_ENV, port_in_use, terminated_on_sigterm
from omnijax.serve.native.protocol import frame_samples
from omnijax.serve.realtime import resume as realtime_resume
from omnijax.serve.speech_engine import speech_config_for, warm_up_pool
from omnijax.serve.structured import JSON_OBJECT, Grammar, compile_format
from omnijax.streaming.config import StreamConfig
from omnijax.testing import checkpoints as demo

log = logging.getLogger("omnijax.serve")

# `build_app`, `ApiKeyMiddleware`, `is_loopback` and the subprotocol names live in `omnijax.serve.asgi`; read here too
__all__ = ["API_KEY_ENV", "BROWSER_KEY_PREFIX", "REALTIME_SUBPROTOCOL", "TEXT_CHUNK_TOKENS", "ApiKeyMiddleware",
           "BackgroundServer", "build_app", "build_context", "build_demo_model", "default_chunk_tokens", "is_loopback",
           "main", "replica_app", "serve", "warm_up"]


def build_context(model: OmniModel, *, options: ServeOptions, stream: StreamConfig, chunk_tokens: int,
                  buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
                  aimd_target: float = 0.3, max_sessions: int | None = None,
                  return_logits: bool = False, per_token: bool = False) -> ServeContext:
    """The engine, AIMD admission and worker for `model`.

    Args:
        model: a loaded `omnijax.Model` with a tokenizer.
        options: `ServeOptions`.
        stream: the sessions' `omnijax.StreamConfig` (retention policy, pool, tau, decoding).
        chunk_tokens: T, the engine's per-tick chunk length.
        buckets: the engine's batch buckets.
        aimd_target: the AIMD latency target as a fraction of B (0 disables admission control).
        max_sessions: the most sessions open at once (default: the largest bucket).
        return_logits: copy each frame's last logits to the host (duplex sessions decide on them).
        per_token: chat answers stream per token (`EngineConfig.per_token`).
    """

    if model.tokenizer is None:
        raise ValueError("omnijax serve needs the checkpoint's tokenizer (tokenizer.json, tokenizer_config.json) to "
                         "render chat templates and decode text; copy the release's tokenizer files into the "
                         "converted checkpoint")
    budget = options.frame_ms / 1000.0
    speech = speech_config_for(model, max_speech_tokens=options.max_speech_tokens,  # Qwen3-Omni: its speech pool
                               context_tokens=stream.num_pages * stream.page_size,
                               talker_window=options.talker_window, early_start=options.speak_early,
                               first_chunk=options.speech_first_chunk, chunk=options.speech_chunk)
    config = EngineConfig(stream, chunk_tokens=chunk_tokens, frame_budget_s=budget, buckets=tuple(buckets),
                          return_logits=return_logits, per_token=per_token, speech=speech)
    engine = Engine(model, config)
    admission = (AIMD(target_fraction=aimd_target, frame_budget_s=budget, max_cap=max(config.buckets))
                 if aimd_target > 0 else None)
    return ServeContext(model, EngineWorker(engine, admission=admission, max_sessions=max_sessions), options)


def warm_up(context: ServeContext, sessions: int, *, structured: bool = True) -> float:
    """Compiles the audio encoder for one frame and the engine's tick for the buckets 1..`sessions` sessions use
    (dummy sessions, closed afterwards), the recall programs for those buckets where the sessions recall
    (`recall_warmup.warm_up_recall`), and the speech pool's programs for one speaking session where the engine has
    one (`speech_engine.warm_up_pool`). Progress goes to the `omnijax.serve` logger. Returns the seconds spent.

    With `structured` (what `omnijax serve` does), structured output is made ready too, so that the first
    `response_format` request compiles nothing: llguidance's tokenizer for the served one (its token trie, seconds
    on a large vocabulary) is built on a helper thread while the ticks compile, then each bucket runs one tick whose
    first row draws under a `json_object` constraint, which compiles the host-driven prefill and the masked
    one-token program. Without llguidance (or with a tokenizer it cannot read) the `response_format` requests are
    refused by name at request time; the warm-up logs why and skips that tick."""
    start = time.perf_counter()
    engine, units = context.worker.engine, units_for(context.model)
    with ThreadPoolExecutor(1, thread_name_prefix="omnijax-warmup") as helper:  # no thread unless structured
        pending = helper.submit(_json_grammar, context) if structured else None
        if context.model.audio is not None:
            t = time.perf_counter()
            units.audio(np.zeros(int(16 * context.options.frame_ms), np.float32), 16_000, 0)
            log.info("warm-up: audio encoder ready for %g ms frames in %.1f s", context.options.frame_ms,
                     time.perf_counter() - t)
        chunk = units.continuation(0, 0)
        limit = min(max(1, sessions), engine.config.buckets[-1])
        buckets = sorted({next(b for b in engine.config.buckets if b >= n) for n in range(1, limit + 1)})
        tau = engine.config.max_answer_tokens
        for k, b in enumerate(buckets, 1):
            t = time.perf_counter()
            ids = [f"warmup-{b}-{i}" for i in range(b)]
            for sid in ids:
                engine.open(sid)
                engine.submit(sid, chunk, 0)
            engine.tick(per_token=False)
            if engine.config.per_token and tau:  # the host-driven programs too
                for sid in ids:
                    engine.submit(sid, units.continuation(0, 1), 1)
                engine.tick(per_token=True)
            grammar = pending.result() if pending is not None and tau else None  # set up on the helper thread
            if grammar is not None:  # the prefill of a host-driven tick and the masked token step
                for sid in ids:
                    engine.submit(sid, units.continuation(0, 1), 1)
                engine.tick(constraints={ids[0]: grammar.constraint()})
            for sid in ids:
                engine.close(sid)
            log.info("warm-up: engine tick for bucket %d (%d/%d) ready in %.1f s", b, k, len(buckets),
                     time.perf_counter() - t)
        if engine.recall is not None:  # the recall programs, so that a session's first question compiles nothing
            t = time.perf_counter()
            log.info("warm-up: recall ready (%s) in %.1f s", warm_up_recall(engine, buckets), time.perf_counter() - t)
        if engine.speech is not None:  # the speech pool's programs for one speaking session
            t = time.perf_counter()
            log.info("warm-up: speech pool ready for talker prompts of %s tokens in %.1f s",
                     warm_up_pool(engine), time.perf_counter() - t)
    return time.perf_counter() - start


def _json_grammar(context: ServeContext) -> Grammar | None:
    """`json_object` compiled for the served tokenizer (builds llguidance's tokenizer, cached for the requests), or
    None, logged, when structured output cannot run here (requests for it are then refused by name)."""
    t = time.perf_counter()
    engine = context.worker.engine
    try:
        grammar = compile_format(JSON_OBJECT, context.tokenizer, engine.model_config.vocab_size,
                                 context.worker.stop_ids)
    except ValueError as e:  # FormatError (llguidance missing) too
        log.info("warm-up: structured output unavailable (response_format requests are refused): %s", e)
        return None
    log.info("warm-up: structured output's tokenizer ready in %.1f s", time.perf_counter() - t)
    return grammar


def build_demo_model(directory: str | Path) -> str:
    """Writes the embedded tiny random Qwen2.5-Omni (audio and vision encoders, a tiny tokenizer with the ChatML
    template) and converts it; no download. Returns the converted checkpoint's directory."""
    hf = demo.write_chat_checkpoint(Path(directory) / "hf")
    return str(convert_checkpoint(hf, Path(directory) / "omnijax", progress=False, log=lambda _: None))


def main(argv: Sequence[str] | None = None) -> int:
    compilation_cache.enable()  # a command line caches its compiled programs (OMNIJAX_COMPILATION_CACHE)
    parser = launch.build_parser(__doc__.split("\n\n")[0])
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log.setLevel(logging.INFO)
    if bool(args.checkpoint) == args.demo_model:
        parser.error("give a checkpoint directory or --demo-model (not both)")

    try:
        # `--api-key ""` is refused like an empty OMNIJAX_API_KEY (ServeOptions), never read as "no key".
        api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
        if not 0 < args.max_outbox_mb < float("inf"):
            raise ValueError(f"--max-outbox-mb must be a positive number of MiB, got {args.max_outbox_mb}")
        options = ServeOptions(host=args.host, port=args.port, api_key=api_key,
                               model_name=args.model_name, frame_ms=args.frame_ms,
                               max_message_bytes=int(args.max_message_mb * 2 ** 20),
                               max_audio_buffer_s=args.max_audio_buffer_s,
                               max_request_audio_s=args.max_request_audio_s,
                               max_request_video_s=args.max_request_video_s,
                               max_outbox_bytes=int(args.max_outbox_mb * 2 ** 20),
                               max_sessions_per_client=args.max_sessions_per_client,
                               max_output_tokens=args.max_output_tokens, snapshot_dir=args.snapshot_dir,
                               queue_timeout_s=args.queue_timeout, max_queued=args.max_queued,
                               max_scored_tokens=args.max_scored_tokens, max_speech_tokens=args.max_speech_tokens,
                               talker_window=args.talker_window, speak_early=args.speak_early,
                               speech_first_chunk=args.speech_first_chunk, speech_chunk=args.speech_chunk,
                               shutdown_timeout_s=args.shutdown_timeout,
                               **launch.snapshot_options(args))
        # the snapshot directory is opened (0700, temp folders of killed writes removed, expired snapshots
        # deleted, each logged) before the model loads
        store = realtime_resume.open_store(options) if options.snapshot_dir is not None else None
        if args.replicas > 1 and store is not None and str(store.root).startswith("memory://"):
            raise ValueError(f"--snapshot-dir {options.snapshot_dir} is this process's memory, which the replicas "
                             f"(other processes) cannot share; give gs://, s3://, file:/// or a shared directory")
        samples = frame_samples(args.frame_ms)
        launch.recall_option(args)  # a bad --recall is refused before the model loads
    except ValueError as e:
        parser.error(str(e))
    if args.replicas < 1:
        parser.error(f"--replicas must be >= 1, got {args.replicas}")
    if args.replicas > 1 and not cluster.ray_installed():
        parser.error(cluster.RAY_MISSING)
    if frame_tokens(samples) < 3:
        parser.error(f"--frame-ms {args.frame_ms:g} gives no audio token: frames must be at least 30 ms")
    if options.api_key is None and not is_loopback(options.host):
        if not args.allow_unauthenticated:
            parser.error(f"--host {options.host} listens beyond loopback with no API key: anyone who reaches it "
                         f"could use the model; set --api-key (or ${API_KEY_ENV}), or pass --allow-unauthenticated")
        log.warning("SERVING WITHOUT AUTHENTICATION on %s (beyond loopback, no API key; --allow-unauthenticated)",
                    options.host)
    busy = port_in_use(options.host, options.port)
    if busy:
        print(f"omnijax serve: error: {busy}", file=sys.stderr)
        return 1
    code = 1
    with terminated_on_sigterm() as terminated:
        code = _run(args, options, store, samples)
    if terminated:  # the demo model's temporary folder is gone: end by SIGTERM, as the signal asked
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
    return code


TEXT_CHUNK_TOKENS = 64  # T of a model that hears no audio frames (text, and images where it sees them)


def default_chunk_tokens(model: OmniModel, samples: int) -> int:
    """The engine's padded per-tick length T when `--chunk-tokens` is not given: MiniCPM-o's duplex unit with a video
    frame (77 rows) in 128; one audio frame of `samples` samples (its tokens and markers, rounded up to a bucket,
    at least 32) for a model that hears frames; `TEXT_CHUNK_TOKENS` for one that hears none (a text-only model such
    as SmolLM2 once failed here with "does not hear PCM frames")."""
    family = model.family
    if family.duplex:
        return 128
    if model.audio is None or family.frame_tokens is None or family.frame_unit is None:
        return TEXT_CHUNK_TOKENS
    return max(32, bucket(frame_tokens(samples, model)))


def _run(args: argparse.Namespace, options: ServeOptions, store: Any, samples: int) -> int:
    """Loads the model (or builds the demo one in a temporary folder), warms up and serves until stopped; with
    `--replicas` N >= 2, every replica does that (`replica_app`) behind Ray Serve (`omnijax.serve.cluster`)."""
    with tempfile.TemporaryDirectory(prefix="omnijax-serve-") as tmp:
        path = build_demo_model(tmp) if args.demo_model else args.checkpoint
        if args.replicas > 1:
            try:
                read_manifest_dict(path)  # not a checkpoint: refused here, before a Ray cluster starts
            except ValueError as e:
                print(f"omnijax serve: error: {e}", file=sys.stderr)
                return 1
            return cluster.serve_replicas(args.replicas, functools.partial(replica_app, path, args, options, samples),
                                          host=options.host, port=options.port,
                                          max_ongoing=max(args.buckets) + options.max_queued + 8)
        try:
            context, summary = _loaded(path, args, options, store, samples)
        except (ValueError, KeyError, TypeError) as e:
            print(f"omnijax serve: error: {e}", file=sys.stderr)
            return 1
        print(summary, flush=True)
        asyncio.run(serve(context))
    return 0


def _loaded(path: str, args: argparse.Namespace, options: ServeOptions, store: Any,
            samples: int) -> tuple[ServeContext, str]:
    """The warmed-up context of the checkpoint at `path` for the command line's settings, and its summary line."""
    model = load(path)
    duplex = model.family.duplex  # duplex decides on host logits
    # MiniCPM-o: a duplex unit with a video frame is 77 rows
    chunk_tokens = args.chunk_tokens or default_chunk_tokens(model, samples)
    policy = get_policy(args.policy, defaults={"sink_window": dict(sink=args.sink, window=args.window)})
    # each session (request) may set its own temperature / top_p / seed: one program for all of them
    decoding = RowSampling(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    stream = StreamConfig(policy=policy, num_pages=args.pages, page_size=args.page_size,
                          max_answer_tokens=args.answer_tokens, impl=args.impl, decoding=decoding,
                          recall=launch.recall_option(args))
    context = build_context(model, options=options, stream=stream, chunk_tokens=chunk_tokens,
                            buckets=args.buckets, aimd_target=args.aimd_target, return_logits=duplex,
                            per_token=args.per_token)
    realtime_resume.attach_store(context, store)
    seconds = warm_up(context, args.warmup_sessions, structured=stream.recall is None)  # recall refuses grammars
    return context, (f"omnijax serve: {path}: {policy}" + (f", {stream.recall}" if stream.recall else "") +
                     f", pool {args.pages}x{args.page_size}, B={args.frame_ms:g} "
                     f"ms, T={chunk_tokens}, tau={args.answer_tokens}, {decoding}; warm-up {seconds:.1f} s")


def replica_app(path: str, args: argparse.Namespace, options: ServeOptions,
                samples: int) -> tuple[ServeContext, Starlette]:
    """One replica of `--replicas N` (run in the replica's process): the context of `_run`, its snapshot store
    opened on the shared `--snapshot-dir` (cleaned once by `main` before any replica starts), and its Starlette
    application."""
    compilation_cache.enable()
    store = cluster_replica.shared_store(options) if options.snapshot_dir is not None else None
    context, summary = _loaded(path, args, options, store, samples)
    print(summary, flush=True)
    return context, build_app(context)


class _Server(uvicorn.Server):
    """uvicorn's server, which on SIGTERM/SIGINT (or `should_exit`) first ends every response in flight
    (`EngineWorker.begin_shutdown`), so the graceful shutdown that follows is bounded by connections closing (their
    snapshots included), not by answers still decoding; `shutdown_timeout_s` bounds the rest."""

    def __init__(self, config: uvicorn.Config, context: ServeContext):
        super().__init__(config)
        self.context = context

    async def on_tick(self, counter: int) -> bool:
        should_exit = await super().on_tick(counter)
        if should_exit and not self.context.worker.stopping:
            log.info("shutting down: ending %d sessions' responses", len(self.context.worker.lanes))
            self.context.worker.begin_shutdown()
        return should_exit


def _uvicorn_server(context: ServeContext) -> uvicorn.Server:
    config = uvicorn.Config(build_app(context), host=context.options.host, port=context.options.port,
                            log_level="warning", ws_max_size=context.options.max_message_bytes, ws_ping_interval=None,
                            # no permessage-deflate: it defeats the byte caps (omnijax.serve.outbox's docstring)
                            ws_per_message_deflate=False, lifespan="on",
                            timeout_graceful_shutdown=context.options.shutdown_timeout_s)
    return _Server(config, context)


async def serve(context: ServeContext) -> None:
    """Runs the server until SIGINT/SIGTERM (uvicorn's handlers stop it gracefully)."""
    server = _uvicorn_server(context)
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        port = server.servers[0].sockets[0].getsockname()[1]
        host = context.options.host
        print(f"omnijax serve: listening on http://{host}:{port}/v1 (Realtime ws://{host}:{port}/v1/realtime); "
              f"native protocol on ws://{host}:{port}/session", flush=True)
    await task


class BackgroundServer:
    """The server of a `ServeContext` in a background thread with its own event loop (tests, benchmarks).

    Example:
        with BackgroundServer(context) as server:
            client = openai.OpenAI(base_url=server.base_url, api_key=key)
    """

    def __init__(self, context: ServeContext, *, timeout_s: float = 120.0):
        self.context, self.timeout_s = context, timeout_s
        self.server: Any = None  # a uvicorn.Server (an optional package) once entered
        self.thread: threading.Thread | None = None
        self.port = 0

    def __enter__(self) -> "BackgroundServer":

        self.server = _uvicorn_server(self.context)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), name="omnijax-serve",
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + self.timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (see the log above)")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def base_url(self) -> str:
        """The OpenAI base URL, `http://host:port/v1`."""
        return f"http://{self.context.options.host}:{self.port}/v1"

    def wait_idle(self, timeout_s: float = 20.0) -> None:
        """Waits until every session is closed, in the worker and in the engine (closing follows a client's
        disconnect, and the engine frees a slot between ticks, after the worker has let the session go; the client's
        per-address count drops on the event loop after that); TimeoutError naming the sessions still open after
        `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        worker, per_client = self.context.worker, self.context.per_client
        while worker.lanes or worker.engine.sessions or per_client:
            if time.monotonic() > deadline:
                raise TimeoutError(f"sessions still open after {timeout_s:g} s: worker {list(worker.lanes)}, "
                                   f"engine {list(worker.engine.sessions)}, per client {dict(per_client)}")
            time.sleep(0.05)

    @property
    def native_url(self) -> str:
        """The native protocol's `ws://host:port/session`."""
        return f"ws://{self.context.options.host}:{self.port}/session"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(self.timeout_s)
