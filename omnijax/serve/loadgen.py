"""Load generator for `omnijax-serve`: real WebSocket clients (asyncio) streaming synthetic speech-like PCM.

Two modes, both bounded in client count (`MAX_CLIENTS`) and duration (`MAX_DURATION_S`):

- `closed_loop(url, sessions=N, duration_s=D)`: N sessions connect together and each sends one frame per frame
  budget for D seconds, phase-staggered (each client's first frame at a random offset in [0, B)).
- `open_loop(url, rate_per_s=λ, max_clients=M, duration_s=D)`: clients arrive at λ per second until M have arrived
  (or the run ends); each admitted client streams until the end of the run (or for `session_s`).

Every client logs each reply: client-side round trip (frame sent -> reply received), the server's `latency_ms`
(tick start -> reply), `queue_ms`, token count, empty / dropped / preempted flags, and the pool occupancy the server
reports. Rejections (`overloaded`) and errors are logged per client. Times are seconds since the run started.

Command line: `python -m omnijax.serve.loadgen ws://127.0.0.1:8765/session --sessions 8 --duration 20`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from collections.abc import Sequence

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

SAMPLE_RATE = 16000
MAX_CLIENTS = 512
MAX_DURATION_S = 900.0


def speech_like_pcm(seconds: float, seed: int = 0, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """`[round(seconds * sample_rate)]` int16 speech-like audio: voiced syllables (a few harmonics of a wandering
    100-250 Hz pitch) at ~4 per second, with short pauses and a little noise. Deterministic for a seed."""
    rng = np.random.default_rng(seed)
    n = int(round(seconds * sample_rate))
    t = np.arange(n) / sample_rate
    pitch = rng.uniform(100, 250) * (1 + 0.15 * np.sin(2 * np.pi * rng.uniform(0.2, 0.6) * t + rng.uniform(0, 6)))
    phase = 2 * np.pi * np.cumsum(pitch) / sample_rate
    voice = sum(np.sin(h * phase) / h for h in range(1, 6))
    syllable = np.maximum(0.0, np.sin(2 * np.pi * rng.uniform(3.0, 5.0) * t + rng.uniform(0, 6))) ** 2
    pauses = np.repeat(rng.random(int(np.ceil(seconds / 0.5)) + 1) > 0.2, int(0.5 * sample_rate))[:n]
    wave = 0.3 * voice * syllable * pauses + 0.01 * rng.standard_normal(n)
    return np.clip(wave * 32767, -32768, 32767).astype(np.int16)


@dataclasses.dataclass
class LoadResult:
    """Rows of a load run: `frames` (one per reply) and `clients` (one per client)."""

    frames: list[dict]
    clients: list[dict]

    def summary(self) -> dict:
        lat = np.asarray([f["latency_ms"] for f in self.frames]) if self.frames else np.zeros(1)
        rtt = np.asarray([f["rtt_ms"] for f in self.frames]) if self.frames else np.zeros(1)
        return {"clients": len(self.clients), "admitted": sum(c["admitted"] for c in self.clients),
                "rejected": sum(c["rejected"] for c in self.clients),
                "errors": sum(c["error"] is not None for c in self.clients),
                "frames_sent": sum(c["sent"] for c in self.clients), "frames": len(self.frames),
                "empty": sum(f["empty"] for f in self.frames), "dropped": sum(f["dropped"] for f in self.frames),
                "latency_ms_p50": float(np.percentile(lat, 50)), "latency_ms_p99": float(np.percentile(lat, 99)),
                "rtt_ms_p50": float(np.percentile(rtt, 50)), "rtt_ms_p99": float(np.percentile(rtt, 99))}


async def run_client(url: str, *, client: int, frame_ms: float, duration_s: float, t0: float, phase_s: float = 0.0,
                     seed: int = 0, frames: list | None = None, hello: dict | None = None) -> dict:
    """One session: hello, then one frame every B for `duration_s`, logging every reply into `frames`.

    Args:
        url: the server's `ws://host:port/session`.
        client: client number (in the rows).
        frame_ms: frame budget B; frames hold `16 * frame_ms` samples.
        duration_s: streaming time after the hello.
        t0: the run's start (`loop.time()`); row times are relative to it.
        phase_s: delay of the first frame after the hello.
        seed: seed of the synthetic audio.
        frames: list the per-reply rows are appended to.
        hello: hello overrides (tests).

    Returns:
        The client's row: admitted / rejected / error code, frames sent and received, its times.
    """

    loop = asyncio.get_running_loop()
    budget = frame_ms / 1000.0
    count = max(0, int(duration_s / budget))
    samples = int(round(SAMPLE_RATE * budget))
    audio = speech_like_pcm(count * budget + budget, seed)
    frames = [] if frames is None else frames
    row = {"client": client, "start_s": loop.time() - t0, "admitted": False, "rejected": False, "error": None,
           "sent": 0, "received": 0, "end_s": None, "close_code": None}
    sent_at: dict[int, float] = {}
    try:
        async with connect(url, max_size=1 << 20, ping_interval=None, open_timeout=30) as ws:
            await ws.send(json.dumps({"type": "hello", "sample_rate": SAMPLE_RATE, "frame_ms": frame_ms,
                                      **(hello or {})}))
            first = json.loads(await ws.recv())
            if first["type"] != "ready":
                row["rejected"] = first.get("code") == "overloaded"
                row["error"] = None if row["rejected"] else first.get("code")
                return row
            row["admitted"] = True

            async def sender():
                start = loop.time() + phase_s
                try:
                    for k in range(count):
                        await asyncio.sleep(max(0.0, start + k * budget - loop.time()))
                        sent_at[k] = loop.time()
                        await ws.send(audio[k * samples:(k + 1) * samples].tobytes())
                        row["sent"] += 1
                    await asyncio.sleep(2 * budget + 0.5)  # let the last replies arrive
                    await ws.send(json.dumps({"type": "bye"}))
                except ConnectionClosed:  # the server closed the session (error, shutdown)
                    pass

            task = asyncio.create_task(sender())
            try:
                async for message in ws:
                    now = loop.time()
                    msg = json.loads(message)
                    if msg["type"] == "error":
                        row["error"] = msg.get("code")
                        continue
                    if msg["type"] == "late_tokens":  # the tokens of a frame answered late (empty) on time
                        row["late_tokens"] = row.get("late_tokens", 0) + len(msg["tokens"])
                        continue
                    if msg["type"] != "frame":
                        continue
                    row["received"] += 1
                    seq = msg["seq"]
                    frames.append({"client": client, "seq": seq, "t": sent_at.get(seq, now) - t0,
                                   "rtt_ms": 1e3 * (now - sent_at.get(seq, now)), "latency_ms": msg["latency_ms"],
                                   "queue_ms": msg["queue_ms"], "tokens": len(msg["tokens"]), "empty": msg["empty"],
                                   "dropped": msg["dropped"], "preempted": msg["preempted"],
                                   "skipped": msg["skipped"], "occupancy": msg.get("occupancy"),
                                   "late": bool(msg.get("late", False))})
            except ConnectionClosed:
                pass
            finally:
                task.cancel()
                row["close_code"] = ws.close_code
    except (OSError, ConnectionClosed, asyncio.TimeoutError) as e:
        row["error"] = row["error"] or f"connection: {type(e).__name__}"
    row["end_s"] = loop.time() - t0
    return row


def _check(clients: int, duration_s: float) -> None:
    if not 0 < clients <= MAX_CLIENTS:
        raise ValueError(f"client count must be in 1..{MAX_CLIENTS}, got {clients}")
    if not 0 < duration_s <= MAX_DURATION_S:
        raise ValueError(f"duration must be in (0, {MAX_DURATION_S:g}] s, got {duration_s}")


async def closed_loop(url: str, *, sessions: int, duration_s: float, frame_ms: float, seed: int = 0) -> LoadResult:
    """N phase-staggered sessions streaming together for `duration_s` (see the module docstring)."""
    _check(sessions, duration_s)
    loop = asyncio.get_running_loop()
    rng = np.random.default_rng(seed)
    phases = rng.uniform(0, frame_ms / 1000.0, sessions)
    t0, frames = loop.time(), []
    clients = await asyncio.gather(*(
        run_client(url, client=i, frame_ms=frame_ms, duration_s=duration_s, t0=t0, phase_s=float(phases[i]),
                   seed=seed * 1000 + i, frames=frames) for i in range(sessions)))
    return LoadResult(frames, list(clients))


async def open_loop(url: str, *, rate_per_s: float, max_clients: int, duration_s: float, frame_ms: float,
                    session_s: float | None = None, seed: int = 0) -> LoadResult:
    """Arrivals at `rate_per_s` up to `max_clients`; each streams to the end of the run (or for `session_s`)."""
    _check(max_clients, duration_s)
    if rate_per_s <= 0:
        raise ValueError(f"rate_per_s must be positive, got {rate_per_s}")
    loop = asyncio.get_running_loop()
    rng = np.random.default_rng(seed)
    t0, frames, tasks = loop.time(), [], []
    for i in range(max_clients):
        arrival = i / rate_per_s
        if arrival >= duration_s:
            break
        await asyncio.sleep(max(0.0, t0 + arrival - loop.time()))
        length = duration_s - arrival if session_s is None else min(session_s, duration_s - arrival)
        tasks.append(asyncio.create_task(run_client(
            url, client=i, frame_ms=frame_ms, duration_s=length, t0=t0,
            phase_s=float(rng.uniform(0, frame_ms / 1000.0)), seed=seed * 1000 + i, frames=frames)))
    clients = await asyncio.gather(*tasks)
    return LoadResult(frames, list(clients))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url")
    parser.add_argument("--sessions", type=int, default=4, help="closed loop: sessions")
    parser.add_argument("--rate", type=float, default=None, help="open loop: arrivals per second")
    parser.add_argument("--max-clients", type=int, default=64, help="open loop: most arrivals")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--frame-ms", type=float, default=1000.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.rate is None:
        run = closed_loop(args.url, sessions=args.sessions, duration_s=args.duration, frame_ms=args.frame_ms,
                          seed=args.seed)
    else:
        run = open_loop(args.url, rate_per_s=args.rate, max_clients=args.max_clients, duration_s=args.duration,
                        frame_ms=args.frame_ms, seed=args.seed)
    result = asyncio.run(run)
    print(json.dumps(result.summary(), indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dataclasses.asdict(result), f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
