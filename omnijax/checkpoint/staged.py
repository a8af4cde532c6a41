"""Parameter arrays written straight into their storage while a conversion fills them, tensor by tensor.

A conversion assembles each stacked parameter (`[layers, ...]`) from many source tensors. Instead of filling a
staging copy of the whole tree and saving it afterwards (every byte written twice, and the staging pages resident
in the converting process: its peak was about the whole model), every source tensor is cast and written once, in
blocks of at most `SAVE_CHUNK_BYTES`, into an uncompressed zarr array (TensorStore) laid out as orbax writes one:
storage chunks never span two layers, so no chunk is read back to be completed. `commit` then moves the arrays
into place beside the orbax metadata of the same tree (`omnijax.checkpoint.format.save_params`).

Resident memory while converting: the source tensor being read plus a few blocks in flight, and the gathered small
arrays (at most `GATHERED_BYTES` each).
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

SAVE_CHUNK_BYTES = 8 * 1024 * 1024  # storage chunk size: bounds the memory one chunk write needs
IN_FLIGHT_BLOCKS = 2  # chunk files written while the next block is prepared
# An array with leading (layer) axes of at most this many bytes is gathered in memory and stored as one chunk file
# when its last row is written, instead of one file per layer: creating a file cost ~1 ms of CPU on the ext4
# filesystem conversions were measured on, and SmolLM2's 61 norm vectors (2.3 KB each) were 61 of its 285 files.
GATHERED_BYTES = 1 << 20
WRITE_THREADS = 2  # threads writing chunk files (each of the blocks in flight has one)


def chunk_shape(shape: tuple[int, ...], itemsize: int, leading: int) -> tuple[int, ...]:
    """Storage chunks of an array: one index of each of the `leading` (layer, expert) axes, then whole trailing
    axes, split along the first of them to stay within `SAVE_CHUNK_BYTES`; an array of at most `GATHERED_BYTES`
    with leading axes (the layers' norms, biases) is one chunk (`gathered`)."""
    if gathered(shape, itemsize, leading):
        return tuple(max(n, 1) for n in shape)
    chunk = [1] * leading + list(shape[leading:])
    if leading < len(shape):
        row = math.prod(shape[leading + 1:]) * itemsize
        chunk[leading] = max(1, min(shape[leading], SAVE_CHUNK_BYTES // max(row, 1)))
    return tuple(max(c, 1) for c in chunk)


def gathered(shape: tuple[int, ...], itemsize: int, leading: int) -> bool:
    """Whether an array is stored as one chunk gathered in memory from its writes (see `GATHERED_BYTES`)."""
    return leading > 0 and math.prod(shape) * itemsize <= GATHERED_BYTES


def _zarr_dtype(dtype: np.dtype) -> str:
    return "bfloat16" if dtype.name == "bfloat16" else dtype.str


class StagedArray:
    """One parameter array being written to `path` (a zarr directory), filled by `array[index] = value`.

    TensorStore writes the array's metadata (`.zarray`); the chunks are written here, each straight from the block
    that holds it (a cast and transposed copy, or a view of a read-only source, such as a memory-mapped file, when
    neither is needed: a writeable source is copied, as its owner may change or reuse it before the write) into
    its own file by one `write`: no further copy of the data (TensorStore's write copied every block before writing
    it, and cost a thread hand-off per chunk). A write covers whole storage chunks: one index of each leading axis,
    every trailing axis whole, so each chunk is written once, never read back to be completed. A small array with
    leading axes (`gathered`: a norm or bias per layer) is gathered in memory instead and written as one chunk once
    every row has been written.

    Attributes:
        path: the zarr directory.
        shape: the array's shape.
        dtype: its dtype; written values are cast to it as `astype` casts.
        leading: how many leading axes a write indexes with integers (layers, experts).
        written: bytes handed to the storage so far (`finish` waits for them), or for a gathered array, its bytes
            written so far (handed to the storage together once complete).
    """

    def __init__(self, path: Path, shape: tuple[int, ...], dtype: Any, leading: int, context: ts.Context,
                 writes: _Writes):
        self.path, self.shape, self.dtype, self.leading = Path(path), tuple(shape), np.dtype(dtype), leading
        self.ndim = len(self.shape)
        self._chunks = chunk_shape(self.shape, self.dtype.itemsize, leading)
        spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(self.path)},
                "metadata": {"shape": list(self.shape), "chunks": list(self._chunks),
                             "dtype": _zarr_dtype(self.dtype), "compressor": None, "fill_value": None,
                             "dimension_separator": ".", "order": "C", "filters": None}}
        ts.open(spec, create=True, context=context).result()  # writes `.zarray`; nothing else is kept
        self._writes = writes
        self.written = 0
        # a gathered array's rows until all are written (then its one chunk file), and the rows written so far
        self._gathered = np.empty(self.shape, self.dtype) if gathered(self.shape, self.dtype.itemsize, leading) \
            else None
        self._rows: set[tuple[int, ...]] = set()

    def __setitem__(self, index: tuple[int, ...], value: np.ndarray) -> None:
        index = tuple(int(i) for i in index)
        value = np.asarray(value)
        if len(index) != self.leading or any(not 0 <= i < n for i, n in zip(index, self.shape)):
            raise ValueError(f"{self.path.name}: a write takes one index of each of the {self.leading} leading axes "
                             f"of shape {self.shape[:self.leading]}, not {list(index)}")
        if tuple(value.shape) != self.shape[self.leading:]:
            raise ValueError(f"{self.path.name}{list(index)}: a value of shape {value.shape} for a region of "
                             f"shape {self.shape[self.leading:]}")
        if self._gathered is not None:
            self._gathered[index] = value  # cast as astype casts
            if index not in self._rows:
                self._rows.add(index)
                self.written += math.prod(value.shape) * self.dtype.itemsize
            if self.written == self._gathered.nbytes:  # complete (again, if a row is rewritten): its one chunk
                self._writes.add(self.path / ".".join("0" * self.ndim), self._gathered.copy(), 0)
            return
        prefix = "".join(f"{i}." for i in index)
        trailing_keys = ".0" * (self.ndim - self.leading - 1)
        if value.ndim == 0:  # one element per chunk: its key is the leading indices alone (a 0-d array's is "0")
            self._writes.add(self.path / (prefix[:-1] or "0"), np.array(value, self.dtype).reshape(1), 0)
            self.written += self.dtype.itemsize
            return
        rows = self._chunks[self.leading]  # rows of the first trailing axis per storage chunk
        chunk_bytes = math.prod(self._chunks) * self.dtype.itemsize
        per_row = max(1, math.prod(value.shape[1:]) * self.dtype.itemsize)
        step = max(1, SAVE_CHUNK_BYTES // per_row // rows) * rows
        for start in range(0, value.shape[0], step):
            block = np.ascontiguousarray(value[start:start + step], dtype=self.dtype)  # cast + layout, one block
            if value.flags.writeable and np.may_share_memory(block, value):
                block = block.copy()  # the caller may change or reuse a writeable array before the write is done
            for first in range(0, block.shape[0], rows):
                key = f"{prefix}{(start + first) // rows}{trailing_keys}"
                self._writes.add(self.path / key, block[first:first + rows], chunk_bytes)
            self.written += block.nbytes

    def finish(self) -> None:
        """Waits until every write handed to the storage so far is done (raising the first failure)."""
        self._writes.wait(0)


class _Writes:
    """The chunk files of one conversion being written by `WRITE_THREADS` threads while the next block is cast, with
    at most `IN_FLIGHT_BLOCKS` chunks waiting (each holds its block, which nothing else writes to).

    Two threads: writing a chunk file (the kernel copying it into the page cache, creating the file) cost as much CPU
    as casting and transposing its block, so with one thread the writes set the pace; each file is written whole
    by one thread, so the threads never touch the same file."""

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="omnijax-convert-write")
        self._pending: collections.deque = collections.deque()

    def add(self, path: Path, chunk: np.ndarray, size: int) -> None:
        """Writes `chunk` (C-contiguous) as the file `path`, extended with zeros to `size` bytes (zarr stores an
        edge chunk at its full size)."""
        self._pending.append(self._pool.submit(_write_file, path, chunk, size))
        self.wait(IN_FLIGHT_BLOCKS)

    def wait(self, keep: int) -> None:
        while len(self._pending) > keep:
            self._pending.popleft().result()


def _write_file(path: Path, chunk: np.ndarray, size: int) -> None:
    with open(path, "wb") as f:  # (buffered I/O writes a large buffer through, without a copy)
        f.write(memoryview(chunk.reshape(-1).view(np.uint8)))
        if size > chunk.nbytes:
            f.truncate(size)  # reads back as zeros


def staged_tree(directory: Path, shapes: dict, leading: dict[str, int], dtype: Any) -> dict:
    """A tree of `StagedArray`s under `directory`, one per leaf of `shapes` (nested dicts of shape tuples), each
    named by its dotted path; `leading[dotted]` is its number of indexed leading axes."""
    context = ts.Context({"file_io_sync": False})  # no fsync per chunk: the checkpoint is committed by rename
    writes = _Writes()

    def build(node: dict, prefix: str) -> dict:
        return {k: build(v, f"{prefix}{k}.") if isinstance(v, dict)
                else StagedArray(directory / f"{prefix}{k}", v, dtype, leading.get(f"{prefix}{k}", 0), context,
                                 writes)
                for k, v in node.items()}

    directory.mkdir(parents=True, exist_ok=True)
    return build(shapes, "")


def write_tree(path: Path, tree: dict) -> None:
    """Writes a pure-dict array tree as the directory `path` (which must not exist) in orbax's PyTree checkpoint
    layout, as orbax's `PyTreeCheckpointHandler` writes it without OCDBT (what `StandardCheckpointer` reads): one
    uncompressed zarr directory per leaf, named by its keys joined with dots, beside orbax's `_METADATA`,
    `_CHECKPOINT_METADATA` and `commit_success.txt`.

    A `StagedArray` (a conversion's, already written) is moved into place once its writes are done; any other leaf
    (numpy or jax arrays, memory-maps) is written here the same way, chunk by chunk from where it lies.

    Raises:
        ValueError: a `StagedArray` not completely written.
        FileExistsError: `path` exists.
    """
    path.mkdir(parents=True)
    context, writes = ts.Context({"file_io_sync": False}), _Writes()
    entries = {}
    for keys, leaf in _keyed_leaves(tree, ()):
        name = ".".join(keys)
        if not isinstance(leaf, StagedArray):
            array = np.asarray(leaf)
            leaf_path = path / name
            StagedArray(leaf_path, array.shape, array.dtype, 0, context, writes)[()] = array
        else:
            leaf.finish()
            if leaf.written != math.prod(leaf.shape) * leaf.dtype.itemsize:
                raise ValueError(f"{path}: staged array {name!r} not completely written ({leaf.written} bytes)")
            os.replace(leaf.path, path / name)
        entries[repr(tuple(keys))] = {"key_metadata": [{"key": k, "key_type": _DICT_KEY} for k in keys],
                                      "value_metadata": {"value_type": "np.ndarray", "skip_deserialize": False}}
    writes.wait(0)
    started = time.time_ns()
    (path / "_METADATA").write_text(json.dumps({
        "tree_metadata": entries, "use_ocdbt": False, "use_zarr3": False,
        "store_array_data_equal_to_fill_value": True, "custom_metadata": None}), encoding="utf-8")
    (path / "_CHECKPOINT_METADATA").write_text(json.dumps({
        "item_handlers": ORBAX_HANDLER, "metrics": {}, "performance_metrics": {}, "init_timestamp_nsecs": started,
        "commit_timestamp_nsecs": time.time_ns(), "custom_metadata": {}}), encoding="utf-8")
    (path / "commit_success.txt").write_text(f"Checkpoint commit was successful to {path}", encoding="utf-8")


_DICT_KEY = 2  # orbax's key type of a dict key
ORBAX_HANDLER = "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"


def _keyed_leaves(tree: Any, keys: tuple[str, ...]) -> list[tuple[tuple[str, ...], Any]]:
    if not isinstance(tree, dict):
        return [(keys, tree)]
    out = []
    for k, v in sorted(tree.items()):
        if not isinstance(k, str) or "." in k:
            raise ValueError(f"tree key {k!r} at {'.'.join(keys) or 'the root'}: keys are strings without dots")
        out += _keyed_leaves(v, (*keys, k))
    return out


def leaves(tree: Any) -> list[tuple[str, Any]]:
    """`(dotted name, leaf)` of a nested dict tree."""
    if not isinstance(tree, dict):
        return [("", tree)]
    out = []
    for k, v in tree.items():
        out += [(f"{k}.{name}" if name else str(k), leaf) for name, leaf in leaves(v)]
    return out
