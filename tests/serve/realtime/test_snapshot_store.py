"""The Realtime snapshot store (`omnijax.serve.realtime.snapshot_store`) without a model: the directory's mode,
clean-up of killed writes, generations replaced atomically, leases, the size cap, expiry, and client-facing messages
without server paths; and `--snapshot-every` parsing."""

import asyncio
import errno
import logging
import os
import stat
import time

import numpy as np
import pytest

from omnijax.serve.engine.snapshot import SessionSnapshot, SnapshotSpec, save_snapshot
from omnijax.serve.realtime import snapshot_store as store_lib
from omnijax.serve.realtime.snapshot_store import (
    SnapshotStore,
    SnapshotStoreError,
    StoreFull,
    TokenInUse,
    parse_duration,
    parse_every,
)

A, B, C = "a" * 32, "b" * 32, "c" * 32
SPEC = SnapshotSpec(page_size=2, num_layers=1, num_kv_heads=1, head_dim=2, position_axes=1, vocab_size=4,
                    dtype="float32")


def snap(pages: int = 1, mark: float = 0.0, **meta) -> SessionSnapshot:
    """A small consistent snapshot of `pages` pages; `mark` fills its keys (to tell snapshots apart)."""
    E, P = pages, SPEC.page_size
    i32 = np.int32
    return SessionSnapshot(
        entries=np.arange(E, dtype=i32), k=np.full((1, E, P, 1, 2), mark, np.float32),
        v=np.zeros((1, E, P, 1, 2), np.float32), valid=np.ones((E, P), bool), pos=np.zeros((1, E, P), i32),
        order=np.zeros((E, P), i32), unit=np.zeros((E, P), i32), span=np.zeros((E, P), i32),
        offset=np.zeros((E, P), i32), score=np.zeros((E, P), np.float32), page_class=np.zeros((E,), np.int8),
        seq_slots=np.asarray(E * P, i32), next_order=np.asarray(E * P, i32), exhausted=np.asarray(False),
        dropped=np.asarray(0, i32), next_pos=np.asarray(E * P, i32), key=np.zeros((2,), np.uint32),
        last_logits=np.zeros((4,), np.float32), spec=SPEC, meta=meta)


def _mark(store: SnapshotStore, lease) -> float:
    return float(store.load(lease).k.reshape(-1)[0])


def test_parse_every_and_durations():
    assert parse_every("30s") == (30.0, 0) and parse_every("2m") == (120.0, 0) and parse_every("1.5") == (1.5, 0)
    assert parse_every("5turns") == (0.0, 5) and parse_every("1turn") == (0.0, 1) and parse_every("0") == (0.0, 0)
    assert parse_duration("24h") == 86400.0 and parse_duration("7d") == 7 * 86400.0
    for bad in ("", "5 minutes", "-3s", "turns", "1.5turns", "3x"):
        with pytest.raises(ValueError, match="--snapshot-every takes"):
            parse_every(bad)
    with pytest.raises(ValueError, match="--snapshot-max-age is a number of seconds"):
        parse_duration("soon", "--snapshot-max-age")


def test_directory_is_created_0700_and_an_open_one_is_tightened(tmp_path, caplog):
    new = tmp_path / "fresh" / "sessions"
    SnapshotStore(new)
    assert stat.S_IMODE(new.stat().st_mode) == 0o700
    readable = tmp_path / "world_readable"
    readable.mkdir()
    os.chmod(readable, 0o755)
    with caplog.at_level(logging.WARNING, "omnijax.serve"):
        SnapshotStore(readable)
    assert stat.S_IMODE(readable.stat().st_mode) == 0o700
    assert any("was mode 755" in r.getMessage() and "tightened to 700" in r.getMessage() for r in caplog.records)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="cannot use it as the snapshot directory"):
        SnapshotStore(a_file)


def test_open_removes_temp_folders_of_killed_writes_and_moves_the_old_layout(tmp_path, caplog):
    root = tmp_path / "s"
    save_snapshot(root / A, snap(mark=7.0))  # the older layout: <token>/session.json
    (root / f".{B}.1234abcd.tmp" / "arrays").mkdir(parents=True)  # a killed write of the older layout
    (root / B).mkdir()
    (root / B / ".000000000003.x1y2.tmp").mkdir()  # a killed write of a generation
    (root / B / ".000000000003.x1y2.tmp" / "session.json").write_text("{")
    with caplog.at_level(logging.INFO, "omnijax.serve"):
        store = SnapshotStore(root)
    assert store.cleaned == 2
    assert sorted(p.name for p in root.iterdir()) == [A, B] and list((root / B).iterdir()) == []
    assert any("cleaned 2 temp folder(s)" in r.getMessage() for r in caplog.records)
    assert store.latest(A).name == "000000000000"
    lease = asyncio.run(store.acquire(A))
    assert _mark(store, lease) == 7.0
    assert store.latest(B) is None


