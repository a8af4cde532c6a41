"""GGUF (llama.cpp's file format) -> omnijax checkpoint: `convert_gguf(path, dst)`, also reached through
`omnijax.convert.convert_checkpoint` and `omnijax convert MODEL.gguf DST` when SRC is a `.gguf` file.

Needs the `gguf` package (llama.cpp's own reader, the `omnijax[gguf]` extra). What is read:

- **Architectures** (`general.architecture`): `llama` (Llama and Mistral, which llama.cpp writes as llama; its Q/K
  rows are permuted back from llama.cpp's rotary layout), `qwen2` (q/k/v biases), `qwen3` (q/k norm) and `qwen3moe`
  (q/k norm, every layer a mixture of experts; written as model type `qwen3`). Others are refused by name.
- **Config** from the `{arch}.*` metadata: `block_count`, `embedding_length`, `feed_forward_length`,
  `attention.head_count(_kv)`, `attention.key_length` (else width / heads), `rope.freq_base`,
  `attention.layer_norm_rms_epsilon`, `expert_count`, `expert_used_count`, `expert_feed_forward_length`; the vocabulary
  from `tokenizer.ggml.tokens`; tied embeddings when `output.weight` is absent; the end-of-answer ids from
  `tokenizer.ggml.eos_token_id` (and `eot_token_id`). Every other `{arch}.*` key is refused unless it holds the value
  the decoder implements (e.g. `rope.scaling.type` "none", `rope.dimension_count` equal to the head width).
- **Tensors**: every tensor dequantised (`gguf.quants.dequantize`) and cast to the requested dtype; the quantisation
  types of `SUPPORTED_TYPES` are read, any other is refused by name. llama.cpp's names are mapped onto the Hugging
  Face names the safetensors converter reads (`blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`,
  stacked experts split per expert), and the same table and streaming loop fill the decoder's arrays.
- **Tokenizer**: `tokenizer.json` and `tokenizer_config.json` built from the `tokenizer.*` metadata
  (`omnijax.convert.gguf_tokenizer`), with the chat template of `tokenizer.chat_template`.

Everything is validated from the header before any tensor data is read: the magic, the header's extent, every
tensor's type and byte range inside the file (a truncated file is refused), the config values
(`omnijax.models.config.validate_config`), and every tensor's name and shape against the config. Output is written
atomically, as `convert_checkpoint` writes it: a refusal or failure leaves no trace in DST.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np

from omnijax.checkpoint import loop as streaming
from omnijax.checkpoint import name_tables as tables
from omnijax.checkpoint.safetensors import SafetensorsCheckpoint
from omnijax.errors import (
    CheckpointError,
    ConfigError,
    ConvertError,
    TensorError,
    UnexpectedTensorError,
    UnsupportedConfigError,
    UnsupportedModelError,
)
from omnijax.models.config import DecoderConfig, validate_config
from omnijax.models.qwen2_5_omni import convert as shared

__all__ = ["ARCHITECTURES", "GGUFFile", "INSTALL_HINT", "SUPPORTED_TYPES", "config_from_gguf", "is_gguf",
           "read_gguf"]

GGUF_MAGIC = b"GGUF"
INSTALL_HINT = "pip install 'omnijax[gguf]'"
# Quantisation types read (each covered by tests/convert/test_gguf.py against transformers' GGUF loader).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K")


@dataclasses.dataclass(frozen=True)
class Arch:
    """How one GGUF architecture maps onto the decoder."""

    model_type: str  # the omnijax model type written to the manifest
    permuted_qk: bool  # llama.cpp permuted the q/k rows for its rotary layout (undone here)
    qkv_bias: bool
    qk_norm: bool
    moe: bool = False


ARCHITECTURES = {
    "llama": Arch("llama", permuted_qk=True, qkv_bias=False, qk_norm=False),
    "qwen2": Arch("qwen2", permuted_qk=False, qkv_bias=True, qk_norm=False),
    "qwen3": Arch("qwen3", permuted_qk=False, qkv_bias=False, qk_norm=True),
    "qwen3moe": Arch("qwen3", permuted_qk=False, qkv_bias=False, qk_norm=True, moe=True),
}

# `{arch}.` keys read into the config, and those that do not change the forward.
_READ = {"block_count", "embedding_length", "feed_forward_length", "attention.head_count", "attention.head_count_kv",
         "attention.key_length", "attention.value_length", "rope.freq_base", "attention.layer_norm_rms_epsilon",
         "vocab_size", "rope.dimension_count", "expert_count", "expert_used_count", "expert_feed_forward_length"}
_INERT = {"context_length", "rope.scaling.original_context_length", "rope.scaling.finetuned"}
# Keys accepted only with the value the decoder implements.
_NEUTRAL = {"rope.scaling.type": ("none",), "rope.scaling.factor": (1.0, 0.0), "expert_shared_count": (0,),
            "expert_weights_norm": (True,), "expert_gating_func": (1,), "attention.causal": (True,),
            "use_parallel_residual": (False,)}
_MOE_KEYS = ("expert_count", "expert_used_count", "expert_feed_forward_length")

# llama.cpp tensor name (below `blk.N.` for layer tensors) -> Hugging Face name (below `model.layers.N.`).
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"attn_{p}.{kind}": f"self_attn.{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias")},
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    **{f"ffn_{p}.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
    "ffn_gate_inp.weight": "mlp.gate.weight",
}
_EXPERT_NAMES = {f"ffn_{p}_exps.weight": f"mlp.experts.{{e}}.{p}_proj.weight" for p in ("gate", "up", "down")}
_LAYER = re.compile(r"blk\.(0|[1-9][0-9]*)\.(.+)\Z")


class GGUFError(CheckpointError):
    """A GGUF file that cannot be read: not GGUF, truncated, or malformed (the message names the file)."""


def _gguf_module():
    """The `gguf` package, or a ConvertError saying how to install it."""
    try:
        import gguf  # optional (omnijax[gguf]): only GGUF conversion needs it
    except ImportError as e:
        raise ConvertError(f"reading GGUF files needs the 'gguf' package (llama.cpp's reader): {INSTALL_HINT}") from e
    return gguf


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether `path` is a file that names itself GGUF: a `.gguf` suffix or the GGUF magic in its first bytes."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def _make_reader_class(gguf):
    """A `gguf.GGUFReader` that checks every tensor's type and byte range before mapping it, so an unknown
    quantisation type or a file cut short is named (the stock reader fails with an enum or reshape error)."""

    class CheckedReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            known = {int(t) for t in gguf.GGMLQuantizationType}
            size = len(self.data)
            for field in fields:
                name = str(bytes(field.parts[1]), encoding="utf-8")
                raw = int(field.parts[4][0])
                dims = [int(d) for d in field.parts[3]]
                if raw not in known:
                    raise _UnknownType(name, raw)
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(raw)]
                n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
                if dims and dims[0] % block:
                    raise _Malformed(f"tensor {name!r}: its rows of {dims[0]} values are not whole "
                                     f"{gguf.GGMLQuantizationType(raw).name} blocks of {block}")
                end = int(start_offs) + int(field.parts[5][0]) + n_elements * type_size // block
                if end > size:
                    raise _Truncated(f"tensor {name!r} ends at byte {end} but the file has {size} bytes")
            super()._build_tensors(start_offs, fields)

    return CheckedReader


class _UnknownType(Exception):
    def __init__(self, tensor: str, raw: int):
        self.tensor, self.raw = tensor, raw
        super().__init__(tensor, raw)


class _Truncated(Exception):
    pass


class _Malformed(Exception):
    pass


@dataclasses.dataclass
class GGUFFile:
    """A GGUF file's header, read and checked: metadata (key -> Python value) and tensors (name -> reader tensor)."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, Any]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture"))

    def arch_keys(self) -> dict[str, Any]:
        """The `{arch}.*` metadata with the prefix removed."""
        prefix = self.architecture + "."
        return {k[len(prefix):]: v for k, v in self.metadata.items() if k.startswith(prefix)}


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Reads and checks a GGUF file's header (metadata and tensor table); no tensor data is read.

    Raises:
        GGUFError: not a GGUF file (bad magic), a header or tensor data cut short, or a malformed header.
        UnsupportedConfigError: a tensor of a quantisation type outside `SUPPORTED_TYPES` (named with the tensor).
    """
    gguf = _gguf_module()
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (its first bytes are {magic!r}, a GGUF file starts with "
                        f"{GGUF_MAGIC!r})")
    if size < 24:
        raise GGUFError(f"{path}: truncated: {size} bytes, shorter than a GGUF header")
    try:
        reader = _make_reader_class(gguf)(path, "r")
    except _UnknownType as e:
        raise UnsupportedConfigError(f"tensor {e.tensor!r} type", e.raw, "an unknown GGML quantisation type "
                                     f"(the types read are {', '.join(SUPPORTED_TYPES)})") from None
    except _Truncated as e:
        raise GGUFError(f"{path}: truncated: {e}") from None
    except _Malformed as e:
        raise GGUFError(f"{path}: malformed: {e}") from None
    except (IndexError, ValueError, KeyError, UnicodeDecodeError, OverflowError, MemoryError) as e:
        # the header's strings, arrays or tensor table run past the end of the file, or hold nonsense
        raise GGUFError(f"{path}: truncated or malformed GGUF header ({type(e).__name__}: {e})") from None
    metadata = {}
    for key, field in reader.fields.items():
        try:
            metadata[key] = field.contents()
        except (ValueError, UnicodeDecodeError) as e:
            raise GGUFError(f"{path}: metadata {key!r} cannot be read: {e}") from None
    tensors = {t.name: t for t in reader.tensors}
    for name, t in tensors.items():
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise UnsupportedConfigError(f"tensor {name!r} type", t.tensor_type.name,
                                         "quantisation type not read (the types read are "
                                         f"{', '.join(SUPPORTED_TYPES)})")
    return GGUFFile(path, metadata, tensors)


# ---------------------------------------------------------------------------------------------------------- config


def _int(meta: Mapping[str, Any], key: str, scope: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if value is None:
        raise ConfigError(f"GGUF metadata lacks {scope}.{key}")
    if isinstance(value, list):
        raise UnsupportedConfigError(f"{scope}.{key}", value, "per-layer values are not implemented (one value for "
                                     "every layer)")
    return value


def _token_id(meta: Mapping[str, Any], key: str) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}")
    return None if value is None else int(value)


def config_from_gguf(file: GGUFFile, *, dtype: str = "float32") -> tuple[str, DecoderConfig]:
    """`(omnijax model type, DecoderConfig)` from a GGUF file's metadata and tensor table (no tensor data).

    Raises:
        UnsupportedModelError: an architecture outside `ARCHITECTURES`.
        UnsupportedConfigError: a metadata key that changes the forward in a way the decoder does not implement.
        ConfigError: a missing or out-of-range value (named).
    """
    arch_name = file.architecture
    if arch_name not in ARCHITECTURES:
        raise UnsupportedModelError(f"{file.path}: GGUF architecture {arch_name!r} is not implemented; the "
                                    f"architectures read are {', '.join(ARCHITECTURES)}")
    arch, meta, scope = ARCHITECTURES[arch_name], file.arch_keys(), arch_name
    for key, value in meta.items():
        if key in _READ or key in _INERT:
            continue
        if key in _NEUTRAL:
            if value not in _NEUTRAL[key]:
                raise UnsupportedConfigError(f"{scope}.{key}", value, "not implemented by the decoder")
            continue
        raise UnsupportedConfigError(f"{scope}.{key}", value, f"not read by omnijax's {arch_name} decoder")
    if "rope_freqs.weight" in file.tensors:
        raise UnsupportedConfigError("tensor 'rope_freqs.weight'", "present", "RoPE frequency factors (Llama-3.1 "
                                     "style scaling stored as a tensor) are not read from GGUF files yet")
    if not arch.moe and any(k in meta for k in _MOE_KEYS):
        key = next(k for k in _MOE_KEYS if k in meta)
        raise UnsupportedConfigError(f"{scope}.{key}", meta[key], f"experts are not part of the {arch_name} decoder")
    tokens = file.metadata.get("tokenizer.ggml.tokens")
    vocab = meta.get("vocab_size", len(tokens) if isinstance(tokens, list) else None)
    if vocab is None:
        raise ConfigError(f"GGUF metadata sets neither {scope}.vocab_size nor tokenizer.ggml.tokens")
    hidden, heads = _int(meta, "embedding_length", scope), _int(meta, "attention.head_count", scope)
    head_dim = _int(meta, "attention.key_length", scope, hidden // heads if heads else 0)
    if meta.get("attention.value_length", head_dim) != head_dim:
        raise UnsupportedConfigError(f"{scope}.attention.value_length", meta["attention.value_length"],
                                     f"value heads narrower or wider than key heads ({head_dim}) are not implemented")
    if meta.get("rope.dimension_count", head_dim) != head_dim:
        raise UnsupportedConfigError(f"{scope}.rope.dimension_count", meta["rope.dimension_count"],
                                     f"partial rotary embeddings are not implemented (head width {head_dim})")
    eos = [i for i in (_token_id(file.metadata, "eos_token_id"), _token_id(file.metadata, "eot_token_id"))
           if i is not None]
    moe: dict[str, Any] = {}
    if arch.moe:
        moe = dict(num_experts=_int(meta, "expert_count", scope), num_experts_per_tok=_int(meta, "expert_used_count",
                   scope), moe_intermediate_size=_int(meta, "expert_feed_forward_length", scope),
                   norm_topk_prob=True)
    try:
        config = DecoderConfig(
            vocab_size=vocab, hidden_size=hidden,
            intermediate_size=_int(meta, "feed_forward_length", scope, 0 if arch.moe else None),
            num_layers=_int(meta, "block_count", scope), num_heads=heads,
            num_kv_heads=_int(meta, "attention.head_count_kv", scope, heads), head_dim=head_dim,
            rope_theta=meta.get("rope.freq_base", 10000.0), mrope_section=None,
            rms_norm_eps=_int(meta, "attention.layer_norm_rms_epsilon", scope), qkv_bias=arch.qkv_bias,
            qk_norm=arch.qk_norm, tie_embeddings="output.weight" not in file.tensors, dtype=dtype,
            eos_token_ids=tuple(dict.fromkeys(eos)), **moe)
        ids = {f"tokenizer.ggml.{k}": _token_id(file.metadata, k) for k in ("bos_token_id", "padding_token_id",
                                                                             "unknown_token_id")}
        validate_config(config, ids)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{file.path}: {e}") from e
    if isinstance(tokens, list) and len(tokens) != config.vocab_size:
        raise ConfigError(f"{file.path}: tokenizer.ggml.tokens lists {len(tokens)} tokens but the vocabulary has "
                          f"{config.vocab_size} rows ({scope}.vocab_size)")
    return arch.model_type, config


# --------------------------------------------------------------------------------------------------------- tensors


@dataclasses.dataclass(frozen=True)
class _Info:
    shape: tuple[int, ...]
    dtype: str


class GGUFTensors:
    """The GGUF tensors under their Hugging Face names, dequantised to float32 on `read` (the interface of
    `omnijax.checkpoint.safetensors.SafetensorsCheckpoint` that the conversion loop uses)."""

    def __init__(self, file: GGUFFile, config: DecoderConfig, permuted_qk: bool):
        self.file, self.config, self.permuted_qk = file, config, permuted_qk
        self.directory = file.path.parent
        self.files = [file.path]
        self._source: dict[str, tuple[str, int | None]] = {}  # HF name -> (GGUF name, expert or None)
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._cache: tuple[str, np.ndarray] | None = None
        for name, tensor in file.tensors.items():
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # ggml lists the fastest axis first
            if name in _GLOBAL_NAMES:
                self._add(_GLOBAL_NAMES[name], name, None, shape)
                continue
            m = _LAYER.match(name)
            inner = m.group(2) if m else None
            if inner in _LAYER_NAMES:
                self._add(f"model.layers.{m.group(1)}.{_LAYER_NAMES[inner]}", name, None, shape)
            elif inner in _EXPERT_NAMES and len(shape) == 3:
                for e in range(shape[0]):
                    hf = f"model.layers.{m.group(1)}." + _EXPERT_NAMES[inner].replace("{e}", str(e))
                    self._add(hf, name, e, shape[1:])
            else:
                raise UnexpectedTensorError(f"{file.path}: GGUF tensor {name!r} (shape {shape}) maps to no parameter "
                                            f"of the {file.architecture} decoder")

    def _add(self, hf: str, name: str, expert: int | None, shape: tuple[int, ...]) -> None:
        self._source[hf] = (name, expert)
        self._shapes[hf] = shape

    def names(self) -> list[str]:
        return list(self._source)

    def info(self, name: str) -> _Info:
        return _Info(self._shapes[name], "F32")

    def gguf_name(self, name: str) -> str:
        return self._source[name][0]

    def read(self, name: str) -> np.ndarray:
        """One tensor in the Hugging Face layout, float32 (the q/k rows of llama.cpp's rotary layout put back)."""
        gguf = _gguf_module()
        source, expert = self._source[name]
        if self._cache is not None and self._cache[0] == source:
            array = self._cache[1]
        else:
            self._cache = None  # the previous tensor goes before this one is dequantised
            tensor = self.file.tensors[source]
            try:
                array = _dequantize(gguf, tensor.data, tensor.tensor_type)
            except (ValueError, NotImplementedError) as e:
                raise TensorError(f"{self.file.path}: GGUF tensor {source!r} ({tensor.tensor_type.name}) cannot be "
                                  f"dequantised: {e}") from e
            array = array.reshape(tuple(int(d) for d in reversed(tensor.shape.tolist())))
            if expert is not None:  # the other experts of this tensor are read next
                self._cache = (source, array)
        array = array if expert is None else array[expert]
        if self.permuted_qk and (".attn_q." in source or ".attn_k." in source):
            heads = self.config.num_heads if ".attn_q." in source else self.config.num_kv_heads
            array = unpermute_rows(array, heads)
        return array


DEQUANTISE_BLOCK_BYTES = 4 * 1024 * 1024  # float32 bytes dequantised at once


def _dequantize(gguf: Any, data: np.ndarray, tensor_type: Any) -> np.ndarray:
    """`gguf.quants.dequantize` of a tensor's stored rows, a block of rows at a time into one float32 array: its
    temporaries (several times the block in float32) stay a few MB instead of several times the tensor."""
    if data.ndim < 2 or data.shape[0] < 2:
        return np.asarray(gguf.quants.dequantize(data, tensor_type), dtype=np.float32)
    first = np.asarray(gguf.quants.dequantize(data[:1], tensor_type), dtype=np.float32)
    out = np.empty((data.shape[0], *first.shape[1:]), np.float32)
    step = max(1, DEQUANTISE_BLOCK_BYTES // max(first.nbytes, 1))
    for start in range(0, data.shape[0], step):
        out[start:start + step] = gguf.quants.dequantize(data[start:start + step], tensor_type)
    return out


def unpermute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation: within each head llama.cpp stores the rotary pairs' first halves
    interleaved with their second halves; the Hugging Face layout keeps the two halves contiguous."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _named(error: TensorError, tensors: GGUFTensors) -> TensorError:
    """`error` with each Hugging Face tensor name it quotes followed by the GGUF tensor it was read from."""
    message = str(error)
    for hf in sorted(tensors.names(), key=len, reverse=True):
        if repr(hf) in message:
            message = message.replace(repr(hf), f"{tensors.gguf_name(hf)!r} (as {hf!r})")
    return type(error)(f"{tensors.file.path}: {message}")


def convert_params(file: GGUFFile, *, dtype: str, staging_dir: Path, progress: bool = True,
                   log: Callable[[str], None] = streaming.stderr
                   ) -> tuple[str, DecoderConfig, dict[str, Any], dict[str, Any]]:
    """Converts a checked GGUF file's tensors into memory-mapped arrays in the decoder's layout.

    Returns:
        `(model type, config, params, source info)`.

    Raises:
        UnexpectedTensorError, MissingTensorError, ShapeMismatchError: the tensors disagree with the metadata (checked
            from the header before any data is read; the GGUF tensor is named).
    """
    model_type, config = config_from_gguf(file, dtype=dtype)
    tensors = GGUFTensors(file, config, ARCHITECTURES[file.architecture].permuted_qk)
    component = shared.decoder_component(config)
    try:
        tables.plan_conversion(tensors.names(), {n: tensors.info(n).shape for n in tensors.names()}, [component])
    except TensorError as e:
        raise _named(e, tensors) from None
    ckpt = cast(SafetensorsCheckpoint, tensors)  # the loop reads names(), info() and read() only
    trees, plan, _ = streaming.convert_components(ckpt, [component], dtype=dtype, staging_dir=staging_dir,
                                                  progress=progress)
    types: dict[str, int] = {}
    for t in file.tensors.values():
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    info = {"format": "gguf", "gguf_architecture": file.architecture, "tensors_converted": len(file.tensors),
            "source_dtypes": dict(sorted(types.items())), "skipped": {}, "encoders_converted": [],
            "lm_head": "tied to embed" if config.tie_embeddings else "output.weight"}
    return model_type, config, trees["decoder"], info

