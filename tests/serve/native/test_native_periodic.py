"""Periodic snapshots of native `/session` sessions (`--snapshot-every`, `omnijax.serve.native.snapshots`): a server
killed without a drain loses at most the frames served since the last periodic snapshot, and a resume by token
continues from that snapshot bit-exactly.

The kill is simulated in one process: a SIGKILL freezes the snapshot directory as it is at that moment (no drain, no
end-of-connection snapshot), so the test copies the directory while the session is still open (no write in flight)
and resumes the token from the copy on another server; the first server's connection goes on as if nothing happened.
Every frame's tokens are compared with an uninterrupted session's on a server without snapshots (an independent run
fed the same frames, one at a time: no frame is superseded).
"""

import asyncio
import json
import shutil
import threading
import time
from pathlib import Path

import pytest

websockets = pytest.importorskip("websockets")

import omnijax  # noqa: E402
from omnijax.retention import SinkWindow  # noqa: E402
from omnijax.serve.app import BackgroundServer, build_context  # noqa: E402
from omnijax.serve.context import ServeOptions  # noqa: E402
from omnijax.serve.engine.snapshot import load_snapshot  # noqa: E402
from omnijax.serve.engine.snapshot_format import SnapshotFormatError  # noqa: E402
from omnijax.serve.realtime.resume import store_for  # noqa: E402
from tests._support import tiny_omni  # noqa: E402
from tests.serve.cluster.native_client import frame as _frame  # noqa: E402
from tests.serve.cluster.native_client import frames as _frames  # noqa: E402
from tests.serve.cluster.native_client import hello as _hello  # noqa: E402

FRAMES = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return omnijax.load(tiny_omni.checkpoint(tmp_path_factory.mktemp("native"), tokenizer=True))


@pytest.fixture(scope="module")
def expected(model):
    """The uninterrupted session's (seq, tokens) for frames 0..FRAMES-1, on a server that takes no snapshots."""
    with BackgroundServer(_context(model)) as server:
        async def run():
            ws, ready = await _hello(server.native_url)
            async with ws:
                assert ready["type"] == "ready" and "resume_token" not in ready, ready
                return await _frames(ws, ready, range(FRAMES))
        out = asyncio.run(run())
    assert [seq for seq, _ in out] == list(range(FRAMES))
    assert sum(len(tokens) for _, tokens in out) >= FRAMES, out  # the model answered the frames
    return out


def _context(model, snapshot_dir=None, **options):
    stream = omnijax.StreamConfig(policy=SinkWindow(sink=16, window=2048), num_pages=96, page_size=16,
                                  max_answer_tokens=4)
    options = ServeOptions(port=0, frame_ms=200, snapshot_dir=None if snapshot_dir is None else str(snapshot_dir),
                           **options)
    return build_context(model, options=options, stream=stream, chunk_tokens=32, buckets=(1, 2), aimd_target=0)


def _generations(snapshots: Path, token: str) -> list[Path]:
    return sorted(p for p in (snapshots / token).glob("[0-9]" * 12) if p.is_dir())


def _on_disk(snapshots: Path, token: str) -> int | None:
    """The `seq` (next frame) of the token's newest complete generation on disk, None without one. The store removes
    the older generations once a new one is durable, so a generation read while a newer one lands can vanish under
    the reader: it is read again from the newer one (any other unreadable generation fails the test)."""
    while True:
        generations = _generations(snapshots, token)
        if not generations:
            return None
        try:
            return load_snapshot(generations[-1]).meta["native"]["seq"]
        except (SnapshotFormatError, FileNotFoundError):
            if _generations(snapshots, token)[-1:] == generations[-1:]:
                raise  # not replaced: a damaged snapshot


async def _until_on_disk(snapshots: Path, token: str, seq: int, timeout_s: float = 60.0) -> float:
    """Waits (without sending anything) until the newest snapshot on disk holds frames up to `seq` - 1; seconds."""
    start = time.monotonic()
    while (found := await asyncio.to_thread(_on_disk, snapshots, token)) != seq:
        assert found is None or found < seq, (found, seq)
        assert time.monotonic() - start < timeout_s, f"no snapshot of seq {seq} after {timeout_s} s (found {found})"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


def _resume_from(model, killed: Path, token: str, first: int) -> tuple[dict, list]:
    """Resumes `token` from the directory a kill left, feeds frames `first`.. FRAMES-1; (ready, their tokens)."""
    with BackgroundServer(_context(model, killed)) as server:
        async def run():
            ws, ready = await _hello(f"{server.native_url}?resume={token}")
            async with ws:
                assert ready["type"] == "ready", ready
                return ready, await _frames(ws, ready, range(ready["seq"], FRAMES))
        return asyncio.run(run())


