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
import dataclasses
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


@dataclasses.dataclass(frozen=True)
class FileBytes:
    """A C-ordered array stored in a file from byte `offset` on (a tensor of a safetensors file), written to a
    `StagedArray` of the same dtype by the kernel copying the file's bytes (`os.sendfile`: Linux only), without
    mapping or reading them into this process. The file must stay unchanged until the writes are done.

    Attributes:
        path: the file.
        offset: the byte offset of the array's first element.
        shape: the array's shape.
        dtype: its dtype.
    """

    path: Path
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


class StagedArray:
    """One parameter array being written to `path` (a zarr directory), filled by `array[index] = value`.

    TensorStore writes the array's metadata (`.zarray`); the chunks are written here, each straight from the block
    that holds it (a cast and transposed copy, or a view of a read-only source, such as a memory-mapped file, when
    neither is needed) into its own file by one `write`: no further copy of the data (TensorStore's write copied
    every block before writing it, and cost a thread hand-off per chunk). A writeable source is cast and copied
    before `array[index] = value` returns, as its owner may change or reuse it once it has; a read-only source is
    taken to stay unchanged until the writes are done (`finish`, or `ChunkWrites.wait_for`), and its blocks are
    cast and copied by the writer threads (in parallel with the caller's next read). A write covers whole storage
    chunks: one index of each leading axis, every trailing axis whole, so each chunk is written once, never read
    back to be completed. A small array with leading axes (`gathered`: a norm or bias per layer) is gathered in
    memory instead and written as one chunk once every row has been written.

    Attributes:
        path: the zarr directory.
        shape: the array's shape.
        dtype: its dtype; written values are cast to it as `astype` casts.
        leading: how many leading axes a write indexes with integers (layers, experts).
        written: bytes handed to the storage so far (`finish` waits for them), or for a gathered array, its bytes
            written so far (handed to the storage together once complete).
    """

    def __init__(self, path: Path, shape: tuple[int, ...], dtype: Any, leading: int, context: ts.Context,
                 writes: ChunkWrites):
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

    def __setitem__(self, index: tuple[int, ...], value: np.ndarray | FileBytes) -> None:
        index = tuple(int(i) for i in index)
        value = value if isinstance(value, FileBytes) else np.asarray(value)
        if len(index) != self.leading or any(not 0 <= i < n for i, n in zip(index, self.shape)):
            raise ValueError(f"{self.path.name}: a write takes one index of each of the {self.leading} leading axes "
                             f"of shape {self.shape[:self.leading]}, not {list(index)}")
        if tuple(value.shape) != self.shape[self.leading:]:
            raise ValueError(f"{self.path.name}{list(index)}: a value of shape {value.shape} for a region of "
                             f"shape {self.shape[self.leading:]}")
        if isinstance(value, FileBytes) and (value.dtype != self.dtype or not value.ndim or self._gathered is not None):
            raise ValueError(f"{self.path.name}: the bytes of {value.path} are copied as they lie only into whole "
                             f"chunks of the same dtype ({value.dtype} into {self.dtype} of shape {self.shape}): read "
                             "the tensor into an array instead")
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
        if isinstance(value, FileBytes):  # the kernel copies each chunk's bytes from the file
            for first in range(0, value.shape[0], rows):
                count = min(rows, value.shape[0] - first) * per_row
                self._writes.add_copy(value.path, value.offset + first * per_row, count,
                                      self.path / f"{prefix}{first // rows}{trailing_keys}", chunk_bytes)
                self.written += count
            return
        for start in range(0, value.shape[0], step):
            part = value[start:start + step]
            files = [(self.path / f"{prefix}{(start + first) // rows}{trailing_keys}", first, chunk_bytes)
                     for first in range(0, part.shape[0], rows)]
            if value.flags.writeable:  # the caller may change or reuse it once this returns: cast + layout now
                block = np.ascontiguousarray(part, dtype=self.dtype)
                self._writes.add_block(block.copy() if np.may_share_memory(block, value) else block, None, rows,
                                       files)
            else:  # unchanged until the writes are done: cast and laid out by the writer thread
                self._writes.add_block(part, self.dtype, rows, files)
            self.written += math.prod(part.shape) * self.dtype.itemsize

    def finish(self) -> None:
        """Waits until every write handed to the storage so far is done (raising the first failure)."""
        self._writes.wait(0)


