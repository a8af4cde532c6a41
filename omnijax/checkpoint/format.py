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

Quantised weights (`omnijax.kernels.quant.QuantizedWeight`) are stored as a subtree of their arrays in place of the
leaf (`layers/q_proj/values`, `.../scales`, `.../offsets` for int4), and the manifest's `quantization` key names the
scheme of each such leaf by its dotted path: `{"layers.q_proj": {"scheme": "int4", "group_size": 32, "scale_dtype":
"float16", "offset_dtype": "float16"}}` (schemes `int8` per output channel, `int8_grouped` and `int4` with a group
size). A float checkpoint has no `quantization` key and is unchanged, so the format version stays 1: a reader older
than quantisation refuses a quantised checkpoint by that key's name (it refuses unknown manifest keys), and this one
refuses a scheme it does not know by its name before any parameter is read.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts  # orbax's storage layer

from omnijax._checks import JsonConfig
from omnijax.checkpoint import staged
from omnijax.checkpoint.staged import SAVE_CHUNK_BYTES  # noqa: F401  (the storage chunk bound, named here too)
from omnijax.kernels.quant import Int4Grouped, Int8Grouped, Int8PerChannel, QuantizedWeight, Scheme

FORMAT = "omnijax"
FORMAT_VERSION = 1
MANIFEST = "omnijax.json"
PARAMS_DIR = "params"
QUANTIZATION = "quantization"  # manifest key: dotted parameter path -> its scheme (absent for float checkpoints)
COMMON_KEYS = ("format", "format_version", "model_type", "decoder", "source", QUANTIZATION)
# scheme name in the manifest -> scheme class (the int8 and int4 group sizes are those of `omnijax.kernels.quant`)
SCHEME_NAMES: dict[str, type] = {"int8": Int8PerChannel, "int8_grouped": Int8Grouped, "int4": Int4Grouped}
# The model types omnijax reads, each with the components (encoders, their configs) its manifest may name beside
# the common keys; a component's parameters live in the directory of the same name. Filled by the model families as
# they register (`omnijax.models.family.register`): this layer knows no model type by name.
MODEL_COMPONENTS: dict[str, tuple[str, ...]] = {}


class CheckpointFormatError(ValueError):
    """A directory is not a readable omnijax checkpoint, or its parameters do not match the requested tree."""


def _save_tree(path: Path, tree: dict) -> None:
    """Saves a pure-dict array tree in orbax's PyTree format (what `StandardCheckpointer` reads), as
    `omnijax.checkpoint.staged.write_tree` writes it: a conversion's `StagedArray`s are moved into place, other
    leaves written chunk by chunk from where they lie.

    Four departures from `StandardCheckpointer().save`, all about memory and time, none about what is read back:
    its numpy handler deep-copies every host array before the asynchronous write (here arrays are written from where
    they are); an array is one storage chunk unless told otherwise (here chunks hold at most `SAVE_CHUNK_BYTES`);
    the OCDBT key-value store keeps every compressed chunk in memory until the commit (here each array is a plain
    zarr directory); and chunks are stored uncompressed (zstd cost half of a conversion's time and every load's
    decompression, for a third of the disk on dequantised GGUF weights, less on trained float weights). orbax's own
    save also started jax's backend and its asynchronous machinery: ~0.5 s of a 1.5 s conversion.
    """
    staged.write_tree(path, tree)


def save_params(dst_dir: str | os.PathLike, model_type: str, config: JsonConfig, params_pure_dict: dict,
                source_info: dict[str, Any] | None = None, *,
                components: dict[str, tuple[dict[str, Any], dict]] | None = None) -> Path:
    """Writes `params/` (and each component's directory), then the manifest, into `dst_dir`.

    Args:
        dst_dir: output directory (created if needed; the parameter directories must not exist).
        model_type: omnijax model type (e.g. "qwen2_5_omni").
        config: decoder config; its `dtype` should be the dtype of the parameter arrays.
        params_pure_dict: nested dict of arrays (numpy, numpy memmaps or jax arrays) in the decoder's layout; a leaf
            may be a `QuantizedWeight` (stored as its arrays, its scheme recorded in the manifest).
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
    quantization = quantization_entries(params_pure_dict)
    dst = Path(dst_dir).resolve()
    dst.mkdir(parents=True, exist_ok=True)
    _save_tree(dst / PARAMS_DIR, _unpack_quantized(params_pure_dict))
    for name, (_, tree) in components.items():
        if tree is not None:
            _save_tree(dst / name, tree)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model_type": model_type,
        "decoder": config.to_json(),
        "source": source_info or {},
        **({QUANTIZATION: quantization} if quantization else {}),
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
    read_quantization(manifest, path)  # refuses an unknown scheme by name before any parameter is read
    return manifest


def scheme_to_json(scheme: Scheme) -> dict[str, Any]:
    """A scheme as its manifest entry: `{"scheme": name}` plus `group_size` for the grouped schemes."""
    name = next((n for n, cls in SCHEME_NAMES.items() if type(scheme) is cls), None)
    if name is None:
        raise ValueError(f"no manifest name for the quantisation scheme {scheme!r}")
    return {"scheme": name} if isinstance(scheme, Int8PerChannel) else {"scheme": name, "group_size": scheme.size}


def quantization_entries(tree: dict) -> dict[str, dict[str, Any]]:
    """The manifest's `quantization` entries of a parameter tree: dotted path -> scheme and its float dtypes."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, QuantizedWeight))[0]
    out = {}
    for key, leaf in flat:
        if isinstance(leaf, QuantizedWeight):
            out[".".join(str(k.key) for k in key)] = {
                **scheme_to_json(leaf.scheme), "scale_dtype": np.dtype(leaf.scales.dtype).name,
                **({} if leaf.offsets is None else {"offset_dtype": np.dtype(leaf.offsets.dtype).name})}
    return out


