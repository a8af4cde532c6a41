"""The checkpoint layer's files on their own (the conversions that write them: tests/convert/test_convert.py): the
safetensors reader (every dtype, memory-mapped, empty tensors), its header checks, each naming the file and the
problem, and `save_params` refusing a model type or component it does not know before writing anything."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch

from omnijax.checkpoint import format as checkpoint
from omnijax.checkpoint.safetensors import SafetensorsCheckpoint, read_header
from omnijax.errors import CheckpointError
from omnijax.models.config import DecoderConfig


def test_safetensors_reader_dtypes_and_memmap(tmp_path):
    tensors = {"f16": torch.randn(3, 5).half(), "bf16": torch.randn(4, 2).bfloat16(), "f32": torch.randn(7),
               "i64": torch.arange(6).reshape(2, 3), "i8": torch.tensor([-3, 4], dtype=torch.int8),
               "u8": torch.tensor([1, 255], dtype=torch.uint8), "i32": torch.tensor(5, dtype=torch.int32),
               "empty": torch.zeros(0, 4)}
    safetensors.torch.save_file(tensors, tmp_path / "model.safetensors")
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert sorted(ckpt.names()) == sorted(tensors)
    for name, ref in tensors.items():
        got = ckpt.read(name)
        assert got.shape == tuple(ref.shape)
        if name == "bf16":
            assert got.dtype == ml_dtypes.bfloat16
            np.testing.assert_array_equal(got.view(np.uint16), ref.view(torch.int16).numpy().view(np.uint16))
        else:
            np.testing.assert_array_equal(got, ref.numpy())
        assert isinstance(got, np.memmap) or got.size == 0


def _raw_file(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("header, data, needle", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "needs 8"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}}, b"\0" * 6, "overlaps"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "gap of 4 bytes"),
    ({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8, "unsupported dtype 'C64'"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "non-negative"),
])
def test_header_validation(tmp_path, header, data, needle):
    path = tmp_path / "x.safetensors"
    _raw_file(path, header, data)
    with pytest.raises(CheckpointError) as info:
        read_header(path)
    assert needle in str(info.value) and str(path) in str(info.value)


def test_save_params_refuses_unknown_model_types_and_components(tmp_path):
    config = DecoderConfig(vocab_size=8, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                           num_kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match="model type 'gemma'"):
        checkpoint.save_params(tmp_path / "a", "gemma", config, {})
    with pytest.raises(ValueError, match=r"components \['vision'\] are not part of a qwen2"):
        checkpoint.save_params(tmp_path / "b", "qwen2", config, {}, components={"vision": ({}, None)})
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # nothing written
