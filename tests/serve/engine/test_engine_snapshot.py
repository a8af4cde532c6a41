"""Session snapshots (`omnijax.serve.engine.snapshot`): a session exported between ticks and imported into the same
engine (another row, other pages) or, through disk, into a fresh engine continues exactly as an uninterrupted run: the
same next-frame logits and answer tokens, the same sampled tokens (the key travels); and every refusal leaves the
engine as it was.

Tiny decoder; compiled programs: the greedy step and the sampling step, both at bucket 4, shared by every engine of
their config, plus the row write for a few page counts.
"""

import dataclasses
import json
import re

import jax
import numpy as np
import pytest

import omnijax
from omnijax.chunks.chunk import text_chunk
from omnijax.decoding import Sampling, folded_keys
from omnijax.kv.paged import PageClass
from omnijax.models.config import TINY_OMNI
from omnijax.retention.baselines import SinkWindow
from omnijax.serve.engine import snapshot as snapshot_lib
from omnijax.serve.engine.engine import DuplicateSession, Engine, EngineConfig
from omnijax.serve.engine.snapshot import (
    ARRAY_FIELDS,
    NotEnoughPages,
    SessionSnapshot,
    SnapshotFormatError,
    SnapshotMismatch,
    export_row,
    import_row,
    load_snapshot,
    save_snapshot,
)
from omnijax.streaming.step import init_state

S, W, P, NUM_PAGES, T, TAU = 4, 16, 8, 24, 8, 2
K, NEXT = 4, 3  # frames before the snapshot, frames compared after it
STREAM = omnijax.StreamConfig(policy=SinkWindow(S, W), num_pages=NUM_PAGES, page_size=P, max_answer_tokens=TAU,
                              impl="xla")
CONFIG = EngineConfig(stream=STREAM, chunk_tokens=T, buckets=(4,), return_logits=True)
SEED = 3
SAMPLED = EngineConfig(stream=STREAM.replace(num_pages=12, decoding=Sampling(temperature=0.9, seed=SEED)),
                       chunk_tokens=T, buckets=(4,), return_logits=True)
META = {"items": [{"role": "user", "text": "hi"}], "unit": K}


@pytest.fixture(scope="module")
def decoder():
    return omnijax.Decoder(TINY_OMNI)


def _frames(seed: int, n: int) -> list:
    rng = np.random.default_rng(seed)
    return [text_chunk(rng.integers(0, TINY_OMNI.vocab_size, int(rng.integers(3, T + 1))), unit=i) for i in range(n)]


def _scenario(decoder, config, frames):
    """Session "a" served K frames beside "b", then exported; an uninterrupted reference engine serves "a" the same
    frames and NEXT more. Returns `(engine, snapshot, table row of "a" at export [M], reference outputs after it)`."""
    engine, ref = Engine(decoder, config), Engine(decoder, config)
    for e in (engine, ref):
        e.open("a")  # the first session of both: the same sampling key
    engine.open("b")
    for i in range(K):
        for e in (engine, ref):
            e.submit("a", frames[i], TAU)
        engine.submit("b", frames[-1 - i], 1)
        got, want = engine.tick().outputs["a"], ref.tick().outputs["a"]
        assert got.tokens == want.tokens and len(got.tokens) == TAU
    snapshot = engine.export_session("a", meta=META)
    table = np.asarray(engine.state.kv.page_table[engine.slot("a")])
    expected = []
    for frame in frames[K:K + NEXT]:
        ref.submit("a", frame, TAU)
        expected.append(ref.tick().outputs["a"])
    return engine, snapshot, table, expected


@pytest.fixture(scope="module")
def greedy(decoder):
    frames = _frames(0, K + NEXT + 1)
    engine, snapshot, table, expected = _scenario(decoder, CONFIG, frames)
    return dict(engine=engine, snapshot=snapshot, table=table, expected=expected, frames=frames)


def _continue(engine, sid, frames, expected, others=()):
    """Feeds the frames after the snapshot to `sid` (and one to each of `others`); checks them against the
    uninterrupted run."""
    for frame, want in zip(frames[K:K + NEXT], expected):
        engine.submit(sid, frame, TAU)
        for o in others:
            engine.submit(o, frame, 1)
        got = engine.tick().outputs[sid]
        np.testing.assert_allclose(got.logits, want.logits, atol=1e-6, rtol=0)
        assert got.tokens == want.tokens and len(got.tokens) == TAU and not got.preempted and got.dropped == 0


