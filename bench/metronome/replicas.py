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

`--loss EVERY [EVERY ...]` measures issue 42 item 2's other half instead: what a replica that dies without a drain
loses at each `--snapshot-every` value. For each value, `--loss-kills` times: a fresh single-process server (a
replica's process runs the same application and snapshot code) with `--snapshot-dir` and `--snapshot-every EVERY`;
`--loss-sessions` Realtime sessions (the official openai SDK) talk at once, a turn of `--loss-tokens` tokens at most
every `--pace-s` seconds; the server is SIGKILLed at a random moment, uniform in [`--loss-min-s`, `--loss-max-s`]
after they began (not aligned with the snapshot schedule); then each session's turns seen are compared with its
newest snapshot on disk. Reported per value: turns lost (total, the most one session lost) and the conversation
time lost (from the end of the first lost turn to the kill; mean, max), beside the longest turn. `--loss-client
native` does the same with native `/session` clients: each sends a frame of speech-like PCM, waits for its tokens,
and sends the next one frame budget after the previous one (a real-time client that never has a frame superseded);
a turn is a served frame (`--snapshot-every 5turns`: every 5th frame), and a frame is lost when the client saw it
served but the newest snapshot on disk does not hold it (its `seq` >= the snapshot's next frame).

Run: `python -m bench.metronome.replicas [--sessions 8] [--max-sessions 4] [--seconds 20] [--frame-ms 500]
[--chats 4] [--configs 1 2] [--out bench/out] [--smoke]` (`--smoke`: 3 sessions over an engine of 2 for 4 s, the
single server only unless `--configs` says otherwise: its time is a server's start-up, and the Ray cluster's start
(minutes on a loaded 2-core machine) is what `tests/serve/cluster/test_ray_replicas.py` already pays; `--smoke
--configs 1 2` runs both); `python -m bench.metronome.replicas --loss 1turn 3turns 1s 2s 5s [--loss-client native]`.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import urllib.request
from pathlib import Path

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


# ------------------------------------------------------------------------------------------------ --loss
TURN_TEXTS = tuple(f"Turn {i}." for i in range(400))  # JSON strings on disk: '"Turn 1."' is not in '"Turn 11."'


def kept_turns(snapshots: Path, token: str) -> int:
    """How many of a session's turns its newest snapshot on disk holds (its user messages; 0 without a snapshot)."""
    folder = snapshots / token
    generations = sorted(p for p in folder.iterdir() if re.fullmatch(r"[0-9]{12}", p.name)) if folder.is_dir() else []
    if not generations:
        return 0
    text = (generations[-1] / "session.json").read_text()
    kept = [json.dumps(t) in text for t in TURN_TEXTS]
    k = sum(kept)
    if kept != [True] * k + [False] * (len(TURN_TEXTS) - k):
        raise AssertionError(f"the snapshot of {token} holds turns that are not a prefix of the conversation")
    return k


async def _talk(client, pace_s: float, until: float, tokens: int) -> dict:
    """One Realtime session (official openai SDK): a turn of `tokens` tokens, then another at most every `pace_s`
    seconds, until the server dies or `until` (monotonic) passes; its token and each turn's end time."""
    seen: dict = {"done": []}
    try:
        async with client.realtime.connect(model="omnijax") as conn:
            created = await conn.recv()
            seen["token"] = created.session.model_extra["omnijax"]["resume_token"]
            while time.monotonic() < until:
                await asyncio.sleep(max(0.0, (seen["done"] or [0.0])[-1] + pace_s - time.monotonic()))
                await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": TURN_TEXTS[len(seen["done"])]}]})
                await conn.response.create(response={"max_output_tokens": tokens})
                async for event in conn:
                    if event.type == "error":
                        raise RuntimeError(f"the server answered an error: {event}")
                    if event.type == "response.done":
                        seen["done"].append(time.monotonic())
                        break
                else:
                    break  # the connection ended: the kill
    except Exception as e:  # noqa: BLE001 - the connection dies with the server
        seen["ended"] = repr(e)
    return seen


def kept_frames(snapshots: Path, token: str) -> int:
    """How many frames of a native session its newest snapshot on disk holds (its meta's next frame; 0 without
    one)."""
    folder = snapshots / token
    generations = sorted(p for p in folder.iterdir() if re.fullmatch(r"[0-9]{12}", p.name)) if folder.is_dir() else []
    if not generations:
        return 0
    return int(json.loads((generations[-1] / "session.json").read_text())["meta"]["native"]["seq"])


async def _stream(url: str, frame_s: float, until: float) -> dict:
    """One native `/session` client: a frame, its tokens, the next frame one budget after the previous one was sent,
    until the server dies or `until` passes; its token and each frame's reply time (frame k's at index k)."""
    import websockets  # the serve extra's client; only this measurement needs it

    seen: dict = {"done": []}
    try:
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"type": "hello", "sample_rate": 16000}))
            ready = json.loads(await ws.recv())
            if ready.get("type") != "ready":
                raise RuntimeError(f"the server refused the session: {ready}")
            seen["token"], n = ready["resume_token"], ready["frame_samples"]
            pcm = loadgen.speech_like_pcm(n * 400 / 16000)  # 400 frames of speech-like audio, looped
            sent = time.monotonic()
            while time.monotonic() < until:
                k = len(seen["done"])
                await asyncio.sleep(max(0.0, sent + frame_s - time.monotonic()) if k else 0.0)
                sent = time.monotonic()
                await ws.send(pcm[(k % 400) * n:(k % 400 + 1) * n].astype("<i2").tobytes())
                while True:
                    reply = json.loads(await ws.recv())
                    if reply["type"] == "error":
                        raise RuntimeError(f"the server answered an error: {reply}")
                    if reply["type"] == "late_tokens" or (reply["type"] == "frame" and not reply["late"]):
                        if reply["seq"] != k:
                            raise RuntimeError(f"frame {k} was answered as frame {reply['seq']}")
                        seen["done"].append(time.monotonic())
                        break
    except Exception as e:  # noqa: BLE001 - the connection dies with the server
        seen["ended"] = repr(e)
    return seen


