"""The omnijax on-disk checkpoint format.

A converted checkpoint is a directory:

    DST/omnijax.json   manifest: {"format": "omnijax", "format_version": 1, "model_type": ...,
                                  "decoder": DecoderConfig.to_json(), "source": {...}}
    DST/params/        orbax PyTree checkpoint (restored with StandardCheckpointer) of the decoder's pure-dict
                       parameter tree
    DST/<component>/   the same for each optional component (e.g. `audio`, `vision` encoders), whose config is
                       the manifest entry of the same name
    DST/tokenizer.json ... tokenizer and processor files copied from the source, when present

The manifest is written after the parameters, so a directory with a manifest holds a complete parameter tree.
Parameters are stored in the decoder's dtype (`decoder.dtype`); restoring bfloat16 is bit exact.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import mmap
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts  # orbax's storage layer

from omnijax._checks import JsonConfig
from omnijax.checkpoint import staged
from omnijax.checkpoint.staged import SAVE_CHUNK_BYTES

FORMAT = "omnijax"
FORMAT_VERSION = 1
MANIFEST = "omnijax.json"
PARAMS_DIR = "params"
COMMON_KEYS = ("format", "format_version", "model_type", "decoder", "source")
# The model types omnijax reads, each with the components (encoders, their configs) its manifest may name beside
# the common keys; a component's parameters live in the directory of the same name. Filled by the model families as
# they register (`omnijax.models.family.register`): this layer knows no model type by name.
MODEL_COMPONENTS: dict[str, tuple[str, ...]] = {}


class CheckpointFormatError(ValueError):
    """A directory is not a readable omnijax checkpoint, or its parameters do not match the requested tree."""


def _save_tree(path: Path, tree: dict) -> None:
    """Saves a pure-dict array tree synchronously in orbax's PyTree format (what `StandardCheckpointer` reads).

    Four departures from `StandardCheckpointer().save`, all about memory and time, none about what is read back:
    its numpy handler deep-copies every host array before the asynchronous write (here read-only, memory-mapped
    arrays are written from where they are); an array is one storage chunk unless told otherwise (here chunks hold
    at most `SAVE_CHUNK_BYTES`); the OCDBT key-value store keeps every compressed chunk in memory until the commit
    (here each array is a plain zarr directory); and chunks are stored uncompressed (zstd cost half of a
    conversion's time and every load's decompression, for a third of the disk on dequantised GGUF weights, less on
    trained float weights).

    A tree of `omnijax.checkpoint.staged.StagedArray`s (a conversion's, already written) is committed instead: orbax
    writes the metadata of the same tree (with one-element stand-ins) and the written arrays replace the stand-ins.
    """
    named = staged.leaves(tree)
    written = [leaf for _, leaf in named if isinstance(leaf, staged.StagedArray)]
    if written and len(written) != len(named):
        raise TypeError(f"{path}: a tree mixes staged arrays with other leaves")
    if written:
        for leaf in written:
            leaf.finish()
        unfinished = [name for name, leaf in named
                      if leaf.written != int(np.prod(leaf.shape, dtype=np.int64)) * leaf.dtype.itemsize]
        if unfinished:
            raise ValueError(f"{path}: staged arrays not completely written: {unfinished}")
        tree = jax.tree.map(lambda a: np.zeros((1,) * a.ndim, a.dtype), tree,
                            is_leaf=lambda x: isinstance(x, staged.StagedArray))
    handlers = ocp.type_handlers
    registry = handlers.create_type_handler_registry(
        (np.ndarray, handlers.NumpyHandler(deepcopy_host_arrays=False)),
        (jax.Array, handlers.ArrayHandler()),
    )
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=SAVE_CHUNK_BYTES), tree)
    handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry, use_ocdbt=False, use_compression=False)
    absl_logger = logging.getLogger("absl")
    absl_logger.addFilter(_drop_ocdbt_merge_notice)
    try:
        with ocp.Checkpointer(handler) as checkpointer:
            checkpointer.save(path, args=ocp.args.PyTreeSave(tree, save_args=save_args))
    finally:
        absl_logger.removeFilter(_drop_ocdbt_merge_notice)
    for name, leaf in named if written else ():
        stand_in = path / name
        if not (stand_in / ".zarray").is_file():
            raise RuntimeError(f"{path}: orbax did not write {name!r} as the zarr directory {stand_in} that a staged "
                               "array replaces (has its layout changed?)")
        shutil.rmtree(stand_in)
        os.replace(leaf.path, stand_in)


def _drop_ocdbt_merge_notice(record: logging.LogRecord) -> bool:
    """Drops orbax's warning that there are no OCDBT files to merge (expected: OCDBT is off on purpose)."""
    return "Skipping merge of OCDBT checkpoints" not in record.getMessage()


def save_params(dst_dir: str | os.PathLike, model_type: str, config: JsonConfig, params_pure_dict: dict,
                source_info: dict[str, Any] | None = None, *,
                components: dict[str, tuple[dict[str, Any], dict]] | None = None) -> Path:
    """Writes `params/` (and each component's directory), then the manifest, into `dst_dir`.

    Args:
        dst_dir: output directory (created if needed; the parameter directories must not exist).
        model_type: omnijax model type (e.g. "qwen2_5_omni").
        config: decoder config; its `dtype` should be the dtype of the parameter arrays.
        params_pure_dict: nested dict of arrays (numpy, numpy memmaps or jax arrays) in the decoder's layout.
        source_info: JSON-serialisable provenance (source path, skipped tensors, ...).
        components: optional extra parts such as encoders, name -> (JSON config, parameter tree or None); each
            tree is stored in `DST/<name>/` and each config under the manifest key `<name>`.

    Returns:
        The checkpoint directory.

    Raises:
        ValueError: a model type omnijax does not read, or a component that is not part of it (nothing is written).
    """
    components = components or {}
    if model_type not in MODEL_COMPONENTS:
        raise ValueError(f"model type {model_type!r} is not one omnijax reads ({sorted(MODEL_COMPONENTS)})")
    unknown = sorted(set(components) - set(MODEL_COMPONENTS[model_type]))
    if unknown:
        raise ValueError(f"components {unknown} are not part of a {model_type} checkpoint "
                         f"(it may have {list(MODEL_COMPONENTS[model_type])})")
    dst = Path(dst_dir).resolve()
    dst.mkdir(parents=True, exist_ok=True)
    _save_tree(dst / PARAMS_DIR, params_pure_dict)
    for name, (_, tree) in components.items():
        if tree is not None:
            _save_tree(dst / name, tree)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model_type": model_type,
        "decoder": config.to_json(),
        "source": source_info or {},
        **{name: component_config for name, (component_config, _) in components.items()},
    }
    tmp = dst / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, dst / MANIFEST)
    return dst


