"""How a conversion reads its source and hands blocks to the writer threads (`omnijax.checkpoint.safetensors`'s
`read_into` / `ReadBuffer`, `omnijax.checkpoint.staged`): tensors read into a reused buffer equal the `safetensors`
package's own reading; a small per-layer array is gathered into one chunk file that orbax restores bit for bit; a
writeable source changed right after it was handed over does not change what is written; the read buffers whose
blocks the writer threads transpose and cast are not reused before those blocks are written."""

from __future__ import annotations

import json
import sys
import threading
import time

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors.numpy
import safetensors.torch
import torch

from omnijax.checkpoint import loop, staged
from omnijax.checkpoint.format import _save_tree
from omnijax.checkpoint.safetensors import ReadBuffer, SafetensorsCheckpoint
from omnijax.convert import convert_checkpoint
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
    context, writes = staged.ts.Context({"file_io_sync": False}), staged.ChunkWrites()
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
    array = staged.StagedArray(tmp_path / "n", (3, 8), np.float32, 1, context, staged.ChunkWrites())
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
                               staged.ts.Context({"file_io_sync": False}), staged.ChunkWrites())
    array[(0,)] = value  # C-ordered and float32 already: a view of it would be written without a copy
    array[(1,)] = value
    value[...] = -1
    release.set()
    _save_tree(tmp_path / "out", {"a": array})
    got = _restore(tmp_path / "out", {"a": np.zeros((2, 4, 3), np.float32)})["a"]
    np.testing.assert_array_equal(np.asarray(got), np.stack([np.arange(12, dtype=np.float32).reshape(4, 3)] * 2))


def _llama_checkpoint(directory, rng, layers=3, hidden=64, inter=160, vocab=5000):
    """A random float32 Llama checkpoint written with numpy (tied embedding of 1.2 MB: copied file to file)."""
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                       p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (32, hidden),
                       p + "self_attn.v_proj.weight": (32, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                       p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter)})
    tensors = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    directory.mkdir()
    safetensors.numpy.save_file(tensors, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(dict(
        model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True)))
    return tensors


@pytest.mark.parametrize("buffers, alone", [(1, 32 << 20), (3, 32 << 20), (3, 1000)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_slow_writer_threads_write_every_tensor_as_read(tmp_path, monkeypatch, buffers, alone, dtype):
    """The writer threads transpose and cast blocks of the read buffers after the main thread has moved on: with
    every block's transpose delayed, a buffer reused before its blocks were written would store the next tensor's
    values. One buffer (each read waits for the previous tensor's writes), three (the default) and every tensor read
    alone (`_ALONE_BYTES` below their size) all store the source tensors, transposed and cast as numpy casts."""
    monkeypatch.setattr(loop, "_READ_BUFFERS", buffers)
    monkeypatch.setattr(loop, "_ALONE_BYTES", alone)
    write, copy = staged._write_block, staged._copy_bytes

    def slow_write(*args):
        time.sleep(0.003)  # before the block is transposed and cast from the buffer
        write(*args)

    copied = []

    def counted_copy(*args):
        copied.append(args[3].parent.name)
        copy(*args)

    monkeypatch.setattr(staged, "_write_block", slow_write)
    monkeypatch.setattr(staged, "_copy_bytes", counted_copy)
    monkeypatch.setattr(loop, "_SMALL_BYTES", 1000)  # the embedding (1.2 MB) is copied file to file in 1 chunk
    monkeypatch.setattr(staged, "GATHERED_BYTES", 0)  # every layer's tensor in blocks, none gathered in memory
    tensors = _llama_checkpoint(tmp_path / "src", np.random.default_rng(1))
    out = convert_checkpoint(tmp_path / "src", tmp_path / "out", dtype=dtype, progress=False, log=lambda line: None)
    # float32 into float32: the embedding's bytes are copied by the kernel; into bfloat16 they are cast
    assert copied == (["embed"] if sys.platform.startswith("linux") and dtype == "float32" else [])
    target = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    layers = [f"model.layers.{i}." for i in range(3)]
    want = {"embed": tensors["model.embed_tokens.weight"], "final_norm": tensors["model.norm.weight"],
            "layers": {"input_norm": np.stack([tensors[p + "input_layernorm.weight"] for p in layers]),
                       "post_norm": np.stack([tensors[p + "post_attention_layernorm.weight"] for p in layers]),
                       **{f"{n}_proj": np.stack([tensors[p + f"self_attn.{n}_proj.weight"].T for p in layers])
                          for n in "qkvo"},
                       **{f"{n}_proj": np.stack([tensors[p + f"mlp.{n}_proj.weight"].T for p in layers])
                          for n in ("gate", "up", "down")}}}
    want = jax.tree.map(lambda a: np.ascontiguousarray(a.astype(target)), want)
    got = _restore(out / "params", want)
    for (path, w), g in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), w.view(np.uint8),
                                      err_msg=jax.tree_util.keystr(path))


def test_a_failed_chunk_write_leaves_nothing_behind(tmp_path, monkeypatch):
    """A writer thread's failure reaches the caller as it was raised, after the blocks still in flight were dropped
    or finished: the conversion's temporary directory is removed and no file appears afterwards."""
    write, calls = staged._write_file, []

    def failing_write(path, chunk, size):
        calls.append(path)
        time.sleep(0.002)
        if len(calls) == 5:
            raise OSError(28, "No space left on device (injected)")
        write(path, chunk, size)

    monkeypatch.setattr(staged, "_write_file", failing_write)
    monkeypatch.setattr(staged, "GATHERED_BYTES", 0)
    _llama_checkpoint(tmp_path / "src", np.random.default_rng(2))
    with pytest.raises(OSError, match="injected"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", progress=False, log=lambda line: None)
    time.sleep(0.05)  # a write still running would show here
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