def loss_round(served: Served, snapshots: Path, every: str, args, rng: np.random.Generator) -> list[dict]:
    """`--sessions` Realtime sessions talk on a fresh server; it is SIGKILLed at a random moment (uniform in
    [`--loss-min-s`, `--loss-max-s`] after the first session began, so unaligned with the snapshot schedule); each
    session's turns seen vs held by its newest snapshot on disk."""
    import openai  # the test extra's client; only this measurement needs it

    served.start(900)
    kill_after = float(rng.uniform(args.loss_min_s, args.loss_max_s))
    native = args.loss_client == "native"

    async def run() -> tuple[list[dict], float]:
        client = openai.AsyncOpenAI(base_url=served.base_url, api_key="unused", max_retries=0)
        began = time.monotonic()
        until = began + kill_after + 120.0
        if native:
            talks = [asyncio.ensure_future(_stream(f"{served.ws_url}/session", args.frame_ms / 1000, until))
                     for _ in range(args.loss_sessions)]
        else:
            talks = [asyncio.ensure_future(_talk(client, args.pace_s, until, args.loss_tokens))
                     for _ in range(args.loss_sessions)]
        await asyncio.sleep(kill_after)
        killed_at = time.monotonic()
        served.kill()
        return list(await asyncio.gather(*talks)), killed_at

    seens, killed_at = asyncio.run(run())
    rows = []
    for seen in seens:
        done = seen["done"]
        if "token" not in seen or not done:
            rows.append({"every": every, "client": args.loss_client, "turns": 0, "on_disk": 0, "lost": 0,
                         "lost_s": 0.0, "behind_s": None, "kill_after_s": kill_after, "ended": seen.get("ended")})
            continue
        # the disk may hold one turn more than the client saw end: with `1turn` a turn's snapshot is written before
        # its response.done, which the kill can cut off (a native frame's after its reply: never more)
        on_disk = (kept_frames if native else kept_turns)(snapshots, seen["token"])
        n = len(done)
        k = min(on_disk, n)
        gaps = np.diff(done)
        rows.append({"every": every, "client": args.loss_client, "turns": n, "on_disk": on_disk, "lost": n - k,
                     # since the first turn the kill lost ended: the conversation time it took with it
                     "lost_s": killed_at - done[k] if k < n else 0.0,
                     "behind_s": killed_at - done[k - 1] if k else None,  # the newest turn seen on disk ended
                     "turn_s": float(gaps.max()) if len(gaps) else None, "kill_after_s": kill_after})
    return rows


