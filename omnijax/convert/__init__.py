"""Hugging Face safetensors checkpoint (or GGUF file) -> omnijax checkpoint conversion.

A SRC that is a `.gguf` file (llama.cpp's format) goes to `convert_gguf` (`omnijax/convert/gguf.py`: config from the
metadata, tensors dequantised, tokenizer built from the metadata); the rest of this docstring is about checkpoint
directories, whose destination and atomicity rules GGUF conversion shares.

`convert_checkpoint(src, dst)` is the Python entry point; `omnijax convert SRC DST` (or `omnijax-convert`, `python -m
omnijax.convert`) is the command line (`omnijax/convert/__main__.py`). The model type is detected from
`SRC/config.json`; every model converter module exposes `convert_params(ckpt, hf_config, *, dtype, staging_dir,
progress, log)`, `model_type_for(hf_config)` and `config_from_hf(hf_config, *, dtype)` (run first, so an unsupported
config is refused before tensors are read).

Output is written into a temporary directory next to DST and renamed into place only after everything succeeded:
a failure leaves neither a half-written DST nor the temporary directory, and a pre-existing DST is untouched.

Config values are checked before any tensor is read (`omnijax.models.config.validate_config`, run by every family's
`config_from_hf` and again here): positive sizes and head counts, heads in whole groups, finite positive `rope_theta`
and `rms_norm_eps`, MoE counts, and bos / eos / pad ids (a `generation_config.json` eos included) and the family's
special ids (placeholders, modality and chat markers, from `config.json` and the tokenizer files:
`omnijax.models.family.Family.source_token_ids`) inside the vocabulary; a bad value is a `ConfigValueError` naming
it, its value and the allowed range, and DST is not touched.

A DST that is a symbolic link is refused, with or without `--force`: replacing it would either write through the
link into a directory elsewhere or silently turn the link into a directory. Pass the link's target (or remove the
link) instead. Links in DST's parent directories are followed as usual.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from omnijax.checkpoint import format as checkpoint
from omnijax.checkpoint import loop as streaming
from omnijax.checkpoint.safetensors import SafetensorsCheckpoint
from omnijax.convert import gguf as gguf_convert
from omnijax.convert import gguf_tokenizer
from omnijax.convert import quantize as quantization
from omnijax.convert.quantize import QuantizeOptions
from omnijax.errors import ConfigError, ConfigValueError, ConvertError, DestinationError, UnsupportedModelError
from omnijax.models.config import DecoderConfig, validate_config
from omnijax.models.family import Family
from omnijax.models.qwen2_5_omni.convert import param_shapes  # the decoder tree every family shares
from omnijax.models.registry import ALL_FAMILIES, family_for_hf

__all__ = ["convert_checkpoint", "convert_gguf", "ConvertError", "DTYPES", "QuantizeOptions", "SUPPORTED_MODEL_TYPES",
           "TOKENIZER_FILES"]

DTYPES = ("float32", "bfloat16")
# Hugging Face model_type -> converter module (each family's `converter`).
CONVERTERS = {hf_type: family.converter for family in ALL_FAMILIES for hf_type in family.hf_model_types}
# Model types recognised but not converted, with the reason.
NOT_SUPPORTED_YET: dict[str, str] = {}
SUPPORTED_MODEL_TYPES = tuple(CONVERTERS)
# Top-level config.json keys transformers' `save_pretrained` writes that do not change the forward: provenance
# (`_model_name_or_path` is a GGUF file's `general.name`) and the unknown-token id. Dropped before the family's
# whitelist of attributes refuses unknown keys (every key that changes the forward is still refused there).
FORWARD_NEUTRAL_KEYS = frozenset({"_model_name_or_path", "_name_or_path", "_commit_hash", "unk_token_id"})
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.json", "chat_template.jinja", "generation_config.json",
                   "preprocessor_config.json")


def read_hf_config(src: Path) -> dict:
    """Parses `src/config.json`."""
    path = src / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found: SRC must be a Hugging Face checkpoint directory")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot parse: {e}") from e
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return config


def converter_for(hf_config: dict, path: Path) -> ModuleType:
    """The converter module for a parsed config's `model_type`."""
    model_type = hf_config.get("model_type")
    if model_type in CONVERTERS:
        return CONVERTERS[model_type]
    if model_type in NOT_SUPPORTED_YET:
        raise UnsupportedModelError(f"{path}: {NOT_SUPPORTED_YET[model_type]}")
    raise UnsupportedModelError(
        f"{path}: model_type {model_type!r} is not supported; supported types: {', '.join(SUPPORTED_MODEL_TYPES)}")


def _generation_eos(src: Path, config: DecoderConfig) -> tuple[int, ...] | None:
    """The end-of-answer tokens of `generation_config.json` when the checkpoint ships one (None otherwise), checked
    to lie in the vocabulary of `config`."""
    path = src / "generation_config.json"
    if not path.is_file():
        return None
    try:
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise ConfigError(f"{path}: cannot parse: {e}") from e
    if eos is None:
        return None
    ids = [eos] if isinstance(eos, int) else eos
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"{path}: eos_token_id must be an int or a list of ints, got {eos!r}")
    try:
        validate_config(config, {"eos_token_id": eos})
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from e
    return tuple(ids)


