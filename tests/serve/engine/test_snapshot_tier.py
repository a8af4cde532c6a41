"""An engine snapshot's recall tier file (`omnijax.serve.engine.snapshot_tier`, issue 40's "a session snapshot whose
host tier is missing or corrupt: refused by name"): written and read back bit for bit (float32 and bfloat16 keys),
and a damaged file (truncated, a byte changed inside any member, empty, not a zip) refused with a ValueError naming
the file, which `load_snapshot` turns into a `SnapshotFormatError`; a tier with spilled units is refused before
anything is written. No model: two small records of random keys (the file's form does not depend on the sizes)."""

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from omnijax.kv import host_tier, host_tier_disk
from omnijax.serve.engine.snapshot_tier import read_tier, write_tier
from omnijax.streaming.recall_session import RecallSnapshot

L, G, D = 2, 2, 8


def _snapshot(dtype=np.float32) -> RecallSnapshot:
    rng = np.random.default_rng(0)
    units, at = [], 0
    for unit, n in ((3, 5), (7, 4)):
        k = rng.normal(size=(L, G, n, D)).astype(dtype)
        v = rng.normal(size=(L, G, n, D)).astype(dtype)
        pos = (at + np.arange(n))[None]
        units.append(host_tier.make_unit(unit, k, v, pos, np.full(n, 2), np.arange(n), at + np.arange(n))
                     .with_vpos(at + 10 + np.arange(n)))
        at += n
    tier = host_tier.HostTier(budget_bytes=1 << 20, units=tuple(units), dropped_units=1, dropped_bytes=123)
    return RecallSnapshot(tier=tier, vpos=np.arange(at, dtype=np.int64) + 10, cursor=at + 10,
                          counts=(("captured_units", 3), ("questions", 1)))


def _assert_same(got: RecallSnapshot, want: RecallSnapshot) -> None:
    assert (got.cursor, got.counts) == (want.cursor, want.counts)
    np.testing.assert_array_equal(got.vpos, want.vpos)
    assert dataclasses.replace(got.tier, units=()) == dataclasses.replace(want.tier, units=())
    assert [u.unit for u in got.tier.units] == [u.unit for u in want.tier.units]
    for a, b in zip(got.tier.units, want.tier.units, strict=True):
        for f in ("k", "v", "pos", "span", "offset", "order", "summary", "vpos"):
            x, y = getattr(a, f), getattr(b, f)
            assert x.dtype == y.dtype and x.shape == y.shape, f
            assert x.tobytes() == y.tobytes(), f  # bit for bit
            assert not x.flags.writeable


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
def test_a_tier_file_reads_back_bit_for_bit(tmp_path, dtype):
    want = _snapshot(dtype)
    write_tier(tmp_path / "t.npz", want)
    _assert_same(read_tier(tmp_path / "t.npz"), want)


def test_a_damaged_tier_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "t.npz"
    write_tier(path, _snapshot())
    raw = path.read_bytes()
    bad = tmp_path / "bad.npz"
    # A byte changed at the middle of each member's stored data (its local header's name found in the file).
    members = [raw.index(f"{name}.npy".encode()) for name in ("header", "vpos", "u0_k", "u1_v", "u1_vpos")]
    cases = {"empty": b"", "not a zip": b"not a recall tier at all", "truncated": raw[:len(raw) // 2],
             "end cut": raw[:-10], **{f"byte {at}": raw[:at] + bytes([raw[at] ^ 0xFF]) + raw[at + 1:]
                                      for at in (m + 120 for m in members)}}
    for what, data in cases.items():
        bad.write_bytes(data)
        with pytest.raises(ValueError, match=f"{bad}: (not a readable recall tier|the recall tier is malformed)"):
            read_tier(bad)
            pytest.fail(f"{what}: read")
    _assert_same(read_tier(path), _snapshot())  # the intact file still reads


def test_a_tier_with_spilled_units_is_refused_before_writing(tmp_path):
    snap = _snapshot()
    spilled = host_tier_disk.spill(snap.tier.units[0], str(tmp_path))
    tier = dataclasses.replace(snap.tier, units=(spilled,) + snap.tier.units[1:])
    with pytest.raises(ValueError, match="spilled to disk .*which a snapshot on disk does not carry yet"):
        write_tier(tmp_path / "t.npz", dataclasses.replace(snap, tier=tier))
    assert not (tmp_path / "t.npz").exists()
