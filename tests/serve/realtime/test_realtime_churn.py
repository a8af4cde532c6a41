"""Session churn over the Realtime route of `omnijax serve` (the demo model, in-process): a seeded random schedule of
connects, disconnects, user items with `response.create`, `response.cancel`, and resumes with the resume token
(snapshots written when a connection ends and every 0.2 s while idle), several connections open at once so that
ticks batch them and rows move; every response is checked against the same session's conversation run alone in its
own batch-1 `omnijax.Session` (`tests._support.realtime_churn.AloneRun`): status, text, token count and the KV cells
the server reports. A cancelled response is replayed as the server defines it (what was decoded stays in the cache),
and every later answer of its session must still match. Plus the exact sequence of issue 35 (A and B hold items, C
connects, A leaves, C asks: C was served from a row past the batch and failed).

The suite runs 50 steps (about 15 answered turns per server, ~30 s each on the test machine; seed 5 is one whose
first 50 steps hold every kind of event several times: 9-12 sessions, 4-5 pauses, 5 resumes, 5 swaps, 4-6
cancels, a leave). `OMNIJAX_SOAK=N` runs N times the schedule's steps (new draws from the same seeded stream after
the first 50, so the counts below only grow), e.g. `OMNIJAX_SOAK=40` for 2,000 steps.
"""

import asyncio
import collections
import subprocess
import sys
import textwrap

import numpy as np
import pytest

openai = pytest.importorskip("openai")

import omnijax  # noqa: E402
from omnijax.decoding import RowSampling  # noqa: E402
from omnijax.retention import SinkWindow  # noqa: E402
from omnijax.serve.app import BackgroundServer, build_context  # noqa: E402
from omnijax.serve.context import ServeOptions  # noqa: E402
from tests._support.demo_server import demo_model  # noqa: E402
from tests._support.realtime_churn import AloneRun, Conn, Flow, Turn, sentence  # noqa: E402
from tests._support.soak import factor as soak_factor  # noqa: E402

TAU, T, CAP = 8, 32, 4  # tau, the engine's chunk tokens, its largest bucket (connections open at once)
STEPS, SEED, MAX_TURNS = 50, 5, 8
ORACLE = omnijax.StreamConfig(policy=SinkWindow(sink=16, window=2048), num_pages=512, page_size=16,
                              max_answer_tokens=TAU)
ACTIONS = {"open": 0.1, "say": 0.36, "cancel": 0.08, "pause": 0.1, "resume": 0.12, "leave": 0.04, "swap": 0.1,
           "wait": 0.1}


@pytest.fixture(scope="module")
def model():
    return demo_model()


def _context(model, snapshot_dir=None):
    """The server: RowSampling (greedy by default) as `omnijax serve` decodes (the oracle: Greedy); with
    `snapshot_dir`, snapshots when a connection ends and every 0.2 s, different sessions' writes at the same moment
    (see `test_snapshots_written_at_once_all_land`)."""
    options = ServeOptions(port=0, frame_ms=200, max_output_tokens=32,
                           snapshot_dir=None if snapshot_dir is None else str(snapshot_dir),
                           snapshot_every_s=0.2 if snapshot_dir is not None else 0.0)
    return build_context(model, options=options, stream=ORACLE.replace(decoding=RowSampling()), chunk_tokens=T,
                         buckets=(2, CAP), aimd_target=0)


def _client(server):
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


class TickLog:
    """Wraps the engine's `tick`: how many sessions each tick served, and how many times an open session changed
    rows: in a tick's re-arrangement (a bucket change, or a newcomer placed past the batch moving into a free row,
    whether or not that tick serves it) or between ticks (the rows packed when a snapshot is exported)."""

    def __init__(self, engine):
        self.engine, self.real = engine, engine.tick
        self.sizes: collections.Counter = collections.Counter()
        self.rows: dict[str, int] = {}  # every open session's row after the last tick
        self.moves = 0
        engine.tick = self

    def __call__(self):
        before = {sid: self.engine.slot(sid) for sid in self.engine.sessions}
        self.moves += sum(self.rows[sid] != row for sid, row in before.items() if sid in self.rows)
        report = self.real()
        self.sizes[len(report.outputs)] += 1
        self.rows = {sid: self.engine.slot(sid) for sid in self.engine.sessions}
        self.moves += sum(before[sid] != row for sid, row in self.rows.items() if sid in before)
        return report