def _destination(dst: str | os.PathLike) -> Path:
    """DST as an absolute path whose parent directories are resolved but whose last component is kept as given (a
    symbolic link stays a link, so that `_check_destination` can refuse it)."""
    path = Path(os.path.abspath(dst))
    return path.parent.resolve() / path.name


def _check_destination(src: Path, dst: Path, force: bool) -> None:
    if dst.is_symlink():
        raise DestinationError(f"destination {dst} is a symbolic link (to {os.readlink(dst)}); omnijax-convert does "
                               "not write through or replace links, even with --force: pass the link's target as "
                               "DST, or remove the link")
    if dst == src or dst.is_relative_to(src) or src.is_relative_to(dst):
        raise DestinationError(f"destination {dst} overlaps the source {src}")
    if os.path.lexists(dst) and not force:
        if not dst.is_dir():
            raise DestinationError(f"destination {dst} exists and is not a directory (pass --force to replace it)")
        if any(dst.iterdir()):
            raise DestinationError(f"destination {dst} exists and is not empty (pass --force to replace it)")


def _validated(config: DecoderConfig, path: Path, token_ids: dict | None = None) -> DecoderConfig:
    """`validate_config` (which every family's `config_from_hf` runs too) with the family's special `token_ids`,
    its refusal naming `path` (a `ConfigValueError` stays one, its attribute prefixed with `path`)."""
    try:
        return validate_config(config, token_ids)
    except ConfigValueError as e:
        raise ConfigValueError(f"{path}: {e.attribute}", e.value, e.allowed) from e
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from e


def _source_token_ids(family: Family | None, hf_config: dict, src: Path) -> dict:
    """The family's special ids a conversion of `src` records (from `config.json` and the tokenizer files), read
    before any tensor."""
    if family is None:
        return {}
    try:
        return family.source_token_ids(hf_config, src)
    except ConfigValueError as e:
        raise ConfigValueError(f"{src}: {e.attribute}", e.value, e.allowed) from e
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{src}: special token ids (config.json and the tokenizer files): {e}") from e


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        path.unlink()


def _swap_into_place(tmp: Path, dst: Path) -> None:
    """Renames `tmp` to `dst`, replacing whatever `dst` was only once the rename succeeded."""
    if not os.path.lexists(dst):
        os.rename(tmp, dst)
        return
    old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(old, dst)
        raise
    _remove(old)


def _write_atomically(dst: Path, write: Callable[[Path], None]) -> Path:
    """Runs `write(tmp)` into a fresh temporary directory beside `dst` and renames it into place; on any failure the
    temporary directory (and any parent directory this call created) is removed and `dst` is untouched."""
    created = next((p for p in reversed(dst.parents) if not p.exists()), None)  # topmost parent this call creates
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        _swap_into_place(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created is not None and not os.path.lexists(dst):
            shutil.rmtree(created, ignore_errors=True)
        raise
    return dst


def _without_bookkeeping(hf_config: dict) -> dict:
    """The config without the top-level keys transformers' `save_pretrained` writes that do not change the forward
    (`FORWARD_NEUTRAL_KEYS`); every other key still goes through the family's whitelist."""
    return {k: v for k, v in hf_config.items() if k not in FORWARD_NEUTRAL_KEYS}


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, dtype: str = "float32", force: bool = False,
                       progress: bool = True, log: Callable[[str], None] | None = None,
                       quantize: QuantizeOptions | None = None) -> Path:
    """Converts a Hugging Face safetensors checkpoint directory, or a GGUF file, into an omnijax checkpoint.

    Args:
        src: directory with `config.json` and `model.safetensors` or `model.safetensors.index.json` + shards; or a
            `.gguf` file (llama.cpp's format; see `convert_gguf`).
        dst: output directory (see `omnijax/checkpoint/format.py` for its layout). Must not exist or be empty unless
            `force`; with `force` an existing DST is replaced only after the conversion succeeded. Never a symbolic
            link (refused, see the module docstring).
        dtype: parameter dtype, "float32" or "bfloat16".
        force: replace a non-empty DST.
        progress: show a progress bar over tensors on stderr.
        log: callable receiving one-line notes (skipped tensors); default prints to stderr.
        quantize: weight quantisation (`omnijax.convert.quantize`); None or all off: float weights.

    Returns:
        The absolute path of the written checkpoint.

    Raises:
        ConvertError: any anticipated failure (bad input, unsupported config, a quantisation option that does not
            apply, destination problems); nothing is left behind.
    """
    if dtype not in DTYPES:
        raise ConvertError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    quantize = quantize or QuantizeOptions()
    if Path(src).is_file() and gguf_convert.is_gguf(src):
        return convert_gguf(src, dst, dtype=dtype, force=force, progress=progress, log=log, quantize=quantize)
    src, dst = Path(src).resolve(), _destination(dst)
    if not src.is_dir():
        raise ConvertError(f"source {src} is not a directory")
    _check_destination(src, dst, force)
    hf_config = _without_bookkeeping(read_hf_config(src))
    converter = converter_for(hf_config, src / "config.json")
    # Refuses an unsupported config, or a value out of range, before any tensor is read.
    config = _validated(converter.config_from_hf(hf_config, dtype=dtype), src / "config.json")
    family = family_for_hf(hf_config.get("model_type"))
    config = _validated(config, src, _source_token_ids(family, hf_config, src))
    eos = _generation_eos(src, config)
    scheme = quantization.check(quantize, param_shapes(config), gguf=False)  # before any tensor is read

    def write(tmp: Path) -> None:
        ckpt = SafetensorsCheckpoint(src)
        staging = tmp / ".staging"
        kwargs = {} if log is None else {"log": log}
        final, params, info, extras = converter.convert_params(ckpt, hf_config, dtype=dtype, staging_dir=staging,
                                                               progress=progress, **kwargs)
        written = {name: entry for name, (entry, _) in extras.items()}  # the manifest entries beside the decoder
        final = _validated(final if eos is None else final.replace(eos_token_ids=eos), src / "config.json",
                           family.manifest_token_ids(written) if family is not None else None)
        source_info = {"path": str(src), "hf_model_type": hf_config.get("model_type"),
                       "files": [p.name for p in ckpt.files], "dtype": dtype, **info}
        if quantize.active:
            params, source_info["quantization"] = quantization.apply(params, quantize, scheme, final,
                                                                     log=log or streaming.stderr)
        checkpoint.save_params(tmp, converter.model_type_for(hf_config), final, params, source_info,
                               components=extras)
        del params
        shutil.rmtree(staging)
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)

    return _write_atomically(dst, write)


