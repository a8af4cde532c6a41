"""The conversion loop every model type shares: validate the whole checkpoint against its components' tables (from
headers only), then write every tensor, transformed and cast, straight into its parameter's storage
(`omnijax.checkpoint.staged`), so resident memory stays near the largest single tensor whatever the model size.

The main thread reads tensors (into a few reused buffers, `_ReadBuffers`) and hands their blocks over; the writer
threads of `omnijax.checkpoint.staged.ChunkWrites` transpose, cast and write them, so on a machine with a free core
the transposes overlap the reads and each other."""

from __future__ import annotations

import collections
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np
import tqdm

from omnijax.checkpoint import name_tables as tables
from omnijax.checkpoint.name_tables import Component
from omnijax.checkpoint.safetensors import ReadBuffer, SafetensorsCheckpoint
from omnijax.checkpoint.staged import IN_FLIGHT_BLOCKS, ChunkWrites, FileBytes, staged_tree
from omnijax.errors import TensorError

NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
FLOAT_SOURCE_DTYPES = ("F64", "F32", "F16", "BF16")


def stderr(message: str) -> None:
    print(message, file=sys.stderr)


def convert_components(ckpt: SafetensorsCheckpoint, components: Sequence[Component], *, dtype: str,
                       staging_dir: Path, strip_prefix: str = "", skip_prefixes: Sequence[str] = (),
                       progress: bool = True) -> tuple[dict[str, dict], tables.Plan, collections.Counter]:
    """Converts every component of a checkpoint into trees of written arrays (`StagedArray`s under
    `staging_dir/<component>`, committed by `omnijax.checkpoint.format.save_params`).

    Returns `(trees by component name, the validated plan, source dtype counts)`.

    Raises:
        UnexpectedTensorError, MissingTensorError, ShapeMismatchError: the checkpoint does not match the tables.
        TensorError: a tensor is not floating point.
    """
    names = ckpt.names()
    plan = tables.plan_conversion(names, {n: ckpt.info(n).shape for n in names}, components,
                                  strip_prefix=strip_prefix, skip_prefixes=skip_prefixes)
    for name in plan.assign:
        if ckpt.info(name).dtype not in FLOAT_SOURCE_DTYPES:
            raise TensorError(f"tensor {name!r} has dtype {ckpt.info(name).dtype}, expected one of "
                              f"{', '.join(FLOAT_SOURCE_DTYPES)}")
    target = NP_DTYPES[dtype]
    staging_dir.mkdir(parents=True, exist_ok=True)
    trees, writes = {}, ChunkWrites()  # one set of writer threads for every component
    for c in components:
        leading = {rule.path.replace("/", "."): len(c.leading(rule)) for rule in c.active_rules()}
        trees[c.name] = staged_tree(staging_dir / c.name, tables.param_shapes(c), leading, target, writes)
    source_dtypes = collections.Counter()
    # the buffers together hold at most the largest tensor read (and never more than `_READ_BUFFERS` x
    # `_ALONE_BYTES`): a tensor over a buffer's share of it is read alone
    largest = max((ckpt.info(n).nbytes for n in plan.assign), default=0) \
        if isinstance(ckpt, SafetensorsCheckpoint) else 0  # other sources are never read into the buffers
    buffers = _ReadBuffers(writes, alone_bytes=min(_ALONE_BYTES, largest // _READ_BUFFERS))
    try:
        for name in tqdm.tqdm(names, desc="converting", unit="tensor", file=sys.stderr, disable=not progress):
            if name in plan.assign:
                source_dtypes[ckpt.info(name).dtype] += 1
                # fill hands the tensor's blocks to the writer threads, which cast and write them into its storage
                tables.fill(trees, name, _source(ckpt, name, plan.assign[name][1], target, buffers), plan)
                buffers.handed_over()
        writes.wait(0)
    except BaseException:
        writes.abandon()  # no file is written after the caller has removed the staging directory
        raise
    return trees, plan, source_dtypes


def _source(ckpt: SafetensorsCheckpoint, name: str, rule: tables.Rule, target: np.dtype,
            buffers: _ReadBuffers) -> np.ndarray | FileBytes:
    """The tensor `name` as `fill` takes it, read-only (its blocks are then cast and copied by the writer threads,
    which it must outlive unchanged): read into one of `buffers` when `fill` copies it anyway (a transform that is
    not a C-ordered view, or a cast), so the copy reads from memory that transposes quickly (see `ReadBuffer`);
    otherwise memory-mapped, written to its storage as it lies. Other sources (a GGUF file's dequantised tensors,
    already in memory) are read as they read."""
    if not isinstance(ckpt, SafetensorsCheckpoint):
        return ckpt.read(name)
    info = ckpt.info(name)
    if info.np_dtype == target and tables.TRANSFORMS[rule.transform](_layout(info)).flags.c_contiguous:
        # written as it lies: a small tensor is read into its own array (cheaper than mapping it), a large one
        # copied file to file by the kernel (on Linux; elsewhere mapped and written from the mapping)
        if info.nbytes > _SMALL_BYTES:
            if _KERNEL_COPY and rule.transform is None:
                return FileBytes(info.path, info.offset, info.shape, info.np_dtype)
            return ckpt.read(name)
        array = ckpt.read_into(name, np.empty(info.shape, info.np_dtype))
    else:
        array = ckpt.read_into(name, buffers.array(info.shape, info.np_dtype))
    array.flags.writeable = False  # unchanged until written: the buffer is reused only after its writes are done
    return array


# Read buffers: one per block the writer threads may hold, plus the one being read. A tensor larger than the
# buffers' share (`_ReadBuffers`' `alone_bytes`: `_ALONE_BYTES`, or less so that the buffers together stay within the
# largest tensor of the checkpoint) is read alone (the writes of the others finished and their buffers dropped), so
# the buffers hold at most the largest tensor read: a checkpoint of equal-sized tensors is read one at a time.
_READ_BUFFERS = IN_FLIGHT_BLOCKS + 1
_ALONE_BYTES = 32 << 20


class _ReadBuffers:
    """`ReadBuffer`s used in turn, each reused only once the writer threads are done with the blocks handed over
    from it (`ChunkWrites.mark` / `wait_for`)."""

    def __init__(self, writes: ChunkWrites, alone_bytes: int = _ALONE_BYTES):
        self._writes = writes
        self._alone_bytes = alone_bytes
        self._buffers = [ReadBuffer() for _ in range(_READ_BUFFERS)]
        self._marks = [0] * _READ_BUFFERS
        self._turn = 0

    def array(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """The next buffer as an array of `shape` and `dtype`, once the blocks of its previous tensor are written."""
        self._turn = (self._turn + 1) % len(self._buffers)
        if math.prod(shape) * np.dtype(dtype).itemsize > self._alone_bytes:
            self._writes.wait(0)
            self._buffers = [b if i == self._turn else ReadBuffer() for i, b in enumerate(self._buffers)]
        else:
            self._writes.wait_for(self._marks[self._turn])
        return self._buffers[self._turn].array(shape, dtype)

    def handed_over(self) -> None:
        """Records that the last tensor read has been handed to the writer threads."""
        self._marks[self._turn] = self._writes.mark()


def _layout(info) -> np.ndarray:
    """A read-only array with the strides of the C-ordered tensor `info` over one element (never read): what a
    transform does to its layout, without memory of its size."""
    strides = [info.np_dtype.itemsize] if info.shape else []
    for n in reversed(info.shape[1:]):
        strides.insert(0, strides[0] * n)
    return np.lib.stride_tricks.as_strided(np.empty(1, info.np_dtype), info.shape, strides, writeable=False)


_SMALL_BYTES = 1 << 20
# os.sendfile copies a file into a file on Linux only (elsewhere its destination must be a socket): the SmolLM2
# embedding's 108 MB took 0.035 s of CPU copied so, against 0.07 s mapped and written from the mapping (which also
# made the mapped pages resident in this process)
_KERNEL_COPY = sys.platform.startswith("linux")


def log_skipped(skipped: dict[str, int], speech_prefixes: Sequence[str], log: Callable[[str], None]) -> None:
    """One summary line per kind of deliberately skipped tensors."""
    speech = {p: n for p, n in skipped.items() if p.startswith(tuple(speech_prefixes))}
    unused = {p: n for p, n in skipped.items() if p not in speech}
    if speech:
        counts = ", ".join(f"{p}: {n}" for p, n in sorted(speech.items()))
        log(f"skipped {sum(speech.values())} speech-output tensors ({counts}): not used by omnijax")
    if unused:
        log(f"skipped {sum(unused.values())} tensor(s) the model never reads: {', '.join(sorted(unused))}")