def run_loss(args, out: Path) -> None:
    """`--loss`: the turns a SIGKILL loses at each `--snapshot-every` value (module docstring)."""
    import tempfile

    rng = np.random.default_rng(args.seed)
    rows: list[dict] = []
    for every in args.loss:
        with tempfile.TemporaryDirectory(prefix="omnijax-loss-") as tmp:
            snapshots = Path(tmp) / "sessions"
            served = Served("--frame-ms", f"{args.frame_ms:g}", "--aimd-target", "0", "--buckets",
                            *_buckets(max(2, args.loss_sessions)), "--snapshot-dir", str(snapshots),
                            "--snapshot-every", every, start_timeout_s=None)
            try:
                for _ in range(args.loss_kills):
                    rows += loss_round(served, snapshots, every, args, rng)
            finally:
                served.kill()
        mine = [r for r in rows if r["every"] == every]
        print(f"--snapshot-every {every}: lost " + ", ".join(f"{r['lost']}/{r['turns']}" for r in mine)
              + " turns; seconds lost " + ", ".join(f"{r['lost_s']:.2f}" for r in mine), flush=True)
    summary = []
    for every in args.loss:
        mine = [r for r in rows if r["every"] == every and r["turns"]]
        lost_s = [r["lost_s"] for r in mine]
        summary.append({"every": every, "sessions": len(mine), "turns": sum(r["turns"] for r in mine),
                        "lost": sum(r["lost"] for r in mine), "most_lost": max((r["lost"] for r in mine), default=0),
                        "lost_s_mean": float(np.mean(lost_s)) if lost_s else None,
                        "lost_s_max": float(np.max(lost_s)) if lost_s else None,
                        "turn_s_max": max((r["turn_s"] or 0.0 for r in mine), default=None)})
    harness.print_table(summary, LOSS_COLUMNS)
    name = "replicas_loss_native" if args.loss_client == "native" else "replicas_loss"
    harness.write_json(out, name, {"config": vars(args), "rows": rows, "summary": summary}, indent=2)


LOSS_COLUMNS = [("every", "every", ""), ("sessions", "sessions", "d"), ("turns", "turns", "d"),
                ("lost", "lost", "d"), ("most lost", "most_lost", "d"), ("lost s mean", "lost_s_mean", ".2f"),
                ("lost s max", "lost_s_max", ".2f"), ("turn s max", "turn_s_max", ".2f")]


def main(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument("--sessions", type=int, default=8, help="native sessions offered at once")
    parser.add_argument("--max-sessions", type=int, default=4, help="sessions one engine admits (largest bucket)")
    parser.add_argument("--seconds", type=float, default=20.0, help="streaming time")
    parser.add_argument("--frame-ms", type=float, default=500.0, help="frame budget B")
    parser.add_argument("--chats", type=int, default=4, help="chat completions sent at once after the stream")
    parser.add_argument("--configs", type=int, nargs="+", default=list(CONFIGS), choices=CONFIGS,
                        help="replica counts to run")
    parser.add_argument("--loss", nargs="+", default=None, metavar="EVERY",
                        help="instead: the turns a SIGKILL loses at these --snapshot-every values (1turn, 3turns, "
                             "2s, ...)")
    parser.add_argument("--loss-kills", type=int, default=2, help="--loss: kills (server starts) per value")
    parser.add_argument("--loss-sessions", type=int, default=3, help="--loss: sessions talking at a kill")
    parser.add_argument("--loss-client", choices=("realtime", "native"), default="realtime",
                        help="--loss: Realtime sessions (turns) or native /session sessions (a turn is a frame)")
    parser.add_argument("--loss-min-s", type=float, default=6.0, help="--loss: the earliest kill after the start")
    parser.add_argument("--loss-max-s", type=float, default=16.0, help="--loss: the latest kill after the start")
    parser.add_argument("--loss-tokens", type=int, default=8, help="--loss: tokens a turn's answer has")
    parser.add_argument("--pace-s", type=float, default=0.25, help="--loss: a session's turns start at most this "
                        "often")
    parser.add_argument("--seed", type=int, default=0, help="--loss: of the kill times")
    args = harness.parse(parser, argv, smoke=dict(sessions=3, max_sessions=2, seconds=4.0, chats=2,
                                                                 configs=[1]))
    for name in ("sessions", "max_sessions", "loss_kills", "loss_sessions", "loss_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.loss_min_s <= args.loss_max_s:
        parser.error(f"--loss-min-s must be > 0 and <= --loss-max-s, got {args.loss_min_s}, {args.loss_max_s}")
    out = harness.output_dir(args)
    if args.loss is not None:
        return run_loss(args, out)
    rows = [run_config(n, args) for n in args.configs]
    harness.print_table(rows, COLUMNS)
    one = rows[0]["admitted"] // rows[0]["replicas"]
    projection = {f"{n} GPUs": n * one for n in (1, 2, 8, 64)}
    print(f"projection (one engine per GPU, {one} sessions each at these settings): {projection}")
    harness.write_json(out, "replicas", {"config": vars(args), "rows": rows, "projection": projection}, indent=2)
    plot(rows, out)


if __name__ == "__main__":
    main()
