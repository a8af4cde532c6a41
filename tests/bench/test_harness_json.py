"""bench.harness.write_json replaces a results table whole or not at all (the resumable tables read it back)."""

from __future__ import annotations

import json
import os

import pytest

from bench import harness


def test_write_json_replaces_the_file_whole(tmp_path):
    harness.write_json(tmp_path, "rows", [{"a": 1}])
    harness.write_json(tmp_path, "rows", [{"a": 1}, {"a": 2}])
    assert json.loads((tmp_path / "rows.json").read_text()) == [{"a": 1}, {"a": 2}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.json"]
    assert (tmp_path / "rows.json").stat().st_mode & 0o777 == 0o644


def test_a_write_that_fails_leaves_the_previous_table_and_no_temporary_file(tmp_path, monkeypatch):
    harness.write_json(tmp_path, "rows", [{"a": 1}])

    def killed(src, dst):
        raise KeyboardInterrupt  # as a run stopped between the write and the rename

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        harness.write_json(tmp_path, "rows", [{"a": 1}, {"a": 2}])
    assert json.loads((tmp_path / "rows.json").read_text()) == [{"a": 1}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.json"]
    with pytest.raises(TypeError):  # not serialisable: refused before anything is written
        harness.write_json(tmp_path, "rows", [object()])
    assert json.loads((tmp_path / "rows.json").read_text()) == [{"a": 1}]
