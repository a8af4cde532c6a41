"""Parameter arrays written straight into their storage while a conversion fills them, tensor by tensor.

A conversion assembles each stacked parameter (`[layers, ...]`) from many source tensors. Instead of filling a
staging copy of the whole tree and saving it afterwards (every byte written twice, and the staging pages resident
in the converting process: its peak was about the whole model), every source tensor is cast and written once, in
blocks of at most `SAVE_CHUNK_BYTES`, into an uncompressed zarr array (TensorStore) laid out as orbax writes one:
storage chunks never span two layers, so no chunk is read back to be completed. `commit` then moves the arrays
into place beside the orbax metadata of the same tree (`omnijax.checkpoint.format.save_params`).

Resident memory while converting: the source tensor being read plus a few blocks in flight.
"""

from __future__ import annotations

import collections
import math
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

SAVE_CHUNK_BYTES = 8 * 1024 * 1024  # storage chunk size: bounds the memory one chunk write needs
IN_FLIGHT_BLOCKS = 1  # blocks written while the next is prepared


def chunk_shape(shape: tuple[int, ...], itemsize: int, leading: int) -> tuple[int, ...]:
    """Storage chunks of an array: one index of each of the `leading` (layer, expert) axes, then whole trailing
    axes, split along the first of them to stay within `SAVE_CHUNK_BYTES`."""
    chunk = [1] * leading + list(shape[leading:])
    if leading < len(shape):
        row = math.prod(shape[leading + 1:]) * itemsize
        chunk[leading] = max(1, min(shape[leading], SAVE_CHUNK_BYTES // max(row, 1)))
    return tuple(max(c, 1) for c in chunk)


def _zarr_dtype(dtype: np.dtype) -> str:
    return "bfloat16" if dtype.name == "bfloat16" else dtype.str


class StagedArray:
    """One parameter array being written to `path` (a zarr directory), filled by `array[index] = value`.

    Attributes:
        path: the zarr directory.
        shape: the array's shape.
        dtype: its dtype; written values are cast to it as `astype` casts.
        leading: how many leading axes a write indexes with integers (layers, experts).
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
        self._store = ts.open(spec, create=True, context=context).result()
        self._writes = writes
        self.written = 0  # bytes handed to the storage so far (`finish` waits for them)

    def __setitem__(self, index: tuple[int, ...], value: np.ndarray) -> None:
        value = np.asarray(value)
        region = self._store[index] if index else self._store
        if tuple(value.shape) != tuple(region.shape):
            raise ValueError(f"{self.path.name}{list(index)}: a value of shape {value.shape} for a region of "
                             f"shape {tuple(region.shape)}")
        if value.ndim == 0:
            self._writes.add(region, np.asarray(value, self.dtype))
            self.written += self.dtype.itemsize
            return
        axis = len(index)  # the region's first axis is the array's axis `axis`
        per_row = max(1, math.prod(value.shape[1:]) * self.dtype.itemsize)
        step = max(1, SAVE_CHUNK_BYTES // per_row // self._chunks[axis]) * self._chunks[axis] if axis < self.ndim \
            else value.shape[0]
        for start in range(0, value.shape[0], step):
            block = np.ascontiguousarray(value[start:start + step], dtype=self.dtype)  # cast + layout, one block
            self._writes.add(region[start:start + block.shape[0]], block)
            self.written += block.nbytes

    def finish(self) -> None:
        """Waits until every write handed to the storage so far is on disk (raising the first failure)."""
        self._writes.wait(0)


class _Writes:
    """The writes of one conversion in flight: the next block is cast while earlier ones are written, with at most
    `IN_FLIGHT_BLOCKS` blocks held."""

    def __init__(self):
        self._pending: collections.deque = collections.deque()

    def add(self, region: ts.TensorStore, block: np.ndarray) -> None:
        # TensorStore copies the block before the write returns. Letting it reference the block instead
        # (`can_reference_source_data_indefinitely`) was ~2x quicker but crashed a test worker with a segmentation
        # fault in a TensorStore thread during a conversion (twice, not reproducible at will): not worth the time.
        self._pending.append(region.write(block))
        self.wait(IN_FLIGHT_BLOCKS)

    def wait(self, keep: int) -> None:
        while len(self._pending) > keep:
            self._pending.popleft().result()


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


def leaves(tree: Any) -> list[tuple[str, Any]]:
    """`(dotted name, leaf)` of a nested dict tree."""
    if not isinstance(tree, dict):
        return [("", tree)]
    out = []
    for k, v in tree.items():
        out += [(f"{k}.{name}" if name else str(k), leaf) for name, leaf in leaves(v)]
    return out