def test_snapshot_holds_the_row(greedy):
    snap, table = greedy["snapshot"], greedy["table"]
    entries = np.flatnonzero(table >= 0)
    assert snap.num_pages == len(entries) > 0 and np.array_equal(snap.entries, entries)
    assert snap.k.shape == (TINY_OMNI.num_layers, len(entries), P, TINY_OMNI.num_kv_heads, TINY_OMNI.head_dim)
    assert snap.pos.shape == (TINY_OMNI.position_axes, len(entries), P) and snap.last_logits.shape == (300,)
    assert int(snap.next_pos) == int(snap.next_order) > 0 and not bool(snap.exhausted) and int(snap.dropped) == 0
    assert (snap.page_class != PageClass.FREE).all() and snap.valid.any(axis=1).all()
    assert snap.meta == META and snap.spec.page_size == P and snap.spec.dtype == "float32"
    assert all(isinstance(a, np.ndarray) for a in snap.arrays().values())
    # A pytree of its arrays; spec and meta are static and hashable.
    assert len(jax.tree.leaves(snap)) == len(ARRAY_FIELDS)
    copy = jax.tree.map(np.copy, snap)
    assert isinstance(copy, SessionSnapshot) and copy.meta == META and copy.spec == snap.spec
    hash(jax.tree.structure(snap))


def test_restore_into_the_same_engine_matches_the_uninterrupted_run(greedy):
    engine, snap = greedy["engine"], greedy["snapshot"]
    old_row = engine.slot("a")
    engine.close("a")
    engine.open("x")  # takes a's row; x and b take a's pages
    for s in ("b", "x"):
        engine.submit(s, greedy["frames"][0], 1)
    engine.tick()
    free = engine.free_pages
    engine.import_session("a2", snap)
    assert engine.sessions == ["b", "x", "a2"] and engine.slot("a2") != old_row
    assert engine.free_pages == free - snap.num_pages
    table = np.asarray(engine.state.kv.page_table[engine.slot("a2")])
    assert np.array_equal(table >= 0, greedy["table"] >= 0)  # same logical layout
    assert not np.array_equal(table, greedy["table"])  # other physical pages
    assert np.array_equal(np.asarray(engine.state.kv.page_class)[table[table >= 0]], snap.page_class)
    _continue(engine, "a2", greedy["frames"], greedy["expected"], others=("b", "x"))


def test_restore_from_disk_into_a_fresh_engine_matches(greedy, decoder, tmp_path):
    path = save_snapshot(tmp_path / "sessions" / "a", greedy["snapshot"])
    assert path.is_dir() and [p.name for p in path.parent.iterdir()] == ["a"]  # no temporary left beside it
    loaded = load_snapshot(path)
    assert loaded.meta == META and loaded.spec == greedy["snapshot"].spec
    for name in ARRAY_FIELDS:
        want, got = getattr(greedy["snapshot"], name), getattr(loaded, name)
        assert got.dtype == want.dtype and np.array_equal(got, want), name
    engine = Engine(decoder, CONFIG)  # a server restart: a fresh engine over the same model
    engine.import_session("a", loaded)
    assert engine.free_pages == NUM_PAGES - loaded.num_pages
    _continue(engine, "a", greedy["frames"], greedy["expected"])


def test_sampled_tokens_continue_with_the_restored_key(decoder):
    frames = _frames(1, K + NEXT)
    engine, snap, _, expected = _scenario(decoder, SAMPLED, frames)
    assert not np.array_equal(snap.key, np.asarray(folded_keys(SEED, [0])[0]))  # split at every sampled token
    engine.close("a")
    engine.submit("b", frames[0], 1)
    engine.tick()
    engine.import_session("a2", snap)  # the engine's third session: its folded key is not the snapshot's
    assert not np.array_equal(np.asarray(folded_keys(SEED, [2])[0]), snap.key)
    assert np.array_equal(np.asarray(engine.state.key[engine.slot("a2")]), snap.key)
    _continue(engine, "a2", frames, expected, others=("b",))


