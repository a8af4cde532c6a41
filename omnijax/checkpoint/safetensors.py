"""Validated, tensor-by-tensor reading of Hugging Face safetensors checkpoints.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON describing every tensor (`dtype`,
`shape`, `data_offsets` relative to the end of the header) and an optional `__metadata__` string map, then the raw
little-endian tensor bytes, packed without gaps. This module parses and validates the header itself so that a
truncated or corrupt file fails with a `CheckpointError` naming the file (and the tensor, where one is to blame)
before any tensor is used, and reads one tensor at a time, through a memory map of just that tensor's bytes or into a
reused buffer (`ReadBuffer`): a checkpoint is never loaded whole.

A checkpoint directory holds either one `model.safetensors` or the shards listed by `model.safetensors.index.json`
(`{"weight_map": {tensor name: shard file name}}`). When both exist the single file is used, as transformers does.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import struct
import weakref
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from omnijax.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit the reference safetensors implementation enforces

# safetensors dtype code -> numpy dtype (explicitly little-endian where numpy has a byte order).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives.

    Attributes:
        name: tensor name in the checkpoint.
        dtype: safetensors dtype code (a key of `DTYPES`).
        shape: tensor shape.
        path: the file holding it.
        offset: absolute byte offset of its first byte in `path`.
        nbytes: its size in bytes (= prod(shape) * itemsize).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    offset: int
    nbytes: int

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


def _no_duplicate_keys(path: Path):
    def hook(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise CheckpointError(f"header repeats the key {key!r}", path=path)
            seen[key] = value
        return seen
    return hook


def _check_entry(path: Path, name: str, entry) -> tuple[str, tuple[int, ...], int, int]:
    """Validates one header entry; returns (dtype, shape, begin, end) with offsets relative to the data section."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise CheckpointError("header entry needs 'dtype', 'shape' and 'data_offsets'", path=path, tensor=name)
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        raise CheckpointError(f"unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})", path=path,
                              tensor=name)

    def is_count(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not isinstance(shape, list) or not all(is_count(s) for s in shape):
        raise CheckpointError(f"shape {shape!r} is not a list of non-negative integers", path=path, tensor=name)
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(is_count(o) for o in offsets)
            or offsets[0] > offsets[1]):
        raise CheckpointError(f"data_offsets {offsets!r} is not a [begin, end] pair with begin <= end", path=path,
                              tensor=name)
    begin, end = offsets
    needed = math.prod(shape) * DTYPES[dtype].itemsize
    if end - begin != needed:
        raise CheckpointError(
            f"data_offsets {offsets} cover {end - begin} bytes but {dtype} x {tuple(shape)} needs {needed}",
            path=path, tensor=name)
    return dtype, tuple(shape), begin, end


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parses and validates a safetensors file's header without reading any tensor data.

    Checks: the 8-byte length fits the file, the header is a JSON object without duplicate names, every entry has a
    known dtype, a valid shape and offsets whose span equals dtype x shape, tensors are packed back to back from the
    start of the data section, and the file ends exactly at the end of the last tensor.

    Args:
        path: the `.safetensors` file.

    Returns:
        `(tensors, metadata)`: name -> `TensorInfo` in on-disk order, and the `__metadata__` map (may be empty).

    Raises:
        CheckpointError: the file is missing, truncated or corrupt (naming the file and, where known, the tensor).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"file is {size} bytes, too short for the 8-byte header length (truncated?)",
                                      path=path)
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(
                    f"header length {n} does not fit a {size}-byte file (truncated, or not a safetensors file)",
                    path=path)
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror or e}", path=path) from e
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"header is not valid UTF-8 JSON ({e}); corrupt or not a safetensors file",
                              path=path) from e
    if not isinstance(header, dict):
        raise CheckpointError("header is not a JSON object", path=path)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError("__metadata__ is not a JSON object", path=path)

    data_start, data_size = 8 + n, size - 8 - n
    entries = sorted(((name, *_check_entry(path, name, e)) for name, e in header.items()), key=lambda t: t[3:5])
    tensors: dict[str, TensorInfo] = {}
    cursor = 0
    for name, dtype, shape, begin, end in entries:
        if begin != cursor:
            what = "overlaps the previous tensor" if begin < cursor else f"leaves a gap of {begin - cursor} bytes"
            raise CheckpointError(f"data_offsets [{begin}, {end}] {what}", path=path, tensor=name)
        if end > data_size:
            raise CheckpointError(
                f"tensor data ends at byte {data_start + end} but the file has only {size} bytes (truncated)",
                path=path, tensor=name)
        tensors[name] = TensorInfo(name, dtype, shape, path, data_start + begin, end - begin)
        cursor = end
    if cursor != data_size:
        raise CheckpointError(f"{data_size - cursor} unexpected bytes after the last tensor", path=path)
    return tensors, metadata


