"""How a conversion reads its source and hands blocks to the writer threads (`omnijax.checkpoint.safetensors`'s
`read_into` / `ReadBuffer`, `omnijax.checkpoint.staged`): tensors read into a reused buffer equal the `safetensors`
package's own reading; a small per-layer array is gathered into one chunk file that orbax restores bit for bit; a
writeable source changed right after it was handed over does not change what is written."""

from __future__ import annotations

import threading

import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors.numpy
import safetensors.torch
import torch

from omnijax.checkpoint import staged
from omnijax.checkpoint.format import _save_tree
from omnijax.checkpoint.safetensors import ReadBuffer, SafetensorsCheckpoint
from omnijax.errors import CheckpointError

pytestmark = pytest.mark.fast


def test_read_into_a_reused_buffer_equals_the_safetensors_reader(tmp_path):
    tensors = {"w": torch.randn(48, 20), "b": torch.randn(48), "h": torch.randn(3, 4).bfloat16(),
               "big": torch.randn(300, 64), "i": torch.arange(6, dtype=torch.int32), "empty": torch.zeros(0, 4)}
    safetensors.torch.save_file(tensors, tmp_path / "model.safetensors")
    want = safetensors.numpy.load_file(tmp_path / "model.safetensors") | {
        "h": tensors["h"].view(torch.int16).numpy()}  # numpy has no bfloat16: compare its bits
    ckpt, buffer = SafetensorsCheckpoint(tmp_path), ReadBuffer()
    for _ in range(2):  # the buffer grows, shrinks its view and is overwritten tensor after tensor
        for name in ckpt.names():
            info = ckpt.info(name)
            got = ckpt.read_into(name, buffer.array(info.shape, info.np_dtype))
            bits = got.view(np.int16) if name == "h" else got
            assert got.shape == want[name].shape and np.array_equal(bits, want[name]), name
    ckpt.close()
    info = ckpt.info("w")
    with pytest.raises(ValueError, match=r"'?w'?: reading into a float32 array of shape \(20, 48\)"):
        ckpt.read_into("w", np.empty((20, 48), np.float32))
    with pytest.raises(ValueError, match="C-contiguous False"):
        ckpt.read_into("w", np.empty((20, 48), np.float32).T)
    # a file cut short after its header was read: the tensor's read fails naming the file and the tensor
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:ckpt.info("big").offset + 100])
    fresh = SafetensorsCheckpoint.__new__(SafetensorsCheckpoint)
    fresh.__dict__.update(ckpt.__dict__, _fds={})
    with pytest.raises(CheckpointError, match="file ends .* bytes before the tensor's end") as error:
        fresh.read_into("big", buffer.array(fresh.info("big").shape, np.float32))
    assert "'big'" in str(error.value) and str(path) in str(error.value)
    assert info.nbytes == 48 * 20 * 4


def _restore(path, like):
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(path.resolve(), like)


def test_a_small_layered_array_is_one_chunk_file_orbax_restores(tmp_path):
    rng = np.random.default_rng(0)
    norms, gates = rng.standard_normal((5, 64)), rng.standard_normal((5, 64, 1000)).astype(np.float32)  # 1.3 MB
    context, writes = staged.ts.Context({"file_io_sync": False}), staged._Writes()
    small = staged.StagedArray(tmp_path / "stage" / "norm", norms.shape, np.float32, 1, context, writes)
    large = staged.StagedArray(tmp_path / "stage" / "gate", gates.shape, np.float32, 1, context, writes)
    for layer in (3, 0, 4, 1, 2):  # any order, as a checkpoint lists its layers (1, 10, 11, ..., 2)
        small[(layer,)] = norms[layer]  # float64 cast to float32 as astype casts
        large[(layer,)] = gates[layer]
    _save_tree(tmp_path / "out", {"norm": small, "gate": large})
    assert sorted(p.name for p in (tmp_path / "out" / "norm").iterdir()) == [".zarray", "0.0"]
    assert len(list((tmp_path / "out" / "gate").glob("*.0.0"))) == 5  # one chunk per layer
    got = _restore(tmp_path / "out", {"norm": norms.astype(np.float32), "gate": gates})
    np.testing.assert_array_equal(np.asarray(got["norm"]), norms.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(got["gate"]), gates)


def test_a_partly_written_small_array_is_refused(tmp_path):
    context = staged.ts.Context({"file_io_sync": False})
    array = staged.StagedArray(tmp_path / "n", (3, 8), np.float32, 1, context, staged._Writes())
    array[(0,)] = np.ones(8, np.float32)
    array[(0,)] = np.ones(8, np.float32)  # a row written twice counts once
    array[(2,)] = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="'n' not completely written"):
        _save_tree(tmp_path / "out", {"n": array})


def test_a_writeable_source_changed_after_the_call_is_written_as_it_was(tmp_path, monkeypatch):
    monkeypatch.setattr(staged, "GATHERED_BYTES", 0)  # the block path, not a gathered copy
    release, write = threading.Event(), staged._write_file

    def held_write(*args):
        assert release.wait(30)  # the write happens after the caller has changed its array
        write(*args)

    monkeypatch.setattr(staged, "_write_file", held_write)
    value = np.arange(12, dtype=np.float32).reshape(4, 3)
    array = staged.StagedArray(tmp_path / "stage" / "a", (2, 4, 3), np.float32, 1,
                               staged.ts.Context({"file_io_sync": False}), staged._Writes())
    array[(0,)] = value  # C-ordered and float32 already: a view of it would be written without a copy
    array[(1,)] = value
    value[...] = -1
    release.set()
    _save_tree(tmp_path / "out", {"a": array})
    got = _restore(tmp_path / "out", {"a": np.zeros((2, 4, 3), np.float32)})["a"]
    np.testing.assert_array_equal(np.asarray(got), np.stack([np.arange(12, dtype=np.float32).reshape(4, 3)] * 2))
