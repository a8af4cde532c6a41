"""A native `/session` client for the resume tests (`test_native_resume`, and through Ray Serve's proxy
`test_ray_replicas`): hello, frames sent one at a time (each after the previous one's tokens came, so no frame is
superseded and two runs fed the same frames see the same frames), and a refused connection's message and close code.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import websockets


def frame(k: int, n: int) -> bytes:
    """Frame `k` of `n` samples: a 16 kHz int16 tone whose pitch depends on `k`."""
    t = np.arange(n) / 16000
    return (3000 * np.sin(2 * np.pi * (220 + 40 * k) * t)).astype("<i2").tobytes()


async def frames(ws, ready: dict, ks) -> list[tuple[int, list[int]]]:
    """Sends frames `ks` one at a time, each after the previous one's tokens came; returns (seq, tokens) each."""
    out = []
    for k in ks:
        await ws.send(frame(k, ready["frame_samples"]))
        while True:
            reply = json.loads(await ws.recv())
            assert reply["type"] in ("frame", "late_tokens"), reply
            if reply["type"] == "late_tokens" or not reply["late"]:
                out.append((reply["seq"], reply["tokens"]))
                break
    return out


async def hello(url: str) -> tuple:
    """Connects to `url` and says hello; returns the connection and the server's first message (`ready`, or the
    refusal)."""
    ws = await websockets.connect(url)
    await ws.send(json.dumps({"type": "hello", "sample_rate": 16000}))
    return ws, json.loads(await ws.recv())


async def refused(url: str) -> tuple[dict, int | None]:
    """The first message and the close code of a connection to `url` that the server refuses."""
    ws, first = await hello(url)
    try:
        await ws.recv()
    except websockets.ConnectionClosed as e:
        return first, e.rcvd.code if e.rcvd else None
    raise AssertionError(f"{url} was not closed after {first}")


async def closed_code(ws, timeout_s: float) -> int | None:
    """Reads `ws` until the server closes it (within `timeout_s`); the close code it sent (None without one)."""
    async def drain() -> int | None:
        while True:
            try:
                await ws.recv()
            except websockets.ConnectionClosed as e:
                return e.rcvd.code if e.rcvd else None
    return await asyncio.wait_for(drain(), timeout_s)