def read_tensor(info: TensorInfo) -> np.ndarray:
    """Reads one tensor through a read-only memory map of exactly its bytes.

    The returned array is backed by the file (pages are read on access); copy or cast it to own the data.
    """
    dtype = info.np_dtype
    count = info.nbytes // dtype.itemsize
    if count == 0:
        return np.zeros(info.shape, dtype)
    try:
        flat = np.memmap(info.path, dtype=dtype, mode="r", offset=info.offset, shape=(count,))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot map tensor bytes: {e}", path=info.path, tensor=info.name) from e
    return flat.reshape(info.shape)


class ReadBuffer:
    """One reusable host buffer that tensors are read into with `pread` (`read_tensor_into`), for a caller that
    copies each tensor elsewhere (transposed, cast) before reading the next.

    Why not the memory map `read_tensor` gives: transposing a weight straight out of mapped file pages walks its
    columns across hundreds of 4 KiB pages per row (TLB misses, and a page fault on each first touch); read into
    this buffer, an anonymous mapping that asks for transparent huge pages, the same transposes of SmolLM2-135M's
    linear weights took 0.28 CPU s against 0.34-0.40 s (median of 5 each, interleaved). The buffer grows to the
    largest tensor read into it and is reused; it is only as large as that tensor.
    """

    def __init__(self):
        self._map: mmap.mmap | None = None

    def array(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A C-ordered array of `shape` and `dtype` on the buffer (its contents undefined; valid until the next
        call, which may reuse or replace the memory)."""
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        if nbytes == 0:
            return np.empty(shape, dtype)
        if self._map is None or len(self._map) < nbytes:
            self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux: huge pages where the system allows them
                self._map.madvise(mmap.MADV_HUGEPAGE)
        return np.frombuffer(self._map, dtype=dtype, count=math.prod(shape)).reshape(shape)


def read_tensor_into(info: TensorInfo, out: np.ndarray, fd: int | None = None) -> np.ndarray:
    """Reads one tensor's bytes into `out` (C-contiguous, of the tensor's shape and dtype, e.g. from
    `ReadBuffer.array`) with `pread`; returns `out`.

    Args:
        info: the tensor.
        out: where its bytes go.
        fd: an open read-only descriptor of `info.path` (opened and closed here when None).

    Raises:
        ValueError: `out` is not a writeable C-contiguous array of the tensor's shape and dtype.
        CheckpointError: the file cannot be read or ends before the tensor does.
    """
    if out.shape != info.shape or out.dtype != info.np_dtype or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"{info.name}: reading into a {out.dtype} array of shape {out.shape} (C-contiguous "
                         f"{out.flags.c_contiguous}, writeable {out.flags.writeable}); the tensor needs a writeable "
                         f"C-contiguous {info.np_dtype} array of shape {info.shape}")
    if info.nbytes == 0:
        return out
    view = memoryview(out.reshape(-1).view(np.uint8))
    try:
        own = fd is None
        fd = os.open(info.path, os.O_RDONLY) if fd is None else fd
        try:
            done = 0
            while done < info.nbytes:  # one call reads at most ~2 GiB on Linux
                n = os.preadv(fd, [view[done:]], info.offset + done)
                if n == 0:
                    raise CheckpointError(f"file ends {info.nbytes - done} bytes before the tensor's end (truncated "
                                          "since its header was read?)", path=info.path, tensor=info.name)
                done += n
        finally:
            if own:
                os.close(fd)
    except OSError as e:
        raise CheckpointError(f"cannot read tensor bytes: {e.strerror or e}", path=info.path, tensor=info.name) from e
    return out


def _read_index(index_path: Path) -> dict[str, str]:
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read shard index: {e}", path=index_path) from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError("shard index has no 'weight_map' object of tensor name -> file name", path=index_path)
    for name, shard in weight_map.items():
        if Path(shard).name != shard or shard in ("", ".", ".."):
            raise CheckpointError(f"shard file name {shard!r} is not a plain file name", path=index_path,
                                  tensor=name)
    return weight_map


def _close_all(fds: dict[Path, int]) -> None:
    while fds:
        os.close(fds.popitem()[1])


class SafetensorsCheckpoint:
    """A Hugging Face safetensors checkpoint directory (single file or sharded), validated on construction.

    Attributes:
        directory: the checkpoint directory.
        files: the safetensors files, in the order tensors are iterated.
        index_path: the shard index, or None for a single file.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._fds: dict[Path, int] = {}  # file -> descriptor `read_into` keeps open
        weakref.finalize(self, _close_all, self._fds)
        single, index = self.directory / SINGLE_FILE, self.directory / INDEX_FILE
        self._tensors: dict[str, TensorInfo] = {}
        if single.is_file():
            self.index_path = None
            self.files = (single,)
            self._tensors, _ = read_header(single)
            return
        if not index.is_file():
            raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} found", path=self.directory)
        self.index_path = index
        weight_map = _read_index(index)
        self.files = tuple(self.directory / s for s in sorted(set(weight_map.values())))
        for shard_path in self.files:
            if not shard_path.is_file():
                first = next(n for n, s in weight_map.items() if s == shard_path.name)
                raise CheckpointError(f"the shard index {index} lists shard file {shard_path.name!r} "
                                      f"(e.g. for tensor {first!r}) but it does not exist", path=shard_path)
            tensors, _ = read_header(shard_path)
            for name, info in tensors.items():
                if weight_map.get(name) != shard_path.name:
                    raise CheckpointError(
                        f"tensor is in this shard but the index {index.name} maps it to {weight_map.get(name)!r}",
                        path=shard_path, tensor=name)
                self._tensors[name] = info
        for name, shard in weight_map.items():
            if name not in self._tensors:
                raise CheckpointError(f"the index {index.name} maps this tensor to {shard!r} but that shard's "
                                      "header does not contain it", path=self.directory / shard, tensor=name)

    def names(self) -> list[str]:
        """Tensor names, file by file in on-disk order (sequential reads)."""
        return list(self._tensors)

    def info(self, name: str) -> TensorInfo:
        return self._tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def read(self, name: str) -> np.ndarray:
        """One tensor, memory-mapped (see `read_tensor`)."""
        return read_tensor(self._tensors[name])

    def read_into(self, name: str, out: np.ndarray) -> np.ndarray:
        """One tensor read into `out` (see `read_tensor_into`), through a descriptor of its file kept open until
        the checkpoint is collected or `close`d (opening the file per tensor cost more than reading a small one)."""
        info = self._tensors[name]
        fd = self._fds.get(info.path)
        if fd is None:
            try:
                fd = self._fds[info.path] = os.open(info.path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(f"cannot open: {e.strerror or e}", path=info.path, tensor=name) from e
        return read_tensor_into(info, out, fd)

    def close(self) -> None:
        """Closes the descriptors `read_into` opened (a later `read_into` opens them again)."""
        _close_all(self._fds)

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yields `(name, array)` one tensor at a time."""
        for name in self._tensors:
            yield name, self.read(name)