async def _room(server) -> None:
    """Waits until the engine has a free slot (a closed connection's session is freed after its last snapshot)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while len(server.context.worker.lanes) >= CAP:
        assert loop.time() < deadline, "a closed connection's session was never freed"
        await asyncio.sleep(0.01)


async def _open_sessions(server, n: int) -> None:
    """Waits until the server holds exactly `n` sessions (a disconnect has been taken up)."""
    loop, worker = asyncio.get_running_loop(), server.context.worker
    deadline = loop.time() + 30
    while len(worker.lanes) != n or len(worker.engine.sessions) != n:
        assert loop.time() < deadline, (n, list(worker.lanes), worker.engine.sessions)
        await asyncio.sleep(0.01)


async def _churn(server, steps: int, seed: int):
    """Runs the schedule; returns (flows, every connection opened, counts). Without a snapshot directory a pause is
    a disconnect for good (and there is nothing to resume)."""
    resumable = server.context.options.snapshot_dir is not None
    rng = np.random.default_rng(seed)
    client = _client(server)
    flows: list[Flow] = []
    conns: list[Conn] = []
    live: dict[str, tuple[Flow, Conn]] = {}
    paused: dict[str, Flow] = {}
    inflight: dict[str, tuple[Turn, asyncio.Future]] = {}
    counts: collections.Counter = collections.Counter()

    async def settle(name):
        turn, future = inflight.pop(name)
        turn.result = await asyncio.wait_for(future, 60)
        counts[turn.result.status] += 1

    async def cancel(name, delay):
        await asyncio.sleep(delay)
        turn = inflight[name][0]
        if not turn.cancel_sent:
            turn.cancel_sent = True
            await live[name][1].cancel()

    async def say(name):
        flow, conn = live[name]
        turn = Turn(sentence(rng), int(rng.integers(1, 33)), flow.instructions, flow.connections)
        flow.turns.append(turn)
        inflight[name] = (turn, await conn.say(turn.text, turn.max_tokens))
        if rng.random() < 0.2:  # cancelled at once: usually before its prompt is served
            await cancel(name, 0.0)

    async def open_new() -> str:
        flow = Flow(f"f{len(flows)}", instructions=str(rng.choice(["", "Be brief.", "Answer in rhyme."])))
        flows.append(flow)
        conn = await connect(flow)
        flow.token = conn.token
        if flow.instructions:
            await conn.instruct(flow.instructions)
        return flow.name

    async def connect(flow, resume=None):
        await _room(server)
        conn = await Conn.open(client, resume)
        conns.append(conn)
        flow.connections += 1
        live[flow.name] = (flow, conn)
        return conn

    for step in range(steps):
        action = str(rng.choice(list(ACTIONS), p=list(ACTIONS.values())))
        idle = sorted(n for n in live if n not in inflight)
        if action == "open" and len(live) < CAP:
            await open_new()
        elif action == "say" and (talkers := [n for n in idle if len(live[n][0].turns) < MAX_TURNS]):
            await say(str(rng.choice(talkers)))
        elif action == "cancel" and inflight:
            await cancel(str(rng.choice(sorted(inflight))), float(rng.choice([0.0, 0.01, 0.03, 0.06, 0.1])))
        elif action == "swap" and 1 <= len(live) <= 2:
            # the sequence, with no tick in between: two open, a third connects, one of the two leaves, the
            # newcomer asks (the old engine served it from row 2 of a batch of two: its response failed)
            for name in sorted(inflight):
                await settle(name)
            await _open_sessions(server, len(live))
            if len(live) == 1:
                await open_new()
            name = str(rng.choice(sorted(live)))
            newcomer = await open_new()
            flow, conn = live.pop(name)
            await conn.close()
            if resumable:
                paused[name] = flow
            await _open_sessions(server, len(live))
            await say(newcomer)
        elif action == "pause" and idle:  # disconnect; resumed later with the token
            name = str(rng.choice(idle))
            flow, conn = live.pop(name)
            await conn.close()
            if resumable:
                paused[name] = flow
        elif action == "resume" and paused and len(live) < CAP:
            flow = paused.pop(str(rng.choice(sorted(paused))))
            conn = await connect(flow, resume=flow.token)
            assert conn.created.session.instructions == flow.instructions, (flow.name, conn.created)
        elif action == "leave" and live:  # gone for good, possibly mid-response (that response is not checked)
            name = str(rng.choice(sorted(live)))
            flow, conn = live.pop(name)
            if name in inflight:
                turn, _ = inflight.pop(name)
                assert flow.turns.pop() is turn
                counts["left mid-response"] += 1
            await conn.close()
        elif inflight and rng.random() < 0.7:
            action = "wait"
            await settle(str(rng.choice(sorted(inflight))))
        else:
            action = "wait"
            await asyncio.sleep(0.02)
        counts[action] += 1
    for name in sorted(inflight):
        await settle(name)
    for name in sorted(live):
        await live[name][1].close()
    return flows, conns, counts


def _check(model, flows) -> collections.Counter:
    """Every flow's turns replayed alone; returns how its cancels took effect."""
    cancels: collections.Counter = collections.Counter()
    for flow in flows:
        alone = AloneRun(model, ORACLE, T)
        for i, turn in enumerate(flow.turns):
            alone.check(turn, f"{flow.name} turn {i} ({flow.connections} connection(s))")
        cancels.update(alone.cancels)
    return cancels


