"""Hugging Face safetensors checkpoint -> omnijax checkpoint conversion.

`convert_checkpoint(src, dst)` is the Python entry point; `omnijax convert SRC DST` (or `omnijax-convert`, `python -m
omnijax.convert`) is the command line (`omnijax/convert/__main__.py`). The model type is detected from
`SRC/config.json`; every model converter module exposes `convert_params(ckpt, hf_config, *, dtype, staging_dir,
progress, log)`, `model_type_for(hf_config)` and `config_from_hf(hf_config, *, dtype)` (run first, so an unsupported
config is refused before tensors are read).

Output is written into a temporary directory next to DST and renamed into place only after everything succeeded:
a failure leaves neither a half-written DST nor the temporary directory, and a pre-existing DST is untouched.
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
from omnijax.checkpoint.safetensors import SafetensorsCheckpoint
from omnijax.errors import ConfigError, ConvertError, DestinationError, UnsupportedModelError
from omnijax.models.registry import ALL_FAMILIES

__all__ = ["convert_checkpoint", "ConvertError", "DTYPES", "SUPPORTED_MODEL_TYPES", "TOKENIZER_FILES"]

DTYPES = ("float32", "bfloat16")
# Hugging Face model_type -> converter module (each family's `converter`).
CONVERTERS = {hf_type: family.converter for family in ALL_FAMILIES for hf_type in family.hf_model_types}
# Model types recognised but not converted, with the reason.
NOT_SUPPORTED_YET: dict[str, str] = {}
SUPPORTED_MODEL_TYPES = tuple(CONVERTERS)
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


def _with_generation_eos(config, src: Path):
    """Takes the end-of-answer tokens from `generation_config.json` when the checkpoint ships one."""
    path = src / "generation_config.json"
    if not path.is_file():
        return config
    try:
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise ConfigError(f"{path}: cannot parse: {e}") from e
    if eos is None:
        return config
    ids = [eos] if isinstance(eos, int) else eos
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ConfigError(f"{path}: eos_token_id must be an int or a list of ints, got {eos!r}")
    return config.replace(eos_token_ids=tuple(i for i in ids if 0 <= i < config.vocab_size))


def _check_destination(src: Path, dst: Path, force: bool) -> None:
    if dst == src or dst.is_relative_to(src) or src.is_relative_to(dst):
        raise DestinationError(f"destination {dst} overlaps the source {src}")
    if os.path.lexists(dst) and not force:
        if not dst.is_dir() or dst.is_symlink():
            raise DestinationError(f"destination {dst} exists and is not a directory (pass --force to replace it)")
        if any(dst.iterdir()):
            raise DestinationError(f"destination {dst} exists and is not empty (pass --force to replace it)")


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


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, dtype: str = "float32", force: bool = False,
                       progress: bool = True, log: Callable[[str], None] | None = None) -> Path:
    """Converts a Hugging Face safetensors checkpoint directory into an omnijax checkpoint.

    Args:
        src: directory with `config.json` and `model.safetensors` or `model.safetensors.index.json` + shards.
        dst: output directory (see `omnijax/checkpoint/format.py` for its layout). Must not exist or be empty unless
            `force`; with `force` an existing DST is replaced only after the conversion succeeded.
        dtype: parameter dtype, "float32" or "bfloat16".
        force: replace a non-empty DST.
        progress: show a progress bar over tensors on stderr.
        log: callable receiving one-line notes (skipped tensors); default prints to stderr.

    Returns:
        The absolute path of the written checkpoint.

    Raises:
        ConvertError: any anticipated failure (bad input, unsupported config, destination problems); nothing is
            left behind.
    """
    if dtype not in DTYPES:
        raise ConvertError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    src, dst = Path(src).resolve(), Path(dst).resolve()
    if not src.is_dir():
        raise ConvertError(f"source {src} is not a directory")
    _check_destination(src, dst, force)
    hf_config = read_hf_config(src)
    converter = converter_for(hf_config, src / "config.json")
    converter.config_from_hf(hf_config, dtype=dtype)  # refuses an unsupported config before any tensor is read

    created = next((p for p in reversed(dst.parents) if not p.exists()), None)  # topmost parent this call creates
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        ckpt = SafetensorsCheckpoint(src)
        staging = tmp / ".staging"
        kwargs = {} if log is None else {"log": log}
        config, params, info, extras = converter.convert_params(ckpt, hf_config, dtype=dtype, staging_dir=staging,
                                                        progress=progress, **kwargs)
        config = _with_generation_eos(config, src)
        source_info = {"path": str(src), "hf_model_type": hf_config.get("model_type"),
                       "files": [p.name for p in ckpt.files], "dtype": dtype, **info}
        checkpoint.save_params(tmp, converter.model_type_for(hf_config), config, params, source_info,
                               components=extras)
        del params
        shutil.rmtree(staging)
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        _swap_into_place(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created is not None and not os.path.lexists(dst):
            shutil.rmtree(created, ignore_errors=True)
        raise
    return dst
