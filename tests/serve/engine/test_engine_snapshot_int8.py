"""Engine snapshots of an int8 KV pool (issue 40): a snapshot carries the pool's int8 codes and their scales
(`k_scale` / `v_scale`, `SnapshotSpec.kv_dtype`) and, with recall, the host tier. A session exported mid-script
(beside another session, so its pages are not the first ones), written to a snapshot directory or one object and
imported into a fresh engine holding another session, answers every later frame as the uninterrupted session does:
with recall, as a batch-1 `Session` with the same int8 config (the oracle test_engine_recall_paging checks the engine
against); without recall, as the same script run on one engine. The codes and scales read back are the pool's bit
for bit; a float engine refuses an int8 snapshot by name, and so does an int8 engine a float one."""

import numpy as np
import pytest

from omnijax.serve.engine import snapshot_blob
from omnijax.serve.engine.engine import Engine, EngineConfig
from omnijax.serve.engine.snapshot import SnapshotMismatch, load_snapshot, save_snapshot
from tests._support import recall_setup
from tests.serve.engine.test_engine_recall import (
    POLICIES,
    T,
    _assert_same,
    _config,
    _context,
    _oracle,
    _run_engine,
    _script,
)

CUT = 10  # after the held question's release and some context


@pytest.fixture(scope="module")
def model():
    return recall_setup.decoder()


def _engine(model, config):
    return Engine(model, EngineConfig(stream=config, chunk_tokens=T, buckets=(1, 2, 4)))


def _exported(model, config, script):
    """Session a run to `CUT` beside session b (opened first, fed a frame), its frames and its snapshot."""
    engine = _engine(model, config)
    engine.open("b")
    engine.submit("b", _context(9)[0], 0)
    engine.tick()
    engine.open("a")
    first = _run_engine(engine, {"a": script[:CUT]}, [("a",)] * CUT)["a"]
    snapshot = engine.export_session("a")
    assert snapshot.spec.kv_dtype == "int8" and snapshot.k.dtype == np.int8 and snapshot.k_scale.dtype == np.float32
    kv, row = engine.state.kv, engine._slots["a"]
    pages = np.asarray(kv.page_table[row])[np.asarray(snapshot.entries)]
    for name in ("k", "v"):  # the pool's codes and scales, bit for bit
        np.testing.assert_array_equal(getattr(snapshot, name), np.asarray(getattr(kv, name).values)[:, pages])
        np.testing.assert_array_equal(getattr(snapshot, f"{name}_scale"), np.asarray(getattr(kv, name).scale)[:, pages])
    return first, snapshot, engine


def _resumed(model, config, snapshot, script):
    fresh = _engine(model, config)
    fresh.open("other")  # another session in the pool: the resumed one takes other pages
    fresh.submit("other", _context(8)[0], 0)
    fresh.tick()
    fresh.import_session("a", snapshot)
    return fresh, _run_engine(fresh, {"a": script[CUT:]}, [("a",)] * (len(script) - CUT))["a"]


def test_an_int8_recall_session_resumed_from_disk_answers_as_the_uninterrupted_one(model, tmp_path):
    config = _config(POLICIES["omnipick"]).replace(kv_dtype="int8")
    script = _script(0)
    oracle, want = _oracle(model, config, script)
    first, snapshot, engine = _exported(model, config, script)
    assert snapshot.tier is not None and engine.recall_stats("a").stored_units > 0
    save_snapshot(tmp_path / "a", snapshot)
    loaded = load_snapshot(tmp_path / "a")
    for name in ("k", "v", "k_scale", "v_scale"):
        np.testing.assert_array_equal(getattr(loaded, name), getattr(snapshot, name))
    fresh, rest = _resumed(model, config, loaded, script)
    _assert_same(first + rest, want, "int8 + recall, resumed")
    assert fresh.recall_stats("a") == oracle.recall_stats()


def test_an_int8_session_without_recall_resumed_from_one_object_answers_as_the_uninterrupted_one(model):
    config = _config(POLICIES["omnipick"], recall=None).replace(kv_dtype="int8")  # the first test's step program
    script = _script(3)
    whole = _engine(model, config)
    whole.open("b")
    whole.submit("b", _context(9)[0], 0)
    whole.tick()
    whole.open("a")
    want = _run_engine(whole, {"a": script}, [("a",)] * len(script))["a"]
    first, snapshot, _ = _exported(model, config, script)
    assert snapshot.tier is None
    _, rest = _resumed(model, config, snapshot_blob.decode(snapshot_blob.encode(snapshot)), script)
    _assert_same(first + rest, want, "int8, resumed")

    float_engine = _engine(model, config.replace(kv_dtype="float"))
    with pytest.raises(SnapshotMismatch, match="kv_dtype int8 \\(target: float\\)"):
        float_engine.import_session("a", snapshot)
    float_engine.open("f")  # a float session (no pages yet) into an int8 engine
    int8_engine = _engine(model, config)
    with pytest.raises(SnapshotMismatch, match="kv_dtype float \\(target: int8\\)"):
        int8_engine.import_session("f", float_engine.export_session("f"))
    assert int8_engine.sessions == [] and "a" not in float_engine.sessions
