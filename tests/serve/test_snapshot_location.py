"""Where `--snapshot-dir` may point, checked when the server starts (before the model loads, before any Ray cluster
starts with `--replicas`), without a model and without Ray:

- a directory this server cannot write to (another user's folder, a read-only mount) is refused naming the path and
  what to do, and nothing is created or changed in it; without the write probe it was accepted and every session's
  first snapshot failed later;
- a URL is never a local folder: an object-store URL (`gs://...`) that cannot be written is refused naming it (here:
  no network), one of an unknown scheme naming the scheme, and `save_snapshot` / `load_snapshot` (directories) refuse
  every URL; before, `Path("gs://b/x")` silently wrote into a local folder `gs:/b/x`. (What the store does with a URL
  it can write: tests/serve/realtime/test_snapshot_object_store.py.)

The unwritable directory is real: one this test's user cannot write (mode 0555). Root writes anywhere whatever the
mode, so as root the checks run with the effective uid of `nobody` (65534) for their duration.
"""

import contextlib
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

import numpy as np
import pytest

from omnijax.serve import app
from omnijax.serve.engine.snapshot import SessionSnapshot, SnapshotSpec, load_snapshot, save_snapshot
from omnijax.serve.realtime.snapshot_store import SnapshotStore

NOBODY = 65534


@contextlib.contextmanager
def unwritable_dir():
    """Yields a directory (mode 0555, under a 0755 parent) that the code run inside the block cannot create files
    in: this test's user when it is not root, else `nobody` (the effective uid is switched for the block)."""
    base = Path(tempfile.mkdtemp(prefix="omnijax-unwritable-"))
    try:
        os.chmod(base, 0o755)
        target = base / "sessions"
        target.mkdir()
        os.chmod(target, 0o555)
        as_root = os.geteuid() == 0
        if as_root:
            os.seteuid(NOBODY)
        try:
            with pytest.raises(PermissionError):  # the premise: nobody running this block may write there
                (target / "x").write_text("x")
            yield target
        finally:
            if as_root:
                os.seteuid(0)
    finally:
        os.chmod(base / "sessions", 0o755)
        shutil.rmtree(base)


def _snap() -> SessionSnapshot:
    spec = SnapshotSpec(page_size=2, num_layers=1, num_kv_heads=1, head_dim=2, position_axes=1, vocab_size=4,
                        dtype="float32")
    i32 = np.int32
    z = {name: np.zeros((1, 2), i32) for name in ("order", "unit", "span", "offset")}
    return SessionSnapshot(
        entries=np.arange(1, dtype=i32), k=np.ones((1, 1, 2, 1, 2), np.float32),
        v=np.zeros((1, 1, 2, 1, 2), np.float32), valid=np.ones((1, 2), bool), pos=np.zeros((1, 1, 2), i32), **z,
        score=np.zeros((1, 2), np.float32), page_class=np.zeros((1,), np.int8), seq_slots=np.asarray(2, i32),
        next_order=np.asarray(2, i32), exhausted=np.asarray(False), dropped=np.asarray(0, i32),
        next_pos=np.asarray(2, i32), key=np.zeros((2,), np.uint32), last_logits=np.zeros((4,), np.float32), spec=spec,
        meta={})


def test_a_snapshot_dir_the_server_cannot_write_is_refused_by_name_and_left_as_it_was():
    with unwritable_dir() as target:
        with pytest.raises(ValueError) as e:
            SnapshotStore(target)
        message = str(e.value)
        assert f"--snapshot-dir {target} is not writable by this server (Permission denied)" in message, message
        assert "give a directory this server's user can create files in" in message, message
        assert os.listdir(target) == []  # the probe left nothing
        assert stat.S_IMODE(target.stat().st_mode) == 0o555  # refused before the mode is tightened to 0700
    with unwritable_dir() as target:  # a writable subfolder of an unwritable one is fine; a missing one is not
        with pytest.raises(ValueError, match=f"--snapshot-dir {target / 'new'}: cannot use it .*Permission denied"):
            SnapshotStore(target / "new")


def test_the_command_line_refuses_it_before_the_model_loads_and_before_ray(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(app.compilation_cache, "enable", lambda: None)  # its cache directory is not the question
    missing = tmp_path / "no-checkpoint-here"  # loading it would fail naming it: the store must be refused first
    with unwritable_dir() as target:
        for extra in ([], ["--replicas", "2"]):
            with pytest.raises(SystemExit) as e:
                app.main([str(missing), "--port", "0", "--snapshot-dir", str(target), *extra])
            err = capsys.readouterr().err
            assert e.value.code == 2 and f"--snapshot-dir {target} is not writable by this server" in err, err
            assert "not an omnijax checkpoint" not in err and "Ray" not in err, err
    for url, named in (("gs://omnijax-no-such-bucket/sessions", "--snapshot-dir gs://omnijax-no-such-bucket/sessions/ "
                                                             "cannot be written by this server"),
                       ("http://host/sessions", "--snapshot-dir 'http://host/sessions' is a http:// URL, which is "
                                                "not a snapshot location"),
                       ("memory://sessions", "--snapshot-dir memory://sessions is this process's memory, which the "
                                             "replicas (other processes) cannot share")):
        with pytest.raises(SystemExit) as e:
            app.main([str(missing), "--port", "0", "--snapshot-dir", url, "--replicas", "2"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and named in err, err
        assert "not an omnijax checkpoint" not in err and "Ray cluster" not in err, err


@pytest.mark.parametrize("uri", ["gs://omnijax-no-such-bucket/sessions", "s3://omnijax-no-such-bucket/sessions",
                                 "ftp://host/sessions"])
def test_urls_are_never_written_as_local_folders(uri, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # Path(uri) is relative: a silent local write would land here
    scheme = uri.split("://")[0]
    with pytest.raises(ValueError) as e:
        SnapshotStore(uri, probe_timeout_s=20.0)  # unreachable here (gs, s3), or not a location (ftp)
    assert "cannot be written by this server" in str(e.value) or "is a ftp:// URL" in str(e.value), e.value
    with pytest.raises(ValueError, match=re.escape(f"the snapshot path {uri + '/one'!r} is a {scheme}:// URL")):
        save_snapshot(f"{uri}/one", _snap())
    with pytest.raises(ValueError, match=f"is a {scheme}:// URL"):
        load_snapshot(f"{uri}/one")
    assert os.listdir(tmp_path) == []  # no folder named after the scheme
    local = save_snapshot(tmp_path / "one", _snap())  # a plain path still works, relative or not
    assert local == tmp_path / "one" and float(load_snapshot("one").k.reshape(-1)[0]) == 1.0
