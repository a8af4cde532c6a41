"""One replica against two: `omnijax serve --demo-model` and `omnijax serve --demo-model --replicas 2` (Ray Serve, a
local CPU cluster) under the same load, through the routes a client uses (issue 42 item 4).

Each configuration is a real server process (`omnijax.testing.served.Served`): 1 replica is the single-process
server, 2 replicas are two engines behind Ray Serve's proxy and `SessionAwareRouter`. Both take the same flags:
`--buckets 1 2 .. --max-sessions` (each engine admits at most that many sessions), AIMD off (`--aimd-target 0`: the
cap is the session limit, not this machine's load), `--frame-ms`. The load is the project's load generator
(`omnijax.serve.loadgen.closed_loop`): `--sessions` native `/session` clients connect at once and stream one frame
of speech-like PCM per frame budget for `--seconds`; a client beyond every engine's cap is refused (`overloaded`).
Beside it `--chats` chat completions go through the official openai SDK (admitted: 200; refused: 429 after the
queue).

Reported per configuration: sessions offered / admitted / refused, sessions per replica (each replica's `GET
/v1/omnijax/replica` in the middle of the run), frames answered, the server's per-frame latency (tick start ->
reply) and the client's round trip p50 / p95, chat completions admitted / refused, and the start-up time. The
projection: N replicas admit N x (sessions one replica admitted), one engine per GPU, as long as the router spreads
them (the 2-replica row says whether it does).

On this 2-core machine the two replicas share the cores the single server had to itself (each replica is given
one CPU by Ray), so latency compares poorly; admission is what the row measures. CPU, demo model.

Run: `python -m bench.metronome.replicas [--sessions 8] [--max-sessions 4] [--seconds 20] [--frame-ms 500]
[--chats 4] [--configs 1 2] [--out bench/out] [--smoke]` (`--smoke`: 3 sessions over an engine of 2 for 4 s, the
single server only unless `--configs` says otherwise: its time is a server's start-up, and the Ray cluster's start
(minutes on a loaded 2-core machine) is what `tests/serve/cluster/test_ray_replicas.py` already pays; `--smoke
--configs 1 2` runs both).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request

import numpy as np

from bench import harness
from omnijax.serve import loadgen
from omnijax.testing.served import Served

CONFIGS = (1, 2)


def _buckets(max_sessions: int) -> list[str]:
    sizes, b = [], 1
    while b < max_sessions:
        sizes.append(b)
        b *= 2
    return [str(s) for s in sizes + [max_sessions]]


def _describe(base: str, rid: str | None = None) -> dict:
    path = "/v1/omnijax/replica" + (f"?replica={rid}" if rid else "")
    with urllib.request.urlopen(base + path, timeout=60) as response:
        return json.loads(response.read())


def _chats(base_url: str, count: int) -> dict:
    """`count` chat completions at once through the openai SDK; how many were answered and refused (429)."""
    import openai  # the test extra's client; only this measurement needs it

    async def one(client, i: int) -> str:
        try:
            await client.chat.completions.create(model="omnijax", messages=[{"role": "user", "content": f"Hi {i}"}],
                                                 max_tokens=4)
            return "ok"
        except openai.RateLimitError:
            return "refused"

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(client, i) for i in range(count)))

    done = asyncio.run(run()) if count else []
    return {"chats": count, "chats_ok": done.count("ok"), "chats_refused": done.count("refused")}


def run_config(replicas: int, args) -> dict:
    flags = ["--frame-ms", f"{args.frame_ms:g}", "--aimd-target", "0", "--buckets", *_buckets(args.max_sessions)]
    if replicas > 1:
        flags += ["--replicas", str(replicas)]
    began = time.perf_counter()
    served = Served(*flags, start_timeout_s=900)
    start_s = time.perf_counter() - began
    try:
        ids: list[str] = []
        if replicas > 1:
            line = next(x for x in served.lines if "replicas on Ray Serve" in x)
            ids = line.split("; ", 1)[1].split(")")[0].split(", ")
        per_replica: dict[str, int] = {}

        def sample() -> None:  # each replica's open sessions in the middle of the run
            time.sleep(args.seconds / 2)
            for rid in ids:
                answer = _describe(served.base, rid)
                per_replica[answer["replica"]] = answer["sessions"]

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        url = served.ws_url + "/session"
        result = asyncio.run(loadgen.closed_loop(url, sessions=args.sessions, duration_s=args.seconds,
                                                 frame_ms=args.frame_ms))
        sampler.join()
        chats = _chats(served.base_url, args.chats)
    finally:
        served.stop(180)
    lat = np.asarray([f["latency_ms"] for f in result.frames] or [np.nan])
    rtt = np.asarray([f["rtt_ms"] for f in result.frames] or [np.nan])
    summary = result.summary()
    admitted = summary["admitted"]
    return {"replicas": replicas, "sessions": args.sessions, "admitted": admitted, "refused": summary["rejected"],
            "errors": summary["errors"], "per_replica": per_replica if replicas > 1 else {"single": admitted},
            "frames": summary["frames"], "frames_sent": summary["frames_sent"],
            "latency_p50_ms": float(np.percentile(lat, 50)), "latency_p95_ms": float(np.percentile(lat, 95)),
            "rtt_p50_ms": float(np.percentile(rtt, 50)), "rtt_p95_ms": float(np.percentile(rtt, 95)),
            **chats, "start_s": round(start_s, 1)}


def plot(rows: list[dict], out) -> None:
    plt = harness.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    x = np.arange(len(rows))
    names = [f"{r['replicas']} replica{'s' if r['replicas'] > 1 else ''}" for r in rows]
    left.bar(x - 0.2, [r["admitted"] for r in rows], 0.4, label="admitted")
    left.bar(x + 0.2, [r["refused"] for r in rows], 0.4, label="refused")
    left.set_xticks(x, names)
    left.set_ylabel(f"sessions (of {rows[0]['sessions']} offered)")
    left.legend()
    right.bar(x - 0.2, [r["latency_p50_ms"] for r in rows], 0.4, label="p50")
    right.bar(x + 0.2, [r["latency_p95_ms"] for r in rows], 0.4, label="p95")
    right.set_xticks(x, names)
    right.set_ylabel("per-frame latency (ms, server)")
    right.legend()
    fig.suptitle("omnijax serve: 1 vs 2 replicas (CPU, demo model)")
    harness.save_png(fig, out, "replicas")


COLUMNS = [("replicas", "replicas", "d"), ("offered", "sessions", "d"), ("admitted", "admitted", "d"),
           ("refused", "refused", "d"), ("per replica", lambda r: "/".join(str(v) for v in r["per_replica"].values()),
                                         ""),
           ("frames", "frames", "d"), ("lat p50", "latency_p50_ms", ".0f"), ("lat p95", "latency_p95_ms", ".0f"),
           ("rtt p50", "rtt_p50_ms", ".0f"), ("rtt p95", "rtt_p95_ms", ".0f"), ("chats ok", "chats_ok", "d"),
           ("chats 429", "chats_refused", "d"), ("start s", "start_s", ".0f")]


def main(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument("--sessions", type=int, default=8, help="native sessions offered at once")
    parser.add_argument("--max-sessions", type=int, default=4, help="sessions one engine admits (largest bucket)")
    parser.add_argument("--seconds", type=float, default=20.0, help="streaming time")
    parser.add_argument("--frame-ms", type=float, default=500.0, help="frame budget B")
    parser.add_argument("--chats", type=int, default=4, help="chat completions sent at once after the stream")
    parser.add_argument("--configs", type=int, nargs="+", default=list(CONFIGS), choices=CONFIGS,
                        help="replica counts to run")
    args = harness.parse(parser, argv, smoke=dict(sessions=3, max_sessions=2, seconds=4.0, chats=2,
                                                                 configs=[1]))
    for name in ("sessions", "max_sessions"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    out = harness.output_dir(args)
    rows = [run_config(n, args) for n in args.configs]
    harness.print_table(rows, COLUMNS)
    one = rows[0]["admitted"] // rows[0]["replicas"]
    projection = {f"{n} GPUs": n * one for n in (1, 2, 8, 64)}
    print(f"projection (one engine per GPU, {one} sessions each at these settings): {projection}")
    harness.write_json(out, "replicas", {"config": vars(args), "rows": rows, "projection": projection}, indent=2)
    plot(rows, out)


if __name__ == "__main__":
    main()
