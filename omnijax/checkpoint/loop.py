"""The conversion loop every model type shares: validate the whole checkpoint against its components' tables (from
headers only), then write every tensor, transformed and cast, straight into its parameter's storage
(`omnijax.checkpoint.staged`), so resident memory stays near the largest single tensor whatever the model size."""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np
import tqdm

from omnijax.checkpoint import name_tables as tables
from omnijax.checkpoint.name_tables import Component
from omnijax.checkpoint.safetensors import ReadBuffer, SafetensorsCheckpoint
from omnijax.checkpoint.staged import staged_tree
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
    trees = {}
    for c in components:
        leading = {rule.path.replace("/", "."): len(c.leading(rule)) for rule in c.active_rules()}
        trees[c.name] = staged_tree(staging_dir / c.name, tables.param_shapes(c), leading, target)
    source_dtypes = collections.Counter()
    buffer = ReadBuffer()
    for name in tqdm.tqdm(names, desc="converting", unit="tensor", file=sys.stderr, disable=not progress):
        if name in plan.assign:
            source_dtypes[ckpt.info(name).dtype] += 1
            # fill casts and writes the tensor in blocks into its final storage
            tables.fill(trees, name, _source(ckpt, name, plan.assign[name][1], target, buffer), plan)
    return trees, plan, source_dtypes


def _source(ckpt: SafetensorsCheckpoint, name: str, rule: tables.Rule, target: np.dtype,
            buffer: ReadBuffer) -> np.ndarray:
    """The tensor `name` as `fill` takes it: read into `buffer` when `fill` copies it anyway (a transform that is not
    a C-ordered view, or a cast), so the copy reads from memory that transposes quickly (see `ReadBuffer`);
    otherwise memory-mapped, written to its storage as it lies. The buffer's contents are never handed on: the
    copies `fill` makes are complete when it returns, and the next tensor may overwrite it. Other sources (a GGUF
    file's dequantised tensors, already in memory) are read as they read."""
    if not isinstance(ckpt, SafetensorsCheckpoint):
        return ckpt.read(name)
    info = ckpt.info(name)
    if info.np_dtype == target and tables.TRANSFORMS[rule.transform](_layout(info)).flags.c_contiguous:
        # written as it lies: a small tensor is read into its own array (cheaper than mapping it), a large one mapped
        return ckpt.read_into(name, np.empty(info.shape, info.np_dtype)) if info.nbytes <= _SMALL_BYTES \
            else ckpt.read(name)
    return ckpt.read_into(name, buffer.array(info.shape, info.np_dtype))


def _layout(info) -> np.ndarray:
    """A read-only array with the strides of the C-ordered tensor `info` over one element (never read): what a
    transform does to its layout, without memory of its size."""
    strides = [info.np_dtype.itemsize] if info.shape else []
    for n in reversed(info.shape[1:]):
        strides.insert(0, strides[0] * n)
    return np.lib.stride_tricks.as_strided(np.empty(1, info.np_dtype), info.shape, strides, writeable=False)


_SMALL_BYTES = 1 << 20


def log_skipped(skipped: dict[str, int], speech_prefixes: Sequence[str], log: Callable[[str], None]) -> None:
    """One summary line per kind of deliberately skipped tensors."""
    speech = {p: n for p, n in skipped.items() if p.startswith(tuple(speech_prefixes))}
    unused = {p: n for p, n in skipped.items() if p not in speech}
    if speech:
        counts = ", ".join(f"{p}: {n}" for p, n in sorted(speech.items()))
        log(f"skipped {sum(speech.values())} speech-output tensors ({counts}): not used by omnijax")
    if unused:
        log(f"skipped {sum(unused.values())} tensor(s) the model never reads: {', '.join(sorted(unused))}")