def test_a_preempted_session_is_not_exported(decoder):
    engine = Engine(decoder, SAMPLED)  # 12 pages: four sessions of full frames exhaust them
    for s in "abcd":
        engine.open(s)
    rng = np.random.default_rng(2)
    while not engine.preempted:
        for s in "abcd":
            engine.submit(s, text_chunk(rng.integers(0, TINY_OMNI.vocab_size, T)), TAU)
        engine.tick()
    with pytest.raises(ValueError, match="preempted"):
        engine.export_session(engine.preempted[0])
    with pytest.raises(KeyError):
        engine.export_session("nope")


def test_a_session_without_a_row_yet_exports_and_round_trips_with_no_pages(decoder, tmp_path):
    engine = Engine(decoder, CONFIG)
    engine.open("n")  # never ticked: export arranges its row and installs its key
    snap = engine.export_session("n")
    assert snap.num_pages == 0 and snap.table_width == 0 and int(snap.next_pos) == 0 and snap.meta == {}
    assert np.array_equal(snap.key, np.asarray(folded_keys(0, [0])[0]))
    loaded = load_snapshot(save_snapshot(tmp_path / "n", snap))  # zero-size arrays are not stored, only described
    assert loaded.num_pages == 0 and loaded.k.shape == snap.k.shape and np.array_equal(loaded.key, snap.key)
    fresh = Engine(decoder, CONFIG)
    fresh.import_session("n", loaded)
    assert fresh.sessions == ["n"] and fresh.free_pages == NUM_PAGES


def _refused(engine, snap, error, match, sid="r"):
    """The import is refused with `error` and the engine keeps its sessions and free pages."""
    sessions, free = engine.sessions, engine.free_pages
    with pytest.raises(error, match=match):
        engine.import_session(sid, snap)
    assert engine.sessions == sessions and engine.free_pages == free


def test_refusals_leave_the_engine_unchanged(greedy, decoder, monkeypatch):
    snap = greedy["snapshot"]
    E = snap.num_pages
    small = Engine(decoder, EngineConfig(stream=STREAM.replace(num_pages=E - 1), chunk_tokens=T, buckets=(4,),
                                         max_pages=E))  # room in the table, not in the pool
    small.open("c")
    _refused(small, snap, NotEnoughPages, f"holds {E} pages but the pool has {E - 1} free")
    narrow = Engine(decoder, EngineConfig(stream=STREAM, chunk_tokens=T, buckets=(4,),
                                          max_pages=snap.table_width - 1))
    _refused(narrow, snap, NotEnoughPages, "page-table rows hold")
    paged16 = Engine(decoder, EngineConfig(stream=STREAM.replace(page_size=16), chunk_tokens=T, buckets=(4,)))
    _refused(paged16, snap, SnapshotMismatch, r"page_size 8 \(target: 16\)")
    _refused(small, snap, DuplicateSession, "already open", sid="c")
    exhausted = snapshot_lib.SessionSnapshot(**{**snap.arrays(), "exhausted": np.asarray(True)}, spec=snap.spec)
    _refused(Engine(decoder, CONFIG), exhausted, ValueError, "exhausted")

    # A failure after the session opened closes it again.
    def broken(*args, **kwargs):
        raise RuntimeError("write failed")

    engine = Engine(decoder, CONFIG)
    engine.open("c")
    monkeypatch.setattr(snapshot_lib, "import_row", broken)
    _refused(engine, snap, RuntimeError, "write failed")


