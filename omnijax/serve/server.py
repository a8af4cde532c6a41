"""`omnijax-serve`: a Metronome WebSocket server streaming 16 kHz PCM audio in and generated tokens out.

Protocol (one WebSocket per session, path `/session`; every JSON message is an object with a `type`):

1. client -> `{"type": "hello", "sample_rate": 16000, "frame_ms": F}`. `sample_rate` must be 16000; `frame_ms` may be
   omitted, otherwise it must equal the server's frame budget B (one frame per tick).
2. server -> `{"type": "ready", "session": id, "sample_rate": 16000, "frame_ms": F, "frame_samples": n}`, or
   `{"type": "error", "code": "overloaded", ...}` and a close (code 1013) when admission (AIMD cap) or the engine
   (no slot) refuses the session.
3. client -> binary messages, each exactly one frame: n = 16000 * F / 1000 int16 little-endian mono samples (2n bytes).
   The k-th binary message has `seq` k (from 0). Text `{"type": "bye"}` ends the session (close code 1000).
4. server -> per served frame `{"type": "frame", "seq": k, "tokens": [...], "text": "..." (only with a tokenizer:
   whole UTF-8 characters, a split one comes with a later frame), "latency_ms": tick start -> reply, "queue_ms":
   arrival -> tick start, "empty": no token although some were asked, "tick_ms": the engine step alone, "dropped":
   tokens the exhausted pool could not hold, "preempted": bool, "occupancy": pool pages in use / pool pages,
   "skipped": frames superseded since the previous reply}`.
   After a `bye`, frames already sent are still served before the close.

Ticks: one asyncio task fires every B seconds (the metronome); it takes each session's latest complete frame (older
unserved frames of that session are superseded and counted in `skipped`), and in a one-thread executor encodes the
frames (PCM -> `log_mel` -> audio encoder -> `audio_unit` chunk padded to the engine's `chunk_tokens`), submits them
and runs one `Engine.tick()`, so the event loop keeps serving sockets meanwhile. Engine `open`/`close` go through the
same executor, hence always between ticks. A tick that overruns B starts the next one at once (no catch-up burst).

Errors: malformed input closes that session only, after `{"type": "error", "code": C, "message": ...}` (close code
1008): `bad_json` (text that is not a JSON object), `bad_message` (unknown or missing `type`), `no_hello` (first
message not a hello), `bad_sample_rate`, `bad_frame_ms`, `odd_byte_count`, `bad_frame_size`, `unsupported` (image
frames are not supported), `hello_timeout`, `not_found` (other paths), `slow_consumer` (replies pile up unread).
Frames are never silently dropped for being malformed; other sessions are not disturbed. A frame that fails inside
the server (encoding, or the whole tick) gets a non-fatal `{"type": "error", "code": "internal", "seq": k}` instead.

Shutdown (SIGINT/SIGTERM, or `MetronomeServer.stop()`): stop accepting, finish the tick in flight and deliver its
frames, then close every session with `{"type": "bye", "reason": "shutdown"}` and a close frame (1001).

Logging (the `omnijax.serve` logger; `omnijax-serve` prints it to stderr with a timestamp): one line per admitted
connection (`connect peer=HOST:PORT session=ID sessions=N`), per refusal or error close (`refuse peer=...
session=ID|- reason=CODE: message`), per session end (`close peer=... session=ID reason=...`), and the warm-up's
progress, bucket by bucket with its time (`warm_up`).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import signal
import sys
import time

import numpy as np

from omnijax.serve.audio_frames import AudioFrameEncoder, frame_tokens
from omnijax.serve.protocol import (CLOSE_ERROR, CLOSE_OVERLOADED, CLOSE_SHUTDOWN, PATH, SAMPLE_RATE, ProtocolError,
                                    decode_frame, frame_samples, parse_hello, parse_json)

log = logging.getLogger("omnijax.serve")
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"

# The protocol and frame-encoding names stay importable from here (`omnijax.serve.server.parse_hello`, ...).
__all__ = ["AudioFrameEncoder", "CLOSE_ERROR", "CLOSE_OVERLOADED", "CLOSE_SHUTDOWN", "MetronomeServer", "PATH",
           "ProtocolError", "SAMPLE_RATE", "ServeConfig", "build_demo_model", "decode_frame", "frame_samples",
           "frame_tokens", "main", "parse_hello", "parse_json", "serve_until_signalled", "warm_up"]


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """Server settings. `frame_ms` is the frame budget B the engine ticks at."""

    host: str = "127.0.0.1"
    port: int = 0
    frame_ms: float = 1000.0
    answer_tokens: int = 4
    hello_timeout_s: float = 10.0
    max_outbox: int = 64


class _Client:
    def __init__(self, sid: str, ws):
        self.sid, self.ws, self.open = sid, ws, True
        self.text = None  # the session's incremental decoder (with a tokenizer)
        self.outbox: asyncio.Queue = asyncio.Queue()  # JSON strings; None ends the writer
        self.latest: tuple[int, np.ndarray, float] | None = None  # (seq, pcm, arrival time)
        self.seq = self.unit = self.skipped = 0
        self.inflight = False  # its frame is in the tick being run
        self.writer: asyncio.Task | None = None


class MetronomeServer:
    """The WebSocket front of an `Engine` (see the module docstring for the protocol).

    Args:
        engine: an `omnijax.serve.engine.Engine`; its `frame_budget_s` should equal `config.frame_ms / 1000`.
        encoder: an `AudioFrameEncoder` (or anything with `encode(pcm_int16, unit) -> Chunk`).
        config: `ServeConfig`.
        admission: optional `omnijax.serve.admission.AIMD`: fed every tick's latency, asked (`check`) on every hello.
        tokenizer: optional `omnijax.models.tokenizer.Tokenizer` (the model's) for the `text` field: each session
            decodes incrementally, so a frame's text holds only whole characters.
    """

    def __init__(self, engine, encoder, config: ServeConfig = ServeConfig(), *, admission=None, tokenizer=None):
        self.engine, self.encoder, self.config = engine, encoder, config
        self.admission, self.tokenizer = admission, tokenizer
        self.samples = frame_samples(config.frame_ms)
        self.clients: dict[str, _Client] = {}
        self.stats = {"ticks": 0, "overruns": 0, "rejected": 0, "errors": 0, "sessions": 0, "tick_errors": 0}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="omnijax-tick")
        self._stopping = asyncio.Event()
        self._ws_server = self._tick_task = None
        self._next_id = self._joining = 0
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Binds (`config.port` 0 picks a free port, see `port`) and starts the tick loop."""
        from websockets.asyncio.server import serve

        self._ws_server = await serve(self._handle, self.config.host, self.config.port, max_size=1 << 20,
                                      ping_interval=None)
        self._tick_task = asyncio.create_task(self._tick_loop())

    @property
    def port(self) -> int:
        return self._ws_server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"ws://{self.config.host}:{self.port}{PATH}"

    async def stop(self) -> None:
        """Graceful shutdown: stop accepting, finish the current tick, close every session (1001)."""
        self._stopping.set()
        self._ws_server.close(close_connections=False)  # stop listening; open sessions keep their handlers
        await self._tick_task
        bye = {"type": "bye", "reason": "shutdown"}
        await asyncio.gather(*(self._drop(c, bye, CLOSE_SHUTDOWN, "server shutting down")
                               for c in list(self.clients.values())))
        await self._ws_server.wait_closed()
        self._pool.shutdown(wait=True)

    async def _in_engine(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ----------------------------------------------------------------------------------------------- connections
    async def _reject(self, ws, code: str, message: str, close_code: int = CLOSE_ERROR, sid: str | None = None) -> None:
        from websockets.exceptions import ConnectionClosed

        self.stats["rejected" if close_code != CLOSE_ERROR else "errors"] += 1
        log.warning("refuse peer=%s session=%s reason=%s: %s", _peer(ws), sid or "-", code, message)
        try:
            await ws.send(json.dumps({"type": "error", "code": code, "message": message}))
            await ws.close(close_code, code)
        except ConnectionClosed:
            pass

    async def _handle(self, ws) -> None:
        from websockets.exceptions import ConnectionClosed

        if ws.request.path.split("?")[0] != PATH:
            return await self._reject(ws, "not_found", f"connect to {PATH}")
        try:
            samples = parse_hello(await asyncio.wait_for(ws.recv(), self.config.hello_timeout_s),
                                  frame_ms=self.config.frame_ms)
        except ConnectionClosed:
            return
        except asyncio.TimeoutError:
            return await self._reject(ws, "hello_timeout", f"no hello within {self.config.hello_timeout_s:g} s")
        except ProtocolError as e:
            return await self._reject(ws, e.code, str(e))
        if self._stopping.is_set():
            return await self._reject(ws, "shutdown", "server is shutting down", CLOSE_SHUTDOWN)
        sid = f"s{self._next_id}"
        self._next_id += 1
        self._joining += 1  # counted by admission while the engine opens it
        try:
            if self.admission is not None:
                self.admission.check(len(self.clients) + self._joining - 1)  # Overloaded names cap and latency
            await self._in_engine(self.engine.open, sid)  # Overloaded when the engine has no slot
        except RuntimeError as e:
            return await self._reject(ws, "overloaded", str(e), CLOSE_OVERLOADED, sid)
        finally:
            self._joining -= 1
        client = self.clients[sid] = _Client(sid, ws)
        self.stats["sessions"] += 1
        log.info("connect peer=%s session=%s sessions=%d", _peer(ws), sid, len(self.clients))
        client.writer = asyncio.create_task(self._writer(client))
        client.outbox.put_nowait(json.dumps({"type": "ready", "session": sid, "sample_rate": SAMPLE_RATE,
                                             "frame_ms": self.config.frame_ms, "frame_samples": samples}))
        loop = asyncio.get_running_loop()
        try:
            if self._stopping.is_set():  # stop() began while the engine opened this session
                return await self._drop(client, {"type": "bye", "reason": "shutdown"}, CLOSE_SHUTDOWN, "shutdown")
            async for message in ws:
                if isinstance(message, bytes):
                    pcm = decode_frame(message, samples)
                    client.skipped += client.latest is not None
                    client.latest, client.seq = (client.seq, pcm, loop.time()), client.seq + 1
                    continue
                kind = parse_json(message)["type"]
                if kind == "bye":  # serve what was sent (at most ~2 ticks), then close
                    deadline = loop.time() + 2.5 * self.config.frame_ms / 1000
                    while (client.latest is not None or client.inflight) and loop.time() < deadline:
                        await asyncio.sleep(0.005)
                    return await self._drop(client, None, 1000, "bye")
                if kind == "image":
                    raise ProtocolError("unsupported", "image frames are not supported by this server (audio only)")
                raise ProtocolError("bad_message", f"unexpected message type {kind!r} (expected binary PCM or bye)")
        except ProtocolError as e:
            self.stats["errors"] += 1
            log.warning("refuse peer=%s session=%s reason=%s: %s", _peer(ws), sid, e.code, e)
            await self._drop(client, {"type": "error", "code": e.code, "message": str(e)}, CLOSE_ERROR, e.code)
        except ConnectionClosed:
            pass
        finally:
            await self._drop(client, None, 1000, "")

    async def _writer(self, client: _Client) -> None:
        from websockets.exceptions import ConnectionClosed

        while (message := await client.outbox.get()) is not None:
            try:
                await client.ws.send(message)
            except ConnectionClosed:
                pass

    async def _drop(self, client: _Client, last: dict | None, code: int, reason: str) -> None:
        """Removes a session: flush its replies (+ `last`), send the close frame, free its engine slot."""
        if not client.open:
            return
        client.open = False
        self.clients.pop(client.sid, None)
        log.info("close peer=%s session=%s reason=%s frames=%d", _peer(client.ws), client.sid,
                 reason or "disconnected", client.seq)
        if last is not None:
            client.outbox.put_nowait(json.dumps(last))
        client.outbox.put_nowait(None)
        try:
            await asyncio.wait_for(asyncio.shield(client.writer), 5.0)
        except asyncio.TimeoutError:  # the peer does not read: give up on the rest
            client.writer.cancel()
        try:
            await client.ws.close(code, reason)
        finally:
            await self._in_engine(self._close_engine, client.sid)

    def _close_engine(self, sid: str) -> None:
        try:
            self.engine.close(sid)
        except KeyError:
            pass

    # ----------------------------------------------------------------------------------------------------- ticks
    async def _tick_loop(self) -> None:
        loop = asyncio.get_running_loop()
        budget = self.config.frame_ms / 1000.0
        next_t = loop.time() + budget
        while not self._stopping.is_set():
            try:
                await asyncio.wait_for(self._stopping.wait(), max(0.0, next_t - loop.time()))
                break
            except asyncio.TimeoutError:
                pass
            start = loop.time()
            due = [(c, c.latest, c.skipped) for c in self.clients.values() if c.latest is not None]
            for c, _, _ in due:
                c.latest, c.skipped, c.inflight = None, 0, True
            if due:
                try:
                    report, failed = await self._in_engine(self._tick_sync, due)
                except Exception as e:  # keep the beat; the frames of this tick are lost, and said so
                    self.stats["tick_errors"] += 1
                    report, failed = None, {c.sid: f"tick failed: {type(e).__name__}: {e}" for c, _, _ in due}
                self._deliver(due, report, failed, start, loop.time())
            next_t += budget
            if next_t < loop.time():
                self.stats["overruns"] += 1
                next_t = loop.time()

    def _tick_sync(self, due):
        """In the executor: encode and submit each due frame, then one engine tick. Returns (report, failures)."""
        failed = {}
        for client, (seq, pcm, _), _ in due:
            try:
                if client.open:
                    self.engine.submit(client.sid, self.encoder.encode(pcm, client.unit), self.config.answer_tokens)
                    client.unit += 1
            except KeyError:  # closed meanwhile
                pass
            except Exception as e:  # noqa: BLE001 - one session's frame must not stop the tick
                failed[client.sid] = f"frame {seq} could not be encoded: {type(e).__name__}: {e}"
        return self.engine.tick(), failed

    def _deliver(self, due, report, failed: dict, start: float, now: float) -> None:
        self.stats["ticks"] += 1
        latency = now - start
        if self.admission is not None:
            self.admission.observe(latency, len(self.clients))
        for client, (seq, _, arrival), skipped in due:
            client.inflight = False
            if client.sid in failed:
                err = {"type": "error", "code": "internal", "seq": seq, "message": failed[client.sid]}
                client.outbox.put_nowait(json.dumps(err))
                continue
            out = report.outputs.get(client.sid)
            if not client.open or out is None:
                continue
            tokens = [int(t) for t in out.tokens]
            message = {"type": "frame", "seq": seq, "tokens": tokens, "latency_ms": 1e3 * latency,
                       "queue_ms": 1e3 * (start - arrival), "tick_ms": 1e3 * report.latency_s,
                       "empty": self.config.answer_tokens > 0 and not tokens, "dropped": int(out.dropped),
                       "preempted": bool(out.preempted), "skipped": skipped, "occupancy": float(report.occupancy)}
            if self.tokenizer is not None:  # whole UTF-8 characters: one split across frames comes whole later
                if client.text is None:
                    client.text = self.tokenizer.stream_decoder(skip_special_tokens=True)
                message["text"] = client.text.push(tokens)
            if client.outbox.qsize() >= self.config.max_outbox:
                err = {"type": "error", "code": "slow_consumer", "message": "replies pile up unread"}
                log.warning("refuse peer=%s session=%s reason=slow_consumer: %d replies unread", _peer(client.ws),
                            client.sid, client.outbox.qsize())
                task = asyncio.create_task(self._drop(client, err, CLOSE_ERROR, "slow_consumer"))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                continue
            client.outbox.put_nowait(json.dumps(message))


def _peer(ws) -> str:
    """`host:port` of a connection's remote end ("?" when the transport does not say)."""
    try:
        address = ws.remote_address
    except Exception:  # noqa: BLE001 - a closed transport
        address = None
    if isinstance(address, (tuple, list)) and len(address) >= 2:
        return f"{address[0]}:{address[1]}"
    return "?" if address is None else str(address)


# --------------------------------------------------------------------------------------------------- command line
def build_demo_model(directory) -> str:
    """Writes the embedded tiny random Qwen2.5-Omni (with an audio encoder) and converts it; no download."""
    from pathlib import Path

    from convert import convert_checkpoint
    from omnijax import demo

    directory = Path(directory)
    src = demo.write_tiny_hf_checkpoint(directory / "hf", text_config=demo.TINY_OMNI_TEXT_CONFIG)
    return str(convert_checkpoint(src, directory / "omnijax", progress=False, log=lambda _: None))


def warm_up(engine, encoder, samples: int, sessions: int) -> float:
    """Compiles the encoder and the engine's tick for every batch bucket that 1..`sessions` sessions use (dummy
    sessions, closed afterwards, so their pages return to the pool). Returns the seconds spent.

    Progress goes to the `omnijax.serve` logger (INFO): the audio encoder, then each bucket as it compiles and the
    seconds it took, then the total."""
    start = time.perf_counter()
    silence = np.zeros(samples, np.int16)
    limit = min(max(1, sessions), engine.config.buckets[-1])
    buckets = sorted({next(b for b in engine.config.buckets if b >= n) for n in range(1, limit + 1)})
    log.info("warm-up: compiling the audio encoder for %d-sample frames", samples)
    t = time.perf_counter()
    chunk = encoder.encode(silence, 0)
    log.info("warm-up: audio encoder ready in %.1f s", time.perf_counter() - t)
    for k, b in enumerate(buckets, 1):  # b sessions run at bucket b
        log.info("warm-up: compiling the engine tick for bucket %d (%d/%d: batch of %d sessions, %d tokens each)",
                 b, k, len(buckets), b, int(np.shape(chunk.token_ids)[-1]))
        t = time.perf_counter()
        ids = [f"warmup-{b}-{i}" for i in range(b)]
        for sid in ids:
            engine.open(sid)
            engine.submit(sid, chunk, 0)
        engine.tick()
        for sid in ids:
            engine.close(sid)
        log.info("warm-up: bucket %d ready in %.1f s", b, time.perf_counter() - t)
    seconds = time.perf_counter() - start
    log.info("warm-up: done, %d bucket(s) %s in %.1f s", len(buckets), list(buckets), seconds)
    return seconds


async def serve_until_signalled(server: MetronomeServer) -> None:
    """Starts `server`, prints its URL and stops it gracefully on SIGINT/SIGTERM."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    print(f"omnijax-serve: listening on {server.url}", flush=True)
    await stop.wait()
    print("omnijax-serve: shutting down", flush=True)
    await server.stop()
    print(f"omnijax-serve: stopped ({server.stats})", flush=True)


def main(argv=None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", nargs="?", help="converted omnijax checkpoint directory (with an audio encoder)")
    parser.add_argument("--demo-model", action="store_true", help="serve the embedded tiny random model (no download)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765, help="0 picks a free port")
    parser.add_argument("--policy", default="sink_window",
                        help="retention policy: a registered name with optional settings, e.g. sink_window, "
                             "unbounded (NoSlide), omnipick:high_watermark=2500,low_watermark=1800")
    parser.add_argument("--sink", type=int, default=16, help="sink_window's S (unless --policy sets it)")
    parser.add_argument("--window", type=int, default=1024, help="sink_window's W (unless --policy sets it)")
    parser.add_argument("--pages", type=int, default=256, help="shared KV pool pages")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--frame-ms", type=float, default=1000.0, help="frame budget B (one frame per tick)")
    parser.add_argument("--answer-tokens", type=int, default=4, help="greedy tokens per frame (tau)")
    parser.add_argument("--aimd-target", type=float, default=0.6,
                        help="AIMD latency target as a fraction of B (0 disables admission control)")
    parser.add_argument("--buckets", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128],
                        help="engine batch buckets (the largest is the most sessions held)")
    parser.add_argument("--warmup-sessions", type=int, default=8, help="compile batch buckets up to this many")
    parser.add_argument("--impl", default="xla")
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:  # connections, refusals and warm-up progress, one line each, to stderr
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    log.setLevel(logging.INFO)
    if bool(args.checkpoint) == args.demo_model:
        parser.error("give a checkpoint directory or --demo-model (not both)")
    try:
        samples = frame_samples(args.frame_ms)
    except ValueError as e:
        parser.error(str(e))
    chunk_tokens = frame_tokens(samples)
    if chunk_tokens < 3:
        parser.error(f"--frame-ms {args.frame_ms:g} gives no audio token: frames must be at least 30 ms")

    import omnijax
    from omnijax.retention import get_policy
    from omnijax.serve.admission import AIMD
    from omnijax.serve.engine import Engine, EngineConfig

    with tempfile.TemporaryDirectory(prefix="omnijax-serve-") as tmp:
        path = build_demo_model(tmp) if args.demo_model else args.checkpoint
        try:
            model = omnijax.load(path)
            chunk_tokens = frame_tokens(samples, model)  # the model family's audio tokens per frame
            # --sink and --window are sink_window's settings where --policy does not give them.
            policy = get_policy(args.policy, defaults={"sink_window": dict(sink=args.sink, window=args.window)})
            stream = omnijax.StreamConfig(policy=policy, num_pages=args.pages, page_size=args.page_size,
                                          max_answer_tokens=args.answer_tokens, impl=args.impl)
            config = EngineConfig(stream, chunk_tokens=chunk_tokens, frame_budget_s=args.frame_ms / 1000.0,
                                  buckets=tuple(args.buckets), return_logits=False)
        except (ValueError, KeyError, TypeError) as e:  # an unreadable checkpoint or a bad engine setting
            print(f"omnijax-serve: error: {e}", file=sys.stderr)
            return 1
        engine = Engine(model, config)
        encoder = AudioFrameEncoder(model, chunk_tokens=chunk_tokens, answer_tokens=args.answer_tokens)
        seconds = warm_up(engine, encoder, samples, args.warmup_sessions)
        print(f"omnijax-serve: {path}: {policy}, pool "
              f"{args.pages}x{args.page_size}, B={args.frame_ms:g} ms ({samples} samples, {chunk_tokens} tokens per "
              f"frame), warm-up {seconds:.1f} s", flush=True)
        admission = AIMD(target_fraction=args.aimd_target, frame_budget_s=args.frame_ms / 1000.0,
                         max_cap=max(config.buckets)) if args.aimd_target > 0 else None
        server = MetronomeServer(engine, encoder, ServeConfig(host=args.host, port=args.port, frame_ms=args.frame_ms,
                                                              answer_tokens=args.answer_tokens),
                                 admission=admission, tokenizer=model.tokenizer)
        asyncio.run(serve_until_signalled(server))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
