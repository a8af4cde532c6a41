"""What `omnijax serve` does around the server: its command line, refusing a busy port before loading anything, and
letting SIGTERM unwind."""

from __future__ import annotations

import argparse
import contextlib
import errno
import signal
import socket
import threading
from collections.abc import Iterator

from omnijax.retention.recall import Recall, parse_recall
from omnijax.serve.realtime.snapshot_store import parse_duration, parse_every

API_KEY_ENV = "OMNIJAX_API_KEY"  # the bearer key when --api-key is not given


class _Terminated(Exception):
    """SIGTERM arrived (raised by the handler `terminated_on_sigterm` installs)."""


@contextlib.contextmanager
def terminated_on_sigterm() -> Iterator[list[bool]]:
    """While the server loads, warms up and serves, SIGTERM unwinds the stack (so the demo model's temporary folder is
    removed: its default action killed the process at once, leaving ~90 MB behind each time) instead of killing the
    process. Yields a list that holds True once SIGTERM came. uvicorn handles the signal itself while it serves and
    raises it again when it has shut down, which lands here."""
    happened: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield happened
        return

    def handler(signum, frame):
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield happened
    except _Terminated:
        happened.append(True)
    finally:
        signal.signal(signal.SIGTERM, previous)


def port_in_use(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on (another process holds it, or the address is not this machine's), or
    None when it can (port 0 always can). Checked before the model loads: a busy port once cost a 27-70 s warm-up and
    42 lines of tracebacks."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"--host {host!r} does not resolve ({e.strerror})"
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            try:
                probe.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return (f"port {port} on {host} is in use by another process; stop it or choose another port "
                            f"with --port")
                return f"cannot listen on {host}:{port}: {e.strerror}"
    return None


def build_parser(description: str) -> argparse.ArgumentParser:
    """`omnijax serve`'s command line (`description`: its help's first paragraph)."""
    p = argparse.ArgumentParser(prog="omnijax serve", description=description)
    p.add_argument("checkpoint", nargs="?", help="converted omnijax checkpoint directory (with its tokenizer)")
    p.add_argument("--demo-model", action="store_true", help="serve the embedded tiny random model (no download)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--api-key", default=None, help=f"require this bearer key (default: ${API_KEY_ENV}, else none)")
    p.add_argument("--allow-unauthenticated", action="store_true", help="serve with no API key on an interface "
                   "beyond loopback (refused otherwise)")
    p.add_argument("--model-name", default="omnijax", help="the model id clients use")
    p.add_argument("--policy", default="sink_window", help="retention policy shared by all sessions, e.g. "
                   "sink_window, unbounded, omnipick:high_watermark=2500,low_watermark=1800")
    p.add_argument("--sink", type=int, default=16, help="sink_window's S (unless --policy sets it)")
    p.add_argument("--window", type=int, default=1024, help="sink_window's W (unless --policy sets it)")
    p.add_argument("--recall", default=None, help="recall evicted units at each question (issue 40: every session "
                   "keeps a host tier): key=value,... of omnijax.retention.recall.Recall, e.g. budget=256 or "
                   "budget=512,top_units=4,scoring=two_stage (budget: cells, at most --pages x --page-size)")
    p.add_argument("--pages", type=int, default=256, help="shared KV pool pages")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--frame-ms", type=float, default=1000.0, help="frame budget B: input audio frames of B ms")
    p.add_argument("--chunk-tokens", type=int, default=None, help="per-tick chunk length T (default: the next power "
                   "of two holding a frame's audio unit, at least 32)")
    p.add_argument("--answer-tokens", type=int, default=8, help="tau: answer tokens per session per tick")
    p.add_argument("--per-token", action=argparse.BooleanOptionalAction, default=True,
                   help="stream chat answers one token at a time (host-driven ticks while an answer decodes; "
                   "--no-per-token: blocks of tau tokens per tick)")
    p.add_argument("--aimd-target", type=float, default=0.3,
                   help="AIMD latency target as a fraction of B (Metronome: 600 ms of a 2 s budget); 0 disables")
    p.add_argument("--buckets", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="engine batch buckets")
    p.add_argument("--max-sessions-per-client", type=int, default=16)
    p.add_argument("--max-output-tokens", type=int, default=512, help="the most tokens of one response")
    p.add_argument("--max-message-mb", type=float, default=16.0, help="largest WebSocket message or HTTP body")
    p.add_argument("--max-audio-buffer-s", type=float, default=60.0, help="most seconds of audio held unfed")
    p.add_argument("--max-request-audio-s", type=float, default=600.0, help="most seconds of audio in one chat "
                   "completion (all its input_audio parts)")
    p.add_argument("--max-request-video-s", type=float, default=120.0, help="most seconds of video in one chat "
                   "completion (all its video_url parts)")
    p.add_argument("--max-outbox-mb", type=float, default=64.0, help="a WebSocket client with more than this many "
                   "MiB of server events unread is dropped as a slow consumer")
    p.add_argument("--snapshot-dir", default=None, help="snapshot Realtime sessions here when they end (and on "
                   "SIGTERM) so clients resume them with their token: a directory (created, or tightened to, mode "
                   "0700), or an object store through tensorstore: gs://BUCKET/PREFIX, s3://BUCKET/PREFIX, "
                   "file:///PATH")
    p.add_argument("--snapshot-every", default="0", help="also snapshot each Realtime session periodically, at its "
                   "first idle moment: '30s', '2m', '1h' (after that long since its last snapshot) or '5turns', "
                   "'1turn' (after that many responses; for a native /session session, served frames); a SIGKILL "
                   "then loses at most one interval. 0: only when connections end")
    p.add_argument("--snapshot-max-gb", type=float, default=16.0, help="cap on the snapshot directory's size; the "
                   "oldest snapshots of closed sessions are evicted to make room (0: no cap)")
    p.add_argument("--snapshot-max-age", default="7d", help="delete snapshots not written for this long: '3600', "
                   "'90m', '24h', '7d' (0: never)")
    p.add_argument("--idle-timeout", type=float, default=600.0, help="close (after snapshotting) a Realtime "
                   "connection, or a native /session one, whose client sends nothing for this many seconds "
                   "(0: never)")
    p.add_argument("--queue-timeout", type=float, default=10.0, help="seconds a chat completion or completion the "
                   "server cannot admit waits for room before its 429 (0: refused at once)")
    p.add_argument("--max-queued", type=int, default=64, help="the most requests waiting for room at once")
    p.add_argument("--max-scored-tokens", type=int, default=2048, help="the most tokens (prompt plus completion) "
                   "a /v1/completions request's logprobs may score (one full-context forward)")
    p.add_argument("--max-speech-tokens", type=int, default=4096, help="the talker's tokens at most for one spoken "
                   "answer (chat completions' and Realtime audio output; >= 1)")
    p.add_argument("--talker-window", type=int, default=None, metavar="CELLS", help="bound each spoken answer's "
                   "talker KV: keep its newest CELLS cells (>= 2) beside its 4 oldest, so a speech pool row "
                   "reserves that many pages whatever --max-speech-tokens (default: unbounded, what equals "
                   "transformers)")
    p.add_argument("--speech-first-chunk", type=int, default=4, metavar="FRAMES", help="codec frames of the "
                   "vocoder's first call of each spoken answer (>= 1; 320 ms of speech for Qwen3-Omni; Qwen2.5-Omni "
                   "rounds up to whole DiT blocks of 12)")
    p.add_argument("--speech-chunk", type=int, default=25, metavar="FRAMES", help="codec frames of each later "
                   "vocoder call (>= 1), as --speech-first-chunk")
    p.add_argument("--speak-early", action="store_true", help="Qwen2.5-Omni: chat completions' audio output and "
                   "Realtime's spoken responses speak the answer while it is written (the decode programs also "
                   "return each answer token's row; refused with --recall); default: the finished answer is spoken")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="on SIGTERM, seconds connections get to "
                   "close (responses in flight end at once) before they are cancelled")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="default temperature of sessions that set none (0: the most likely token)")
    p.add_argument("--top-p", type=float, default=1.0, help="default top-p of sessions that set none")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (a request's own seed replaces it)")
    p.add_argument("--warmup-sessions", type=int, default=4, help="compile batch buckets up to this many sessions")
    p.add_argument("--impl", default="xla")
    p.add_argument("--replicas", type=int, default=1, help="serve N engines (N >= 2: one Ray Serve deployment of N "
                   "replicas behind one port, sessions routed by resume token, drained on SIGTERM; needs "
                   "'omnijax[ray]' and a --snapshot-dir every replica sees for sessions to move)")
    return p


def snapshot_options(args: argparse.Namespace) -> dict:
    """The `ServeOptions` fields of `--snapshot-every`, `--snapshot-max-gb`, `--snapshot-max-age`, `--idle-timeout`
    (ValueError naming the flag)."""
    every_s, every_turns = parse_every(args.snapshot_every)
    max_age = parse_duration(args.snapshot_max_age, "--snapshot-max-age")
    if not args.snapshot_max_gb >= 0:
        raise ValueError(f"--snapshot-max-gb must be >= 0 (0: no cap), got {args.snapshot_max_gb}")
    return dict(snapshot_every_s=every_s, snapshot_every_turns=every_turns,
                snapshot_max_bytes=int(args.snapshot_max_gb * 2 ** 30) or None, snapshot_max_age_s=max_age or None,
                idle_timeout_s=args.idle_timeout)


def recall_option(args: argparse.Namespace) -> Recall | None:
    """`--recall` as the sessions' `Recall` (None without it), refused by name (ValueError starting "--recall") where
    the engine would refuse it once the model is loaded: a budget over the pool's `--pages` x `--page-size` cells;
    and a disk tier with `--snapshot-dir` (a snapshot of a tier with spilled units is refused)."""
    if args.recall is None:
        return None
    try:
        recall = parse_recall(args.recall)
        recall.check_pool(args.pages * args.page_size)
    except ValueError as e:
        raise ValueError(str(e) if str(e).startswith("--recall") else f"--recall: {e}") from None
    if recall.disk_dir is not None and args.snapshot_dir is not None:
        raise ValueError("--recall: disk_dir does not work with --snapshot-dir yet (a session's snapshot refuses a "
                         "host tier with units spilled to disk); drop disk_dir or --snapshot-dir")
    return recall