def read_manifest_dict(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    """The validated manifest of a checkpoint as a dict (see the module docstring for its keys).

    Raises:
        CheckpointFormatError: no manifest, unreadable JSON, another format, an unsupported version, no decoder, a
            model type omnijax does not read, or a key that is not part of that model type's manifest.
    """
    path = Path(ckpt_dir) / MANIFEST
    if not path.is_file():
        raise CheckpointFormatError(
            f"{path} not found: {ckpt_dir} is not an omnijax checkpoint (convert one with omnijax-convert)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointFormatError(f"{path}: cannot read manifest: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointFormatError(f"{path}: format is {found!r}, expected {FORMAT!r}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointFormatError(f"{path}: format_version {manifest.get('format_version')!r} is not supported "
                                    f"(this omnijax reads version {FORMAT_VERSION})")
    if not isinstance(manifest.get("model_type"), str) or not isinstance(manifest.get("decoder"), dict):
        raise CheckpointFormatError(f"{path}: manifest needs a 'model_type' string and a 'decoder' object")
    model_type = manifest["model_type"]
    if model_type not in MODEL_COMPONENTS:
        raise CheckpointFormatError(f"{path}: model_type {model_type!r} is not one omnijax reads "
                                    f"({sorted(MODEL_COMPONENTS)})")
    unknown = sorted(set(manifest) - set(COMMON_KEYS) - set(MODEL_COMPONENTS[model_type]))
    if unknown:
        raise CheckpointFormatError(f"{path}: unknown manifest keys {unknown} for a {model_type} checkpoint; it may "
                                    f"hold {list(COMMON_KEYS + MODEL_COMPONENTS[model_type])}")
    return manifest


def _describe(leaf) -> str:
    return f"{tuple(leaf.shape)} {jax.numpy.dtype(leaf.dtype).name}"


def load_params(ckpt_dir: str | os.PathLike, abstract_pure_dict: dict, component: str = PARAMS_DIR, *,
                dtype: str | None = None) -> dict:
    """Restores a parameter tree (the decoder's, or a component's) as jax arrays, with one copy of the weights.

    Every leaf is read from disk into the buffer that becomes its device array (see `_LeafReader`): no whole-tree
    host copy exists beside the device arrays, so resident memory grows by about the parameters' bytes.

    Args:
        ckpt_dir: a converted checkpoint directory.
        component: the directory of the tree: `params` for the decoder, or a component name (e.g. "audio").
        abstract_pure_dict: the target tree of `jax.ShapeDtypeStruct`s (e.g. from
            `nnx.state(nnx.eval_shape(lambda: Decoder(config))).to_pure_dict()`). Leaves without a sharding are placed
            on the default device.
        dtype: optional dtype ("float32", "bfloat16") the floating leaves are cast to while they are read (the
            target's dtypes are still those stored); None keeps the stored dtypes.

    Returns:
        The restored pure-dict tree with the same structure, shapes and dtypes as the target.

    Raises:
        CheckpointFormatError: the parameters are missing, their tree, shapes or dtypes differ from the target
            (orbax would silently cast a dtype; this refuses instead), or their files cannot be read (missing or
            damaged metadata or array files).
    """
    path = (Path(ckpt_dir) / component).resolve()
    if not path.is_dir():
        raise CheckpointFormatError(f"{path} not found: the checkpoint has no {component!r} parameters")
    damaged = "the checkpoint is incomplete or damaged; convert it again"
    with ocp.StandardCheckpointer() as checkpointer:
        try:
            metadata = checkpointer.metadata(path).item_metadata
        except Exception as e:  # orbax raises several types for unreadable metadata; the cause stays chained
            raise CheckpointFormatError(f"{path}: cannot read the parameter metadata ({_brief(e)}): {damaged}") from e
        if metadata is None:
            raise CheckpointFormatError(f"{path}: cannot read the parameter metadata: {damaged}")
        stored = metadata.tree
        stored_leaves = dict(jax.tree_util.tree_flatten_with_path(stored)[0])
        target_leaves = dict(jax.tree_util.tree_flatten_with_path(abstract_pure_dict)[0])
        problems = [f"missing {jax.tree_util.keystr(k)}" for k in target_leaves if k not in stored_leaves]
        problems += [f"unexpected {jax.tree_util.keystr(k)}" for k in stored_leaves if k not in target_leaves]
        problems += [
            f"{jax.tree_util.keystr(k)}: stored {_describe(stored_leaves[k])}, expected {_describe(t)}"
            for k, t in target_leaves.items()
            if k in stored_leaves and _describe(stored_leaves[k]) != _describe(t)]
        if problems:
            raise CheckpointFormatError(f"{path}: parameters do not match the model: " + "; ".join(problems))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with _large_blocks_mapped():
        try:
            return _read_tree(path, stored_leaves, abstract_pure_dict, dtype, device)
        except Exception as e:  # TensorStore reports a missing or unreadable chunk file; the cause stays chained
            raise CheckpointFormatError(f"{path}: cannot read the stored arrays ({_brief(e)}): {damaged}") from e


def _read_tree(path: Path, stored_leaves: dict, abstract_pure_dict: dict, dtype: str | None,
               device: jax.sharding.Sharding) -> dict:
    """Reads every leaf of the target tree (its reader, and TensorStore's context, end with this call)."""
    read = _LeafReader(path)
    return jax.tree_util.tree_map_with_path(
        lambda key, t: read(stored_leaves[key], t.shape, t.dtype if dtype is None else _cast(t.dtype, dtype),
                            getattr(t, "sharding", None) or device),
        abstract_pure_dict)


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_LOAD_MMAP_THRESHOLD = 1 << 20
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit systems


@contextlib.contextmanager
def _large_blocks_mapped() -> Iterator[None]:
    """While weights are read, heap blocks of 1 MiB or more are memory-mapped (glibc; elsewhere nothing changes).

    TensorStore's decoding threads allocate and free a chunk-sized buffer per storage chunk. glibc's default
    raises its mmap threshold to the size of the largest block freed so far, so after the first chunk these
    buffers come from the threads' heaps, where they are freed but stay resident between long-lived allocations:
    measured, 10-25% of the weights' bytes on top of them. Mapped, each buffer goes back to the system when freed
    (measured: resident growth equals the weights' bytes). Afterwards the threshold is fixed at glibc's own
    ceiling for its adaptive threshold (32 MiB, where a long-running process's threshold ends up anyway: setting it
    ends the adaptation) and free heap pages are returned (`malloc_trim`).
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: its allocator keeps its own policy
        yield
        return
    mallopt(_M_MMAP_THRESHOLD, _LOAD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
        trim(0)


def _cast(stored: Any, dtype: str) -> np.dtype:
    """The dtype a stored leaf is read as when a load asks for `dtype`: floating leaves take it, others stay."""
    stored = np.dtype(stored)
    return np.dtype(jax.numpy.dtype(dtype)) if np.issubdtype(stored, np.floating) or stored.name == "bfloat16" \
        else stored


def _host_buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zero-filled C-ordered host array in its own anonymous memory map: page aligned (so XLA:CPU
    adopts it without a copy), and outside the heap, whose freed decoding buffers then go back to the system
    instead of being pinned between weights."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=dtype).reshape(shape)


class _LeafReader:
    """Reads stored leaves one at a time into their final buffers.

    TensorStore decodes each leaf's storage chunks straight into one aligned host array (`ts.array(..., copy=False)`
    is a view of it), which becomes the device array itself on CPU (`jax.device_put` adopts an aligned buffer
    without a copy; another backend copies it to the device and the host array is freed with the next leaf). A cast
    (`load_params(..., dtype=...)`) happens chunk by chunk on the way in (`ts.cast`). Resident memory therefore
    grows by the parameters' bytes plus the chunks being decoded, instead of orbax's restore, which holds
    TensorStore's read buffers beside the device arrays it makes from them.
    """

    def __init__(self, path: Path):
        stored = json.loads((path / "_METADATA").read_text(encoding="utf-8")) if (path / "_METADATA").is_file() \
            else {}
        # orbax's defaults when the metadata does not say (older checkpoints)
        self._use_ocdbt = bool(stored.get("use_ocdbt", True))
        self._use_zarr3 = bool(stored.get("use_zarr3", False))
        self._context = ocp.type_handlers.get_ts_context(use_ocdbt=self._use_ocdbt)

    def _open(self, leaf: Any):
        info = ocp.type_handlers.ParamInfo(name=leaf.name, parent_dir=leaf.directory, use_zarr3=self._use_zarr3,
                                           ts_context=self._context)
        spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self._use_ocdbt)
        return ts.open(spec, open=True, context=self._context).result()

    def __call__(self, leaf: Any, shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.Sharding) -> jax.Array:
        dtype = np.dtype(dtype)
        store = self._open(leaf)
        if store.dtype.numpy_dtype != dtype:
            store = ts.cast(store, ts.dtype(dtype.name))
        out = _host_buffer(tuple(shape), dtype)
        # TensorStore decodes chunk by chunk straight into `out` (a view of it, not a copy)
        ts.array(out, copy=False, write=True, context=self._context).write(store).result()
        return jax.device_put(out, sharding)


def _brief(error: BaseException) -> str:
    """The type and first line of an error's root cause (TensorStore's names the file), at most 160 characters
    (its outer messages run to pages)."""
    seen = {id(error)}
    while (inner := error.__cause__ or error.__context__) is not None and id(inner) not in seen:
        error = inner
        seen.add(id(error))
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = text if len(text) <= 160 else text[:157] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