@pytest.mark.parametrize("every", ["2turns", "1s"])
def test_a_killed_server_loses_only_the_frames_after_the_last_periodic_snapshot(model, expected, tmp_path, every):
    """`2turns`: snapshots after frames 1 and 3; the kill after frame 4 loses frame 4 only. `1s`: the client stops
    after frame 2 and sends nothing, the snapshot of frames 0..2 lands by the interval's timer alone."""
    turns = every.endswith("turns")
    fed = 5 if turns else 3  # frames served before the kill
    kept = 4 if turns else 3  # the next frame of the newest snapshot the kill leaves
    snapshots, killed = tmp_path / "snapshots", tmp_path / "killed"
    options = dict(snapshot_every_turns=2) if turns else dict(snapshot_every_s=1.0)
    with BackgroundServer(_context(model, snapshots, **options)) as server:
        async def run():
            ws, ready = await _hello(server.native_url)
            async with ws:
                token = ready["resume_token"]
                said = []
                for k in range(fed):  # with frames, each snapshot on disk before the frame that makes the next due
                    said += await _frames(ws, ready, [k])
                    if turns and (k + 1) % 2 == 0 and k + 1 < kept:
                        await _until_on_disk(snapshots, token, k + 1)
                waited = await _until_on_disk(snapshots, token, kept)
                shutil.copytree(snapshots, killed)  # what a SIGKILL at this moment leaves on disk
                said += await _frames(ws, ready, range(fed, FRAMES))  # the connection goes on, unaware
            return token, said, waited
        token, said, waited = asyncio.run(run())
    assert said == expected, (said, expected)  # periodic snapshots change nothing of the session they snapshot
    if not turns:
        assert waited < 30, waited  # the interval (1 s) plus a loaded machine's export and write

    ready, moved = _resume_from(model, killed, token, kept)
    assert ready["resumed"] is True and ready["resume_token"] == token and ready["seq"] == kept, ready
    assert moved == expected[kept:], (moved, expected)  # bit-exact from the snapshot point
    assert fed - kept == (1 if turns else 0)  # the frames the kill lost: fewer than one interval


def test_a_failed_periodic_write_is_reported_and_the_session_goes_on(model, expected, tmp_path):
    """A directory too small for any snapshot: every periodic write is refused (`snapshot_failed`, naming the cap),
    never silently dropped, and the frames go on being served exactly as without snapshots."""
    with BackgroundServer(_context(model, tmp_path / "s", snapshot_every_turns=1, snapshot_max_bytes=1)) as server:
        async def run():
            ws, ready = await _hello(server.native_url)
            async with ws:
                said, errors = [], []
                for k in range(3):
                    await ws.send(_frame(k, ready["frame_samples"]))
                    while len(said) <= k or len(errors) <= k:  # frame k's tokens and its snapshot's failure
                        reply = json.loads(await asyncio.wait_for(ws.recv(), 60))
                        if reply["type"] == "error":
                            errors.append(reply)
                        elif reply["type"] == "late_tokens" or not reply["late"]:
                            said.append((reply["seq"], reply["tokens"]))
                return said, errors
        said, errors = asyncio.run(run())
    assert said == expected[:3], (said, expected)
    for error in errors:
        assert error["code"] == "snapshot_failed" and "full" in error["message"], error
        assert str(tmp_path) not in error["message"], error  # no server path goes to the client


def test_frames_never_wait_for_a_slow_disk_and_writes_do_not_pile_up(model, expected, tmp_path):
    """`1turn` on a store whose first write is held up (a disk that stalls): the frames after it are served as fast
    as before (none waits for the write), no further snapshot is exported while the write is in flight (at most one
    export waits in memory, not one per frame), and once the write ends the newest state is taken and written by
    itself, though the client sends nothing more: the disk then holds every frame served."""
    context = _context(model, tmp_path / "s", snapshot_every_turns=1)
    store, release, saves = store_for(context), threading.Event(), []
    save = store.save

    def stalling_save(lease, snapshot):
        saves.append(snapshot.meta["native"]["seq"])
        assert release.wait(120), "the test never released the stalled write"
        return save(lease, snapshot)

    store.save = stalling_save
    with BackgroundServer(context) as server:
        async def run():
            ws, ready = await _hello(server.native_url)
            async with ws:
                said = await _frames(ws, ready, range(4))  # a hang here: a frame waited for the stalled write
                stalled = list(saves)
                release.set()
                await _until_on_disk(tmp_path / "s", ready["resume_token"], 4)
                return said, stalled, list(saves)
        said, stalled, after = asyncio.run(run())
    assert said == expected[:4], (said, expected)
    assert stalled == [1], stalled  # frame 0's snapshot, stalled; nothing exported behind it
    assert after == [1, 4], after  # then the newest state alone (frames 1-3 in one snapshot)
