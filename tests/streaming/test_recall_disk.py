"""The on-disk spill tier (issue 40): with a tiny host budget and a disk tier, recall restores the same units and
logits as with a big host budget (the spilled keys and values read back bit for bit); the disk budget drops the
oldest spilled units and reports them; a snapshot with spilled units resumes exactly; kept units' files go; a
directory that cannot be written is refused by name."""

import os

import numpy as np
import pytest

from omnijax.kv import host_tier_disk
from omnijax.retention import SinkWindow, StreamingLLM
from omnijax.retention.recall import Recall
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.session import Session
from tests._support import recall_setup
from tests._support.recall_setup import PAGE, PAGES, TAU


@pytest.fixture(scope="module")
def model():
    return recall_setup.decoder()


def _context():
    return recall_setup.context(0)


def _question(seed=100):
    return recall_setup.question(seed, unit=100 + seed)


def _session(model, recall, policy=None):
    return Session(model, StreamConfig(policy=policy or SinkWindow(sink=2, window=12), num_pages=PAGES,
                                       page_size=PAGE, max_answer_tokens=TAU, recall=recall))


def _fed(session, chunks):
    return [session.feed(c) for c in chunks]


def _files(directory):
    return sorted(f for _, _, names in os.walk(directory) for f in names if f.endswith(".npy"))


def test_spilled_units_are_recalled_exactly_as_from_memory(model, tmp_path):
    big = _session(model, Recall(budget=64, top_units=8))
    _fed(big, _context())
    units = big._recall.tier.units
    host_part = sum(u.nbytes - u.k.nbytes - u.v.nbytes for u in units)  # summaries and metadata stay in memory
    tiny = Recall(budget=64, top_units=8, host_bytes=units[-1].nbytes + host_part,
                  disk_dir=str(tmp_path), disk_bytes=1 << 24)
    small = _session(model, tiny)
    _fed(small, _context())
    stats = small.recall_stats()
    assert stats.dropped_units == 0 and stats.disk_units >= 2 and stats.spilled_units == stats.disk_units
    assert stats.stored_units == len(units) and stats.stored_bytes <= tiny.host_bytes
    assert stats.disk_bytes == sum(u.k.nbytes + u.v.nbytes for u in small._recall.tier.units if u.on_disk) > 0
    assert len(_files(tmp_path)) == 2 * stats.disk_units
    for a, b in zip(units, small._recall.tier.units):  # the same records, the spilled ones read from their files
        assert a.unit == b.unit and not a.on_disk
        np.testing.assert_array_equal(np.asarray(b.k), a.k)
        np.testing.assert_array_equal(np.asarray(b.v), a.v)
    assert small._recall.tier.units[0].on_disk and not small._recall.tier.units[-1].on_disk
    want, got = big.feed(_question()), small.feed(_question())
    assert big._recall.last.units == small._recall.last.units and big._recall.last.cells > 0
    np.testing.assert_array_equal(big._recall.last.scores, small._recall.last.scores)
    np.testing.assert_array_equal(np.asarray(got.logits), np.asarray(want.logits))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))


def test_disk_budget_drops_the_oldest_spilled_units_and_reports_them(model, tmp_path):
    probe = _session(model, Recall(budget=64))
    _fed(probe, _context())
    units = probe._recall.tier.units
    one = max(u.k.nbytes + u.v.nbytes for u in units)
    recall = Recall(budget=64, host_bytes=units[-1].nbytes + 256, disk_dir=str(tmp_path), disk_bytes=one)
    session = _session(model, recall)
    _fed(session, _context())
    stats = session.recall_stats()
    assert stats.dropped_units > 0 and stats.disk_units >= 1 and 0 < stats.disk_bytes <= one
    assert stats.captured_units == stats.stored_units + stats.dropped_units
    assert stats.captured_bytes == stats.stored_bytes + stats.disk_bytes + stats.dropped_bytes
    assert len(_files(tmp_path)) == 2 * stats.disk_units  # dropped units' files deleted
    kept = [u.unit for u in session._recall.tier.units]
    assert kept == [u.unit for u in units][-len(kept):]  # the newest, oldest first


@pytest.mark.parametrize("keep", [False, True])
def test_a_snapshot_with_spilled_units_resumes_exactly(model, tmp_path, keep):
    policy = StreamingLLM(sink_tokens=2, window=12, high_watermark=16)
    recall = Recall(budget=64, top_units=3, host_bytes=20000, disk_dir=str(tmp_path), disk_bytes=1 << 24, keep=keep)
    first = _session(model, recall, policy)
    _fed(first, _context())
    assert first.recall_stats().disk_units > 0
    snap = first.snapshot()
    later = [_question(100), _question(101)]
    want = _fed(first, later)
    resumed = Session.resume(model, snap, StreamConfig(policy=policy, num_pages=PAGES, page_size=PAGE,
                                                       max_answer_tokens=TAU, recall=recall))
    got = _fed(resumed, later)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(np.asarray(a.logits), np.asarray(b.logits))
    assert resumed.recall_stats() == first.recall_stats()
    if keep:  # recalled spilled units are content again: their files are gone
        on_disk = {f for u in first._recall.tier.units for f in host_tier_disk.spill_files(u)}
        assert on_disk <= set(os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs)


def test_bad_disk_settings_are_refused_by_name(model, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"Recall\(disk_dir='.*a_file/spill'\): the spill directory is not writable"):
        _session(model, Recall(budget=8, disk_dir=str(blocker / "spill"), disk_bytes=1 << 20))
    with pytest.raises(ValueError, match="disk_bytes must be a positive int with disk_dir and 0 without"):
        Recall(budget=8, disk_dir=str(tmp_path))
    with pytest.raises(ValueError, match="disk_bytes must be a positive int with disk_dir and 0 without"):
        Recall(budget=8, disk_bytes=1024)
    with pytest.raises(ValueError, match="disk_dir must be a directory path"):
        Recall(budget=8, disk_dir="", disk_bytes=1024)