@pytest.mark.parametrize("snapshots", [True, False], ids=["resumable", "no-snapshot-dir"])
def test_a_random_realtime_churn_answers_every_session_as_if_alone(model, tmp_path, snapshots):
    """With snapshots, every disconnect exports its session first (which re-arranges the engine's rows); without,
    a disconnect closes the engine session at once: the case where the old engine left a session past the batch."""
    with BackgroundServer(_context(model, tmp_path / "snapshots" if snapshots else None)) as server:
        ticks = TickLog(server.context.worker.engine)
        flows, conns, counts = asyncio.run(_churn(server, STEPS * soak_factor(), seed=SEED))
        server.wait_idle(30)
        assert server.context.worker.stats["tick_errors"] == 0
    assert [e for c in conns for e in c.errors] == []
    cancels = _check(model, flows)
    turns = [t for f in flows for t in f.turns]
    resumed = sum(t.connection > 1 for t in turns)
    # the schedule did churn: sessions came, left and were resumed while others were decoding in the same ticks
    assert len(flows) >= 8 and counts["pause"] >= 4 and counts["resume"] >= (4 if snapshots else 0), counts
    assert counts["swap"] >= 4 and ticks.moves >= 3, (counts, ticks.moves)
    assert len(turns) >= 15 and resumed >= (3 if snapshots else 0), (len(turns), resumed, counts)
    assert counts["cancelled"] >= 2 and sum(cancels.values()) == counts["cancelled"], (counts, cancels)
    assert sum(n for size, n in ticks.sizes.items() if size >= 2) >= 10, ticks.sizes