def test_pure_import_refuses_another_model_and_a_non_empty_row(greedy):
    snap, state = greedy["snapshot"], greedy["engine"].state
    for change, named in ((dict(num_layers=3), "num_layers 2 (target: 3)"),
                          (dict(num_kv_heads=1), "num_kv_heads 2 (target: 1)"),
                          (dict(vocab_size=301), "vocab_size 300 (target: 301)"),
                          (dict(dtype="bfloat16"), "dtype float32 (target: bfloat16)")):
        other = init_state(dataclasses.replace(TINY_OMNI, **change), num_pages=NUM_PAGES, page_size=P, batch=2)
        with pytest.raises(SnapshotMismatch, match=re.escape(named)):
            import_row(other, 0, snap)
    held = int(np.flatnonzero(np.asarray(state.kv.page_table).max(axis=1) >= 0)[0])
    with pytest.raises(ValueError, match=f"row {held} is not empty"):
        import_row(state, held, snap)
    with pytest.raises(IndexError):
        export_row(state, state.kv.batch)
    bad = SessionSnapshot(**{**snap.arrays(), "entries": snap.entries[::-1].copy()}, spec=snap.spec)
    with pytest.raises(ValueError, match="ascending"):
        import_row(state, 0, bad)
    with pytest.raises(TypeError, match="JSON"):
        SessionSnapshot(**snap.arrays(), spec=snap.spec, meta={"x": object()})


