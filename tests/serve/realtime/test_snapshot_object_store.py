"""The snapshot store in an object store (`--snapshot-dir gs://...`; here `memory://` and `file://`, the same
tensorstore kvstore interface as the gcs and s3 drivers), without a model: one object per snapshot
(`snapshot_blob`), read back bit-exactly and equal to what the directory format (orbax) reads back; a damaged,
truncated or foreign object refused by name; generations replaced only once the new one is durable; the size cap,
expiry and client messages as for a directory; and bad locations (an unknown scheme, a driver tensorstore lacks, an
unreachable bucket) refused by name when the store opens."""

import asyncio
import json
import logging
import os
import re
import secrets
import zlib

import ml_dtypes
import numpy as np
import pytest

from omnijax.kv import host_tier
from omnijax.serve.engine import snapshot_blob, snapshot_kv, snapshot_paths
from omnijax.serve.engine.snapshot import (
    ARRAY_FIELDS,
    SessionSnapshot,
    SnapshotFormatError,
    SnapshotSpec,
    load_snapshot,
    save_snapshot,
)
from omnijax.serve.realtime.snapshot_store import SnapshotStore, SnapshotStoreError, StoreFull
from omnijax.streaming.recall_session import RecallSnapshot
from tests.serve.realtime.test_snapshot_store import A, B, C, snap

BF16 = SnapshotSpec(page_size=4, num_layers=2, num_kv_heads=2, head_dim=8, position_axes=3, vocab_size=16,
                    dtype="bfloat16")


def _url(kind: str, tmp_path) -> str:
    """A fresh location: `memory://` (this process's) or `file://` under `tmp_path`."""
    return f"memory://{secrets.token_hex(6)}/s" if kind == "memory" else f"file://{tmp_path}/bucket/s"


def _rich(seed: int = 0, tier: bool = False) -> SessionSnapshot:
    """A snapshot with random contents in every field, bfloat16 pages, page-table gaps and (`tier`) a recall tier."""
    rng = np.random.default_rng(seed)
    E, P, L, G, d, V = 3, BF16.page_size, BF16.num_layers, BF16.num_kv_heads, BF16.head_dim, BF16.vocab_size
    i32 = np.int32
    recall = None
    if tier:
        n = 5
        unit = host_tier.UnitKV(
            unit=7, k=rng.standard_normal((L, G, n, d)).astype(ml_dtypes.bfloat16),
            v=rng.standard_normal((L, G, n, d)).astype(ml_dtypes.bfloat16), pos=rng.integers(0, 99, (3, n), i32),
            span=rng.integers(0, 3, n).astype(np.int8), offset=rng.integers(0, 9, n, i32),
            order=np.arange(n, dtype=i32), summary=rng.standard_normal((L, G, d)).astype(np.float32),
            vpos=np.arange(n, dtype=np.int64))
        recall = RecallSnapshot(tier=host_tier.HostTier(budget_bytes=1 << 20, units=(unit,), dropped_units=1),
                                vpos=np.arange(12, dtype=np.int64), cursor=12, counts=(("questions", 2),))
    return SessionSnapshot(
        entries=np.asarray([0, 2, 5], i32), k=rng.standard_normal((L, E, P, G, d)).astype(ml_dtypes.bfloat16),
        v=rng.standard_normal((L, E, P, G, d)).astype(ml_dtypes.bfloat16), valid=rng.random((E, P)) < 0.7,
        pos=rng.integers(0, 500, (3, E, P), i32), order=rng.integers(0, 24, (E, P), i32),
        unit=rng.integers(0, 5, (E, P), i32), span=rng.integers(0, 3, (E, P), i32),
        offset=rng.integers(0, 9, (E, P), i32), score=rng.standard_normal((E, P)).astype(np.float32),
        page_class=np.asarray([0, 1, 0], np.int8), seq_slots=np.asarray(24, i32), next_order=np.asarray(24, i32),
        exhausted=np.asarray(False), dropped=np.asarray(3, i32), next_pos=np.asarray(31, i32),
        key=rng.integers(0, 2**32, 2, dtype=np.uint32), last_logits=rng.standard_normal(V).astype(np.float32),
        counts=rng.integers(0, 4, V, i32), seen=rng.random(V) < 0.5, spec=BF16,
        meta={"conversation": [{"role": "user", "text": "hé"}], "n": 3}, tier=recall)


def _assert_same(got: SessionSnapshot, want: SessionSnapshot) -> None:
    for name in ARRAY_FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), name  # bit for bit
    assert got.spec == want.spec and got.meta == want.meta