def convert_gguf(src: str | os.PathLike, dst: str | os.PathLike, *, dtype: str = "float32", force: bool = False,
                 progress: bool = True, log: Callable[[str], None] | None = None,
                 quantize: QuantizeOptions | None = None) -> Path:
    """Converts a GGUF file (llama.cpp's format) into an omnijax checkpoint with its tokenizer.

    What is read, and how, is in `omnijax/convert/gguf.py`. The file's header (magic, extent, every tensor's type
    and byte range), the config built from its metadata and every tensor's name and shape are checked before any
    tensor data is read; the output is written atomically as `convert_checkpoint` writes it. Needs the `gguf`
    package (`pip install 'omnijax[gguf]'`).

    Args:
        src: the `.gguf` file.
        dst: output directory (the rules of `convert_checkpoint`).
        dtype: parameter dtype, "float32" or "bfloat16"; every tensor is dequantised to it.
        force: replace a non-empty DST.
        progress: show a progress bar over tensors on stderr.
        log: callable receiving one-line notes; default prints to stderr.
        quantize: weight quantisation, `keep_quantized` included (`omnijax.convert.quantize`); None: float weights.

    Returns:
        The absolute path of the written checkpoint.

    Raises:
        ConvertError: a quantisation option that does not apply, a file that is not GGUF, cut short or malformed
            (`CheckpointError`), an unimplemented architecture (`UnsupportedModelError`), quantisation type or
            metadata value (`UnsupportedConfigError`), a tensor that disagrees with the metadata (`TensorError`), the
            `gguf` package missing, or a destination problem; nothing is left behind.
    """
    if dtype not in DTYPES:
        raise ConvertError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    note = log if log is not None else streaming.stderr
    src, dst = Path(src).resolve(), _destination(dst)
    if not src.is_file():
        raise ConvertError(f"source {src} is not a file")
    _check_destination(src, dst, force)
    file = gguf_convert.read_gguf(src)
    model_type, config = gguf_convert.config_from_gguf(file, dtype=dtype)  # refuses before any tensor data is read
    quantize = quantize or QuantizeOptions()
    scheme = quantization.check(quantize, param_shapes(config), gguf=True)
    tokenizer = gguf_tokenizer.build(file.metadata, file.architecture) if "tokenizer.ggml.tokens" in file.metadata \
        else None

    def write(tmp: Path) -> None:
        staging = tmp / ".staging"
        model_type, final, params, info = gguf_convert.convert_params(file, dtype=dtype, staging_dir=staging,
                                                                      progress=progress, log=note)
        if quantize.active:
            params, info["quantization"] = quantization.apply(
                params, quantize, scheme, final, gguf_file=file,
                permuted_qk=gguf_convert.ARCHITECTURES[file.architecture].permuted_qk, log=note)
        checkpoint.save_params(tmp, model_type, _validated(final, src), params,
                               {"path": str(src), "files": [src.name], "dtype": dtype, **info})
        del params
        shutil.rmtree(staging)
        if tokenizer is None:
            note(f"{src} has no tokenizer metadata (tokenizer.ggml.tokens): no tokenizer written")
        else:
            gguf_tokenizer.save(*tokenizer, tmp)

    return _write_atomically(dst, write)