def test_disk_refusals_name_the_path(greedy, tmp_path):
    snap = greedy["snapshot"]
    path = save_snapshot(tmp_path / "s", snap)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_snapshot(path, snap)
    newer = SessionSnapshot(**snap.arrays(), spec=snap.spec, meta={"version": 2})
    save_snapshot(path, newer, overwrite=True)
    assert load_snapshot(path).meta == {"version": 2} and sorted(p.name for p in tmp_path.iterdir()) == ["s"]
    other = tmp_path / "not_a_snapshot"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a session snapshot"):
        save_snapshot(other, snap, overwrite=True)
    assert (other / "keep.txt").read_text() == "mine"

    with pytest.raises(FileNotFoundError, match=str(tmp_path / "missing")):
        load_snapshot(tmp_path / "missing")
    with pytest.raises(SnapshotFormatError, match=f"{other} is not a session snapshot"):
        load_snapshot(other)
    garbled = tmp_path / "garbled"
    garbled.mkdir()
    (garbled / snapshot_lib.MANIFEST).write_text("{not json")
    with pytest.raises(SnapshotFormatError, match=str(garbled)):
        load_snapshot(garbled)
    manifest = json.loads((path / snapshot_lib.MANIFEST).read_text())
    manifest["arrays"]["k"]["shape"][1] += 1  # the manifest no longer describes the stored arrays
    (path / snapshot_lib.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(SnapshotFormatError, match=str(path)):
        load_snapshot(path)


def test_pure_round_trip_keeps_table_gaps_and_bfloat16_bits(tmp_path):
    config = dataclasses.replace(TINY_OMNI, dtype="bfloat16")
    state = init_state(config, num_pages=8, page_size=P, batch=2, max_pages=4)
    kv = state.kv
    rng = np.random.default_rng(3)
    table = np.asarray([[-1, -1, -1, -1], [5, -1, 2, -1]], np.int32)  # row 1 holds pages 5 and 2, a gap between
    kv = kv.replace(k=jax.numpy.asarray(rng.normal(size=kv.k.shape), kv.k.dtype), page_table=table,
                    valid=kv.valid.at[5].set(True).at[2, :3].set(True), order=kv.order.at[2].set(7),
                    page_class=kv.page_class.at[np.asarray([5, 2])].set(np.asarray([1, 3], np.int8)),
                    seq_slots=kv.seq_slots.at[1].set(2 * P + 3), next_order=kv.next_order.at[1].set(P + 3),
                    free_stack=jax.numpy.asarray([7, 6, 4, 3, 1, 0, 2, 5], np.int32), num_free=6)
    state = dataclasses.replace(state, kv=kv, next_pos=state.next_pos.at[1].set(40))
    snap = load_snapshot(save_snapshot(tmp_path / "bf16", export_row(state, 1)))
    assert snap.k.dtype == kv.k.dtype and np.array_equal(snap.entries, [0, 2])
    assert np.array_equal(snap.k.view(np.uint16), np.asarray(kv.k[:, np.asarray([5, 2])]).view(np.uint16))

    target = init_state(config, num_pages=8, page_size=P, batch=2, max_pages=4)
    out = import_row(target, 1, snap)
    assert np.asarray(target.kv.page_table).max() == -1 and int(target.kv.num_free) == 8  # the input is kept
    new = np.asarray(out.kv.page_table[1])
    assert new.tolist() == [0, -1, 1, -1] and int(out.kv.num_free) == 6  # popped off the stack top, table order
    assert np.array_equal(np.asarray(out.kv.k[:, new[[0, 2]]]).view(np.uint16), snap.k.view(np.uint16))
    assert np.asarray(out.kv.page_class)[[0, 1]].tolist() == [1, 3] and int(out.kv.seq_slots[1]) == 2 * P + 3
    assert int(out.next_pos[1]) == 40 and np.array_equal(np.asarray(out.kv.order[1]), np.full(P, 7))
    assert np.array_equal(np.asarray(out.kv.valid)[[0, 1]], np.asarray(kv.valid)[[5, 2]])
    assert np.asarray(out.kv.page_table[0]).max() == -1 and int(out.next_pos[0]) == 0  # other rows untouched


def test_counters_out_of_range_are_refused(tmp_path):
    """A damaged or altered snapshot whose counters would overflow the session's int32 counting (or disagree with
    the pages it holds) is refused by name by `check`, which `load_snapshot` and `import_row` run first."""
    from tests.serve.realtime.test_snapshot_store import snap

    good = snap(pages=2)
    good.check()
    i32 = np.int32
    cases = {"next_pos 2147483647": dict(next_pos=np.asarray(2 ** 31 - 1, i32)),
             "next_order -5": dict(next_order=np.asarray(-5, i32)),
             "dropped 1073741825": dict(dropped=np.asarray(snapshot_lib.COUNTER_LIMIT + 1, i32)),
             "unit of the held tokens in [0, 2000000000]": dict(unit=np.asarray([[0, 0], [0, 2_000_000_000]], i32)),
             "its seq_slots 2 holds only 1 entries": dict(seq_slots=np.asarray(2, i32))}
    for named, change in cases.items():
        with pytest.raises(snapshot_lib.SnapshotError, match=re.escape(named)):
            dataclasses.replace(good, **change).check()
    path = save_snapshot(tmp_path / "ok", good)
    assert int(load_snapshot(path).next_pos) == 4


def test_export_compiles_one_program_per_padded_length():
    """`export_row` reads a row's pages with one program per power-of-two page count (as `import_row` writes them),
    not a gather per field and per session length: rows of 3 and 4 pages share one program and one of 5 adds one;
    each snapshot holds exactly its row's pages (the pool's own arrays at the table's page ids)."""
    state = init_state(TINY_OMNI, num_pages=NUM_PAGES, page_size=P, batch=3, max_pages=8)
    kv, rng = state.kv, np.random.default_rng(5)
    table = np.full((3, 8), -1, np.int32)
    table[0, :3], table[1, [0, 2, 3, 6]], table[2, :5] = [9, 4, 1], [2, 7, 11, 0], [3, 5, 6, 8, 10]
    used = table[table >= 0]
    kv = kv.replace(k=jax.numpy.asarray(rng.normal(size=kv.k.shape), kv.k.dtype), page_table=table,
                    valid=kv.valid.at[used].set(True), seq_slots=kv.seq_slots.at[:].set([3 * P, 7 * P, 5 * P]),
                    next_order=kv.next_order.at[:].set([3 * P, 7 * P, 5 * P]),
                    free_stack=jax.numpy.asarray([*sorted(set(range(NUM_PAGES)) - set(used.tolist()), reverse=True),
                                                  *used.tolist()], np.int32), num_free=NUM_PAGES - len(used))
    state = dataclasses.replace(state, kv=kv)
    programs = snapshot_lib._read._cache_size()
    three, four = export_row(state, 0), export_row(state, 1)
    assert snapshot_lib._read._cache_size() <= programs + 1  # 3 and 4 pages: one program (4 rows read)
    five = export_row(state, 2)
    assert snapshot_lib._read._cache_size() <= programs + 2
    for snap, row in ((three, 0), (four, 1), (five, 2)):
        entries = np.flatnonzero(table[row] >= 0)
        assert np.array_equal(snap.entries, entries) and snap.num_pages == len(entries)
        assert np.array_equal(snap.k, np.asarray(kv.k)[:, table[row, entries]])
        assert np.array_equal(snap.valid, np.asarray(kv.valid)[table[row, entries]])