def test_one_object_round_trips_bit_exactly_and_reads_as_the_directory_format_does(tmp_path):
    for tier in (False, True):
        original = _rich(1, tier=tier)
        data = snapshot_blob.encode(original)
        got = snapshot_blob.decode(data)
        _assert_same(got, original)
        on_disk = load_snapshot(save_snapshot(tmp_path / f"dir{tier}", original))  # the orbax directory format
        _assert_same(got, on_disk)
        if tier:
            for read in (got.tier, on_disk.tier):
                (u,), (w,) = read.tier.units, original.tier.tier.units
                assert read.cursor == 12 and read.counts == (("questions", 2),) and read.tier.dropped_units == 1
                for f in ("k", "v", "pos", "span", "offset", "order", "summary", "vpos"):
                    assert getattr(u, f).dtype == getattr(w, f).dtype, f
                    assert getattr(u, f).tobytes() == getattr(w, f).tobytes(), f
        else:
            assert got.tier is None


def _reheader(data: bytes, change) -> bytes:
    """`data` with its header changed by `change(header)` (payload kept)."""
    start = len(snapshot_blob.MAGIC) + 8
    size = int.from_bytes(data[len(snapshot_blob.MAGIC):start], "little")
    header = json.loads(data[start:start + size])
    change(header)
    text = json.dumps(header).encode()
    return snapshot_blob.MAGIC + len(text).to_bytes(8, "little") + text + data[start + size:]


def test_a_damaged_truncated_foreign_or_newer_object_is_refused_by_name_and_version_1_still_reads():
    data = snapshot_blob.encode(_rich(2))
    flipped = bytearray(data)
    flipped[-5] ^= 0x40
    cases = [(bytes(flipped), "checksum does not match"), (data[:-7], "truncated or damaged"),
             (data[:30], "truncated"), (b"PK\x03\x04" + data[4:], "not a session snapshot object"),
             (_reheader(data, lambda h: h.update(format_version=4)), "format_version 4 is not one of (1, 2, 3)"),
             (_reheader(data, lambda h: h.update(format="other")), "format is not 'omnijax-session'"),
             (_reheader(data, lambda h: h["arrays"]["k"].update(shape=[2, 3, 4, 2, 9])), "array k holds")]
    for bad, named in cases:
        with pytest.raises(SnapshotFormatError, match=re.escape(named)) as e:
            snapshot_blob.decode(bad, "gs://b/p/x.snapshot")
        assert "gs://b/p/x.snapshot" in str(e.value)

    def version_1(header):  # what a version-1 writer stored: no penalty history
        header.update(format_version=1)
        for name in ("counts", "seen"):
            del header["arrays"][name], header["blob"]["arrays"][name]
    old = snapshot_blob.decode(_reheader(data, version_1))
    assert not old.counts.any() and not old.seen.any() and old.counts.shape == (16,)
    assert old.k.tobytes() == _rich(2).k.tobytes()


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_each_write_is_a_new_object_and_the_previous_goes_once_it_is_durable(kind, tmp_path, monkeypatch):
    url = _url(kind, tmp_path)
    store = SnapshotStore(url)
    assert store.root == url + "/" and store.cleaned == 0
    lease = store.lease_new(A)
    first = store.save(lease, snap(mark=1.0))
    assert first.startswith(f"{url}/{A}/000000000000.") and store.latest(A) == first
    second = store.save(lease, snap(mark=2.0))
    assert second.startswith(f"{url}/{A}/000000000001.") and store.storage.generations(A) == [second]
    assert float(store.load(lease).k.reshape(-1)[0]) == 2.0
    if kind == "file":  # the objects are files of the file driver; nothing else is left beside them
        assert sorted(os.listdir(tmp_path / "bucket" / "s" / A)) == [second.rsplit("/", 1)[1]]

    def unreachable(key, value):
        raise snapshot_kv.KvStoreError(f"writing {url}/{key} failed: ValueError: UNAVAILABLE: connection reset")
    monkeypatch.setattr(store.storage.location, "create", unreachable)
    with pytest.raises(SnapshotStoreError) as failed:
        store.save(lease, snap(mark=3.0))
    assert "connection reset" in str(failed.value) and url not in str(failed.value), failed.value
    assert "<snapshot dir>" in str(failed.value)
    assert store.latest(A) == second and float(store.load(lease).k.reshape(-1)[0]) == 2.0  # the previous stays
    monkeypatch.undo()

    reopened = SnapshotStore(url)  # another store on the location (for memory://, of this process) sees it
    assert reopened.latest(A) == second and reopened.total_bytes() == store.total_bytes() > 0
    again = asyncio.run(reopened.acquire(A))
    assert float(reopened.load(again).k.reshape(-1)[0]) == 2.0
    assert reopened.latest(B) is None


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_size_cap_expiry_and_messages_as_for_a_directory(kind, tmp_path, caplog):
    url = _url(kind, tmp_path)
    store = SnapshotStore(url)
    store.save(store.lease_new(C), snap(pages=2))
    size = store.total_bytes()
    capped = SnapshotStore(url, max_bytes=int(1.5 * size) + SnapshotStore.estimate(snap(pages=2)))
    held = capped.lease_new(A)
    capped.save(held, snap(pages=2, mark=1.0))
    other = capped.lease_new(B)
    with caplog.at_level(logging.WARNING, "omnijax.serve"):
        capped.save(other, snap(pages=2, mark=2.0))  # C (oldest, not held) goes to make room
    assert capped.latest(C) is None and f"evicted the session {C[:8]}" in caplog.text
    assert capped.total_bytes() <= capped.max_bytes
    with pytest.raises(StoreFull, match="does not fit under the server's cap"):
        capped.save(other, snap(pages=4000, mark=3.0))
    assert float(capped.load(other).k.reshape(-1)[0]) == 2.0

    now = [1e9]
    aging = SnapshotStore(_url(kind, tmp_path / "aging"), max_age_s=60, clock=lambda: now[0])
    a, b = aging.lease_new(A), aging.lease_new(B)
    aging.save(a, snap())
    aging.save(b, snap())
    aging.release(a)
    now[0] += 61
    assert aging.expire() == [A] and aging.latest(A) is None and aging.latest(B) is not None  # B is held

    damaged = capped.latest(B)
    key = damaged[len(capped.root):]
    data, _ = capped.storage.location.read(key)
    capped.storage.location.write(key, data[:-3])  # damaged in place (by hand)
    with pytest.raises(SnapshotStoreError) as e:
        capped.load(other)
    assert "truncated or damaged" in str(e.value) and url not in str(e.value) and "/tmp" not in str(e.value)
    assert capped.public_message(OSError("writing gs://bucket/p/x failed")) == "writing <snapshot store> failed"