class ChunkWrites:
    """The chunk files of one conversion written by `WRITE_THREADS` threads, block by block, with at most
    `IN_FLIGHT_BLOCKS` blocks handed over and not yet written (each holds its block, which nothing else writes to).

    A block from a read-only source (a memory-mapped file, or a buffer its owner keeps unchanged until the writes
    are done: `mark` / `wait_for`) is cast and laid out by the thread that writes it, so on a machine with a free
    core the transposes of one block overlap the next tensor's read and the other thread's block (the cast and the
    transpose are numpy copies, which release the GIL). Two threads: writing a chunk file (the kernel copying it
    into the page cache, creating the file) cost as much CPU as casting and transposing its block; each file is
    written whole by one thread, so the threads never touch the same file."""

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="omnijax-convert-write")
        self._pending: collections.deque = collections.deque()
        self._handed = 0  # blocks handed over so far
        self._done = 0  # of them, blocks whose writes this object has seen finish (in order)

    def add(self, path: Path, chunk: np.ndarray, size: int) -> None:
        """Writes `chunk` (C-contiguous) as the file `path`, extended with zeros to `size` bytes (zarr stores an
        edge chunk at its full size)."""
        self.add_block(chunk, None, chunk.shape[0] if chunk.ndim else 1, [(path, 0, size)])

    def add_block(self, block: np.ndarray, dtype: np.dtype | None, rows: int, files: list[tuple[Path, int, int]]
                  ) -> None:
        """Writes the rows `[first, first + rows)` of `block` as each file `(path, first, size)` of `files`; with
        `dtype`, `block` is first cast to it and laid out C-ordered by the writing thread (it must stay unchanged
        until then), otherwise it is written as it is (C-contiguous)."""
        self._pending.append(self._pool.submit(_write_block, block, dtype, rows, files))
        self._handed += 1
        self.wait(IN_FLIGHT_BLOCKS)

    def add_copy(self, source: Path, offset: int, count: int, path: Path, size: int) -> None:
        """Writes the `count` bytes of the file `source` from `offset` on as the file `path`, extended with zeros to
        `size` bytes, copied by the kernel (`os.sendfile`)."""
        self._pending.append(self._pool.submit(_copy_bytes, source, offset, count, path, size))
        self._handed += 1
        self.wait(IN_FLIGHT_BLOCKS)

    def mark(self) -> int:
        """A mark of the blocks handed over so far, for `wait_for`."""
        return self._handed

    def wait_for(self, mark: int) -> None:
        """Waits until every block handed over before `mark` was taken is written (raising the first failure): the
        sources they were taken from may then change."""
        while self._done < mark:
            write = self._pending.popleft()
            self._done += 1
            write.result()

    def wait(self, keep: int) -> None:
        """Waits until at most `keep` blocks are not yet written (raising the first failure)."""
        self.wait_for(self._handed - keep)

    def abandon(self) -> None:
        """Drops the blocks not yet started and waits for those being written, ignoring their failures: after a
        failure elsewhere, so that nothing is written once the caller removes what was written."""
        for write in self._pending:
            write.cancel()
        concurrent.futures.wait(self._pending)
        self._done += len(self._pending)
        self._pending.clear()


def _write_block(block: np.ndarray, dtype: np.dtype | None, rows: int, files: list[tuple[Path, int, int]]) -> None:
    if dtype is not None:
        block = _laid_out(block, dtype)  # cast + layout: a copy of the block, which owns it
    for path, first, size in files:
        _write_file(path, block[first:first + rows], size)


# Source rows per slab of a transposed block's copy (`_laid_out`).
TRANSPOSE_SLAB = 128


def _laid_out(block: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`block` cast to `dtype` (as `astype` casts) as a new C-ordered array. A transposed matrix (its columns
    contiguous: a `[out, in]` weight's `.T`, or rows of it) is copied in slabs of `TRANSPOSE_SLAB` source rows,
    each of whose columns is written while its cache lines are loaded: a [1536, 576] float32 transpose from memory
    out of cache took 0.08 CPU s per 425 MB against numpy's whole-array strided copy's 0.12 (3 runs each,
    alternating)."""
    if block.ndim != 2 or block.strides[0] != block.itemsize or block.shape[1] <= TRANSPOSE_SLAB:
        return np.ascontiguousarray(block, dtype=dtype)
    out = np.empty(block.shape, dtype)
    for first in range(0, block.shape[1], TRANSPOSE_SLAB):
        np.copyto(out[:, first:first + TRANSPOSE_SLAB], block[:, first:first + TRANSPOSE_SLAB], casting="unsafe")
    return out


def _copy_bytes(source: Path, offset: int, count: int, path: Path, size: int) -> None:
    with open(source, "rb") as src, open(path, "wb") as f:
        done = 0
        while done < count:
            n = os.sendfile(f.fileno(), src.fileno(), offset + done, count - done)
            if n == 0:
                raise OSError(f"{source} ends at byte {offset + done}, before the tensor's end at {offset + count} "
                              "(truncated since its header was read?)")
            done += n
        if size > count:
            f.truncate(size)  # reads back as zeros


def _write_file(path: Path, chunk: np.ndarray, size: int) -> None:
    with open(path, "wb") as f:  # (buffered I/O writes a large buffer through, without a copy)
        f.write(memoryview(chunk.reshape(-1).view(np.uint8)))
        if size > chunk.nbytes:
            f.truncate(size)  # reads back as zeros


def staged_tree(directory: Path, shapes: dict, leading: dict[str, int], dtype: Any,
                writes: ChunkWrites | None = None) -> dict:
    """A tree of `StagedArray`s under `directory`, one per leaf of `shapes` (nested dicts of shape tuples), each
    named by its dotted path; `leading[dotted]` is its number of indexed leading axes. Their chunk files are written
    by `writes` (shared by the trees of one conversion; a new `ChunkWrites` when None)."""
    context = ts.Context({"file_io_sync": False})  # no fsync per chunk: the checkpoint is committed by rename
    writes = ChunkWrites() if writes is None else writes

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
    context, writes = ts.Context({"file_io_sync": False}), ChunkWrites()
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