def _unpack_quantized(tree: dict) -> dict:
    """The tree with each `QuantizedWeight` replaced by the dict of its arrays (what is stored)."""
    def unpack(leaf):
        if not isinstance(leaf, QuantizedWeight):
            return leaf
        parts = {"values": leaf.values, "scales": leaf.scales}
        return parts if leaf.offsets is None else {**parts, "offsets": leaf.offsets}
    return jax.tree.map(unpack, tree, is_leaf=lambda x: isinstance(x, QuantizedWeight))


_FLOAT_NAMES = ("float32", "float16", "bfloat16")


def read_quantization(manifest: dict[str, Any], where: Any = MANIFEST) -> dict[str, tuple[Scheme, str, str | None]]:
    """The quantised parameters a manifest names: dotted path -> `(scheme, scale dtype, offset dtype or None)`.

    Raises:
        CheckpointFormatError: the `quantization` entry is not an object of known schemes (the unknown scheme, group
            size or dtype is named with its parameter).
    """
    entries = manifest.get(QUANTIZATION, {})
    if not isinstance(entries, dict):
        raise CheckpointFormatError(f"{where}: {QUANTIZATION!r} must be an object of parameter -> scheme")
    out: dict[str, tuple[Scheme, str, str | None]] = {}
    for name, entry in entries.items():
        if not isinstance(entry, dict) or entry.get("scheme") not in SCHEME_NAMES:
            found = entry.get("scheme") if isinstance(entry, dict) else entry
            raise CheckpointFormatError(f"{where}: parameter {name!r} is quantised with the scheme {found!r}, which "
                                        f"this omnijax does not know (known: {sorted(SCHEME_NAMES)})")
        cls = SCHEME_NAMES[entry["scheme"]]
        allowed = {"scheme", "scale_dtype"} | ({"group_size"} if cls is not Int8PerChannel else set()) \
            | ({"offset_dtype"} if cls is Int4Grouped else set())
        if set(entry) != allowed:
            raise CheckpointFormatError(f"{where}: parameter {name!r} ({entry['scheme']}) has the keys "
                                        f"{sorted(entry)}, expected {sorted(allowed)}")
        try:
            scheme = cls() if cls is Int8PerChannel else cls(entry["group_size"])
        except (TypeError, ValueError) as e:
            raise CheckpointFormatError(f"{where}: parameter {name!r}: {e}") from e
        dtypes = [entry["scale_dtype"], entry.get("offset_dtype")]
        if any(d is not None and d not in _FLOAT_NAMES for d in dtypes):
            raise CheckpointFormatError(f"{where}: parameter {name!r}: scale/offset dtypes {dtypes} must be among "
                                        f"{list(_FLOAT_NAMES)}")
        out[name] = (scheme, dtypes[0], dtypes[1])
    return out


def quantized_abstract(abstract_pure_dict: dict, quantization: dict[str, tuple[Scheme, str, str | None]]) -> dict:
    """The target tree of a quantised checkpoint: each quantised float leaf `[..., in, out]` replaced by the shapes
    and dtypes of its stored arrays (`values`, `scales`, `offsets`), for `load_params`.

    Raises:
        CheckpointFormatError: a quantised name that is no parameter, or a group size that does not divide its input
            width.
    """
    flat = {".".join(str(k.key) for k in key): leaf
            for key, leaf in jax.tree_util.tree_flatten_with_path(abstract_pure_dict)[0]}
    missing = sorted(set(quantization) - set(flat))
    if missing:
        raise CheckpointFormatError(f"quantised parameters {missing} are not parameters of the model")

    def target(key, leaf):
        name = ".".join(str(k.key) for k in key)
        if name not in quantization:
            return leaf
        scheme, scale_dtype, offset_dtype = quantization[name]
        if len(leaf.shape) < 2:
            raise CheckpointFormatError(f"quantised parameter {name!r} of shape {tuple(leaf.shape)} is not a matrix")
        *lead, rows, cols = leaf.shape
        g = scheme.group_size(rows)
        if rows % g or (scheme.bits == 4 and rows % 2):
            raise CheckpointFormatError(f"quantised parameter {name!r}: group size {g} does not divide its input "
                                        f"width {rows}")
        parts = {"values": jax.ShapeDtypeStruct((*lead, rows // 2 if scheme.bits == 4 else rows, cols),
                                                np.uint8 if scheme.bits == 4 else np.int8),
                 "scales": jax.ShapeDtypeStruct((*lead, rows // g, cols), jax.numpy.dtype(scale_dtype))}
        if offset_dtype is not None:
            parts["offsets"] = jax.ShapeDtypeStruct((*lead, rows // g, cols), jax.numpy.dtype(offset_dtype))
        return parts

    return jax.tree_util.tree_map_with_path(target, abstract_pure_dict)


def as_quantized(tree: dict, quantization: dict[str, tuple[Scheme, str, str | None]]) -> dict:
    """A restored tree with each quantised parameter's arrays put back together as a `QuantizedWeight`."""
    def walk(node: Any, prefix: str) -> Any:
        if prefix[:-1] in quantization:
            return QuantizedWeight(node["values"], node["scales"], node.get("offsets"), quantization[prefix[:-1]][0])
        return {k: walk(v, f"{prefix}{k}.") for k, v in node.items()} if isinstance(node, dict) else node
    return walk(tree, "")


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