def test_a_killed_start_leaves_only_its_probe_which_the_next_open_removes(caplog):
    url = f"memory://{secrets.token_hex(6)}/s"
    location = snapshot_kv.open_location(url)
    location.write(".write-probe.0123456789abcdef", b"omnijax write probe")  # a start killed after its probe write
    with caplog.at_level(logging.WARNING, "omnijax.serve"):
        store = SnapshotStore(url)
    assert store.cleaned == 1 and location.list() == [] and "left by an interrupted start" in caplog.text


@pytest.mark.parametrize("url", ["http://host/sessions", "ftp://host/sessions", "zip://x", "gs:///no-bucket",
                                 "file://relative/path"])
def test_a_url_that_is_no_snapshot_location_is_refused_by_name(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # Path(url) is relative: a silent local write would land here
    with pytest.raises(ValueError) as e:
        SnapshotStore(url)
    scheme = url.split("://")[0]
    assert f"--snapshot-dir {url!r}" in str(e.value), e.value
    if scheme not in ("gs", "file"):
        assert f"is a {scheme}:// URL, which is not a snapshot location" in str(e.value)
        assert "gs://BUCKET/PREFIX, s3://BUCKET/PREFIX, file:///PATH, memory://PREFIX" in str(e.value)
    assert os.listdir(tmp_path) == []


def test_a_driver_this_tensorstore_lacks_is_refused_by_name(monkeypatch):
    # tensorstore knows a driver only when it was compiled in; an accepted scheme whose driver is missing is what a
    # build without gcs or s3 would meet (this build has both: the scheme table is widened to one it lacks)
    monkeypatch.setitem(snapshot_paths.KV_SCHEMES, "azure", "azure")
    with pytest.raises(ValueError, match=r"--snapshot-dir azure://account/sessions/: this tensorstore was built "
                                         r"without its 'azure' kvstore driver .*unsupported URL scheme"):
        SnapshotStore("azure://account/sessions")


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_an_unreachable_bucket_is_refused_by_name_within_seconds(scheme, monkeypatch):
    # no network here: the probe write fails (for a reachable bucket without credentials or rights it fails too);
    # before, the store would have opened and every session's first snapshot would have failed
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "none")  # no credential lookup of the host's own
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "none")
    url = f"{scheme}://omnijax-no-such-bucket-{secrets.token_hex(4)}/sessions"
    with pytest.raises(ValueError) as e:
        SnapshotStore(url, probe_timeout_s=20.0)
    text = str(e.value)
    assert f"--snapshot-dir {url}/ cannot be written by this server" in text, text
    assert "check the bucket's name, this host's network and credentials" in text, text


def test_directory_functions_still_refuse_urls_and_write_no_local_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for url in ("gs://bucket/one", "memory://one"):
        with pytest.raises(ValueError, match="a snapshot directory is a local or mounted POSIX path"):
            save_snapshot(url, snap())
        with pytest.raises(ValueError, match=r"is a (gs|memory):// URL"):
            load_snapshot(url)
    assert os.listdir(tmp_path) == []
    crc = zlib.crc32(snapshot_blob.encode(snap()))  # deterministic: equal snapshots give equal objects
    assert crc == zlib.crc32(snapshot_blob.encode(snap()))
