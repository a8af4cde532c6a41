"""A native `/session` snapshot's counters and settings are checked by name before a resume opens anything
(`omnijax.serve.native.resume.restored_counters`): what `native_meta` writes comes back, and another frame budget,
another model, a Realtime session's snapshot or a damaged counter is refused (`ResumeRefused`) naming it. No model."""

import dataclasses
import json
import re

import pytest

from omnijax.serve.engine.snapshot import COUNTER_LIMIT, SessionSnapshot
from omnijax.serve.native.resume import KEY, native_meta, restored_counters
from omnijax.serve.realtime.resume import ResumeRefused
from tests.serve.realtime.test_snapshot_store import snap


def _with(meta) -> SessionSnapshot:
    return dataclasses.replace(snap(), meta=json.loads(json.dumps(meta)))  # through JSON, as on disk


def test_what_a_native_session_writes_comes_back():
    assert restored_counters(_with(native_meta(7, 12, 200, "omnijax")), 200.0, "omnijax") == (7, 12)
    assert restored_counters(_with(native_meta(0, 0, 500.0, "m")), 500, "m") == (0, 0)


@pytest.mark.parametrize("meta, named", [
    (native_meta(7, 12, 500, "omnijax"), "frames of 500.0 ms; this server's are 200 ms (--frame-ms)"),
    (native_meta(7, 12, 200, "other"), "of model 'other'; this server serves 'omnijax'"),
    ({"conversation": {}, "model": "omnijax"}, "not a native session's"),
    ({}, "not a native session's"),
    ({KEY: {"seq": -1, "unit": 0, "frame_ms": 200.0, "model": "omnijax"}}, "native 'seq' is not a counter"),
    ({KEY: {"seq": 1, "unit": COUNTER_LIMIT + 1, "frame_ms": 200.0, "model": "omnijax"}}, "native 'unit'"),
    ({KEY: {"seq": True, "unit": 0, "frame_ms": 200.0, "model": "omnijax"}}, "native 'seq'"),
    ({KEY: {"seq": 1.0, "unit": 0, "frame_ms": 200.0, "model": "omnijax"}}, "native 'seq'"),
    ({KEY: {"unit": 0, "frame_ms": 200.0, "model": "omnijax"}}, "native 'seq'"),
    ({KEY: "7"}, "not a native session's"),
])
def test_another_setting_or_a_damaged_counter_is_refused_by_name(meta, named):
    with pytest.raises(ResumeRefused, match=re.escape(named)):
        restored_counters(_with(meta), 200, "omnijax")
