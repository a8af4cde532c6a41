"""Parameter trees are written in orbax's PyTree layout without orbax (`omnijax.checkpoint.staged`): the chunk files
straight from the arrays, orbax's metadata files beside them. The oracle is orbax itself: its `StandardCheckpointer`
restores what was written bit for bit, and its own save of the same tree writes the same tree metadata."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

from omnijax.checkpoint import staged
from omnijax.checkpoint.format import _save_tree

pytestmark = pytest.mark.fast  # the quick tier (`make test-fast`): the staged checkpoint write


def tree():
    rng = np.random.default_rng(0)
    return {
        "embed": rng.standard_normal((300, 64)).astype(np.float32),
        "layers": {
            "q_proj": rng.standard_normal((3, 64, 40)).astype(ml_dtypes.bfloat16),
            "codes": rng.integers(-128, 127, (3, 5, 7), dtype=np.int8),
            "norm": rng.standard_normal((3, 64)).astype(np.float32),
        },
        "scale": np.array(0.5, np.float32),
        # more rows than one storage chunk holds, and not a multiple of it: an edge chunk stored at its full size
        "big": rng.standard_normal((2 * staged.SAVE_CHUNK_BYTES // (4 * 1000) + 7, 1000)).astype(np.float32),
    }


def restore(path, like):
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(path.resolve(), like)


def test_orbax_restores_what_is_written_and_writes_the_same_metadata(tmp_path):
    want = tree()
    _save_tree(tmp_path / "ours", want)
    # orbax's own save of the tree in the same layout (what omnijax called before)
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_compression=False)
    with ocp.Checkpointer(handler) as checkpointer:
        checkpointer.save((tmp_path / "orbax").resolve(), args=ocp.args.PyTreeSave(want))
    got = restore(tmp_path / "ours", want)
    for name, leaf in staged.leaves(want):
        restored = got
        for k in name.split("."):
            restored = restored[k]
        assert restored.dtype == leaf.dtype and restored.shape == leaf.shape, name
        np.testing.assert_array_equal(np.asarray(restored).reshape(-1).view(np.uint8),
                                      leaf.reshape(-1).view(np.uint8), err_msg=name)
    ours = json.loads((tmp_path / "ours" / "_METADATA").read_text())
    theirs = json.loads((tmp_path / "orbax" / "_METADATA").read_text())
    assert ours == theirs
    for name, _ in staged.leaves(want):  # the same zarr metadata but for the chunk shapes, which orbax picks
        zarrays = [json.loads((tmp_path / side / name / ".zarray").read_text()) for side in ("ours", "orbax")]
        assert [dict(z, chunks=None) for z in zarrays][0] == dict(zarrays[1], chunks=None), name
    checkpoint_metadata = json.loads((tmp_path / "ours" / "_CHECKPOINT_METADATA").read_text())
    assert checkpoint_metadata["item_handlers"] == json.loads(
        (tmp_path / "orbax" / "_CHECKPOINT_METADATA").read_text())["item_handlers"]
    # the big leaf is split into storage chunks of at most SAVE_CHUNK_BYTES, the last one a full-size edge chunk
    zarray = json.loads((tmp_path / "ours" / "big" / ".zarray").read_text())
    rows = zarray["chunks"][0]
    assert rows * 1000 * 4 <= staged.SAVE_CHUNK_BYTES and want["big"].shape[0] % rows
    files = sorted((tmp_path / "ours" / "big").glob("*.0"), key=lambda f: int(f.name.split(".")[0]))
    assert len(files) == -(-want["big"].shape[0] // rows)
    assert all(f.stat().st_size == rows * 1000 * 4 for f in files)


def test_staged_writes_refuse_what_is_not_a_whole_leading_row(tmp_path):
    context = staged.ts.Context({"file_io_sync": False})
    array = staged.StagedArray(tmp_path / "a", (2, 4, 3), np.float32, 1, context, staged.ChunkWrites())
    with pytest.raises(ValueError, match=r"one index of each of the 1 leading axes of shape \(2,\), not \[\]"):
        array[()] = np.zeros((2, 4, 3), np.float32)
    with pytest.raises(ValueError, match=r"not \[2\]"):
        array[(2,)] = np.zeros((4, 3), np.float32)
    with pytest.raises(ValueError, match=r"a value of shape \(4, 2\) for a region of shape \(4, 3\)"):
        array[(0,)] = np.zeros((4, 2), np.float32)
    array[(0,)] = np.ones((4, 3), np.float32)
    with pytest.raises(ValueError, match="'a' not completely written"):
        _save_tree(tmp_path / "out", {"a": array})