def test_each_write_is_a_new_generation_and_the_previous_stays_until_it_is_on_disk(tmp_path, monkeypatch):
    store = SnapshotStore(tmp_path / "s")
    lease = store.lease_new(A)
    first = store.save(lease, snap(mark=1.0))
    assert first.name == "000000000000" and _mark(store, lease) == 1.0
    second = store.save(lease, snap(mark=2.0))
    assert second.name == "000000000001" and not first.exists() and _mark(store, lease) == 2.0

    def full_disk(path, snapshot):
        path.parent.joinpath(f".{path.name}.dead.tmp").mkdir()  # what a write dying half-way leaves
        raise OSError(errno.ENOSPC, "No space left on device", str(path / "arrays"))

    monkeypatch.setattr(store_lib, "save_snapshot", full_disk)
    with pytest.raises(SnapshotStoreError) as failed:
        store.save(lease, snap(mark=3.0))
    message = str(failed.value)
    assert "No space left on device" in message and str(tmp_path) not in message and "<snapshot dir>" in message
    assert store.latest(A) == second and _mark(store, lease) == 2.0  # the previous snapshot stays whole
    assert SnapshotStore(tmp_path / "s").cleaned == 1  # the next start removes the dead write


def test_a_token_is_leased_to_one_connection_and_a_closing_one_is_waited_for(tmp_path):
    store = SnapshotStore(tmp_path / "s", live_grace_s=0.1, write_wait_s=0.5)

    async def scenario():
        first = await store.acquire(A)
        with pytest.raises(TokenInUse, match="in use by another open connection"):
            await store.acquire(A)  # the holder is connected: refused after the grace
        first.closing = True  # the holder ends and writes its last snapshot: the next one waits for it
        loop = asyncio.get_running_loop()
        loop.call_later(0.2, store.release, first)
        start = loop.time()
        second = await store.acquire(A)
        assert 0.15 < loop.time() - start < 0.5 and store.held(A)
        second.closing = True
        with pytest.raises(TokenInUse, match="still writing its snapshot after 0.5 s"):
            await store.acquire(A)  # a write that never ends is waited for only so long
        store.release(second)
        store.release(second)  # idempotent
        assert not store.held(A)
        third = await store.acquire(A)
        with pytest.raises(SnapshotStoreError, match="no longer holds"):
            store.save(second, snap())  # a released lease writes nothing
        store.save(third, snap())
        with pytest.raises(SnapshotStoreError, match="32 hex digits"):
            await store.acquire("../" + A[:29])
        with pytest.raises(SnapshotStoreError, match="already exists"):
            store.lease_new(A)

    asyncio.run(scenario())


def test_size_cap_evicts_the_oldest_unheld_snapshots_and_refuses_what_cannot_fit(tmp_path, caplog):
    store = SnapshotStore(tmp_path / "s")
    store.save(store.lease_new(C), snap(pages=2))
    size = store.total_bytes()  # one snapshot on disk; two fit under the cap with room for a write, three do not
    capped = SnapshotStore(tmp_path / "s", max_bytes=int(1.5 * size) + SnapshotStore.estimate(snap(pages=2)))
    held = capped.lease_new(A)
    capped.save(held, snap(pages=2, mark=1.0))
    other = capped.lease_new(B)
    with caplog.at_level(logging.WARNING, "omnijax.serve"):
        capped.save(other, snap(pages=2, mark=2.0))  # C (oldest, not held) goes to make room
    assert capped.latest(C) is None and any(f"evicted the session {C[:8]}" in r.getMessage()
                                            for r in caplog.records)
    assert capped.total_bytes() <= capped.max_bytes
    with pytest.raises(StoreFull, match="does not fit under the server's cap"):
        capped.save(other, snap(pages=4000, mark=3.0))  # A is held: nothing to evict; B's own one stays
    assert _mark(capped, other) == 2.0 and capped.latest(A) is not None


def test_snapshots_expire_unless_held(tmp_path):
    now = [1000.0]
    store = SnapshotStore(tmp_path / "s", max_age_s=60, clock=lambda: now[0])
    a, b = store.lease_new(A), store.lease_new(B)
    store.save(a, snap())
    store.save(b, snap())
    store.release(a)
    now[0] += 61
    assert store.expire() == [A]  # B is held: kept
    lease = asyncio.run(store.acquire(A))
    with pytest.raises(SnapshotStoreError, match="no snapshot for this resume token"):
        store.load(lease)
    store.release(b)
    reopened = SnapshotStore(tmp_path / "s", max_age_s=60, clock=lambda: time.time() + 61)  # files' real times
    assert reopened.latest(B) is None  # opening expires too


def test_client_messages_name_no_server_path(tmp_path):
    store = SnapshotStore(tmp_path / "s")
    lease = store.lease_new(A)
    store.save(lease, snap())
    manifest = store.latest(A) / "session.json"
    manifest.write_text("{not json")
    with pytest.raises(SnapshotStoreError) as e:
        store.load(lease)
    text = str(e.value)
    assert "cannot read the snapshot manifest" in text and str(tmp_path) not in text and "/tmp" not in text
    assert store.public_message(OSError(2, "gone", "/var/lib/x/y.bin")) == "[Errno 2] gone: '<path>'"