def test_a_session_connected_after_another_left_is_served_in_the_batch(model):
    """Issue 35's sequence: A and B each create an item; C connects; A disconnects; C (and B, in the same ticks)
    create an item and a response. The old engine left C in row 2 of a batch of 2: C's response failed
    ("index 2 is out of bounds"), and so did B's when it shared the tick. No snapshot directory, as in the issue
    (a snapshot's export on disconnect re-arranges the rows first)."""
    with BackgroundServer(_context(model)) as server:
        ticks = TickLog(server.context.worker.engine)

        async def run():
            client = _client(server)
            a, b = await Conn.open(client), await Conn.open(client)
            await a.item("Hello from A.")
            await b.item("Hello from B.")
            c = await Conn.open(client)
            await a.close()
            await _room(server)  # nothing to wait for: two of four slots are held
            c_turn, b_turn = Turn("C asks now.", 12, ""), Turn("B asks too.", 12, "")
            c_answer, b_answer = await c.say(c_turn.text, 12), await b.say(b_turn.text, 12)
            c_turn.result, b_turn.result = await asyncio.wait_for(c_answer, 60), await asyncio.wait_for(b_answer, 60)
            for conn in (b, c):
                await conn.close()
            assert a.errors == b.errors == c.errors == []
            return c_turn, b_turn

        c_turn, b_turn = asyncio.run(run())
        assert server.context.worker.stats["tick_errors"] == 0
    assert c_turn.result.status != "failed" and b_turn.result.status != "failed"
    AloneRun(model, ORACLE, T).check(c_turn, "C")
    b_alone = AloneRun(model, ORACLE, T)
    b_alone.item("Hello from B.")
    b_alone.check(b_turn, "B")
    assert ticks.sizes[2] >= 2 and ticks.moves >= 1  # B and C shared ticks; C moved into the batch


CONCURRENT_WRITES = textwrap.dedent("""
    import asyncio, os, secrets, sys, threading, time
    import numpy as np
    import omnijax
    from omnijax import compilation_cache
    from omnijax.chunks.chunk import text_chunk
    from omnijax.models.config import TINY_OMNI
    from omnijax.retention.baselines import SinkWindow
    from omnijax.serve.engine.engine import Engine, EngineConfig
    from omnijax.serve.realtime.snapshot_store import SnapshotStore

    compilation_cache.enable()  # the suite's ($OMNIJAX_COMPILATION_CACHE): the tick is loaded, not compiled
    stream = omnijax.StreamConfig(policy=SinkWindow(4, 16), num_pages=48, page_size=8, max_answer_tokens=2,
                                  impl="xla")
    engine = Engine(omnijax.Decoder(TINY_OMNI), EngineConfig(stream=stream, chunk_tokens=8, buckets=(1,)))
    engine.open("s")
    engine.submit("s", text_chunk(np.arange(5), unit=0), 1)
    engine.tick()
    snapshot = engine.export_session("s")
    store = SnapshotStore(os.path.join(os.getcwd(), "snapshots"))  # the test's tmp_path
    leases = [asyncio.run(store.acquire(secrets.token_hex(16))) for _ in range(4)]
    errors, written = [], []
    start = threading.Barrier(len(leases))

    def connection(lease):  # what each connection's Snapshotter does: store.save in a worker thread
        start.wait()
        for _ in range(4):
            try:
                store.save(lease, snapshot)
                written.append(lease.token)
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}"[:160])

    for lease in leases:
        threading.Thread(target=connection, args=(lease,), daemon=True).start()
    deadline = time.monotonic() + 40
    while len(written) + len(errors) < 16 and time.monotonic() < deadline:
        time.sleep(0.05)
    print(f"written {len(written)} of 16; errors {errors}", flush=True)
    os._exit(0 if len(written) == 16 else 1)  # a hung write would hold the interpreter for 300 s
""")


def test_snapshots_written_at_once_all_land(tmp_path):
    """Four connections' snapshot writes at the same moment, as periodic snapshots of a busy server are: each
    lands (old code: 3 runs of 3 lost 2 to 6 of the 16 writes to errors or hangs)."""
    run = subprocess.run([sys.executable, "-c", CONCURRENT_WRITES], capture_output=True, text=True, timeout=240,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
