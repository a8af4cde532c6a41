"""The model families omnijax reads, and `load`: a converted checkpoint directory -> its family's model.

Each family lives in its own folder with a `family.py` that registers one `omnijax.models.family.Family`; this
module imports them all. Adding a family is adding its folder and its import here.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from flax import nnx

from omnijax.checkpoint import format as checkpoint
from omnijax.heap import trim_heap
from omnijax.models.config import DecoderConfig, validate_config
from omnijax.models.decoder import Decoder
from omnijax.models.family import FAMILIES, Family, OmniModel, family_for
from omnijax.models.llama import family as llama_family
from omnijax.models.minicpmo import family as minicpmo_family
from omnijax.models.model import restore_module
from omnijax.models.qwen2_5_omni import family as qwen2_5_omni_family
from omnijax.models.qwen3_omni import family as qwen3_omni_family
from omnijax.models.tokenizer import load_tokenizer

# Every family, in the order the converter tries Hugging Face model types.
ALL_FAMILIES: tuple[Family, ...] = (qwen2_5_omni_family.FAMILY, minicpmo_family.FAMILY, qwen3_omni_family.FAMILY,
                                    llama_family.FAMILY)


def family_for_hf(hf_model_type: str | None) -> Family | None:
    """The family whose converter reads a Hugging Face `model_type`, or None."""
    return next((f for f in ALL_FAMILIES if hf_model_type in f.hf_model_types), None)


def read_manifest(ckpt_dir: str | os.PathLike) -> tuple[str, DecoderConfig]:
    """`(model_type, DecoderConfig)` of a converted checkpoint.

    Raises:
        CheckpointFormatError: see `omnijax.checkpoint.format.read_manifest_dict`; also when the decoder config does
            not parse or holds a value outside its range (`omnijax.models.config.validate_config`: a head count of
            0, a NaN rope_theta, an eos id outside the vocabulary, ...), or when a special id of the family
            (`Family.special_token_ids`: a placeholder, a modality or chat marker) lies outside the vocabulary,
            before any parameter is read. Its cause is the `ConfigValueError` naming the field, the value and the
            vocabulary size.
    """
    manifest = checkpoint.read_manifest_dict(ckpt_dir)
    path = Path(ckpt_dir) / checkpoint.MANIFEST
    try:
        config = validate_config(DecoderConfig.from_json(manifest["decoder"]))
    except (TypeError, ValueError) as e:
        raise checkpoint.CheckpointFormatError(f"{path}: invalid decoder config: {e}") from e
    try:
        validate_config(config, family_for(manifest["model_type"]).manifest_token_ids(manifest))
    except (TypeError, ValueError) as e:
        raise checkpoint.CheckpointFormatError(f"{path}: invalid special token ids: {e}") from e
    return manifest["model_type"], config


def load(directory: str | Path, *, dtype: str | None = None) -> OmniModel:
    """Loads a directory written by `omnijax-convert` into a `Model` (with its encoders when converted).

    The checkpoint's tokenizer (`tokenizer.json`, copied by the converter) becomes `model.tokenizer`; without one
    `model.tokenizer` is None and a `UserWarning` says so.

    Args:
        directory: the converted checkpoint (holding `omnijax.json` and `params/`).
        dtype: optional compute dtype override ("float32" or "bfloat16"); weights are cast on load (refused for a
            checkpoint holding quantised weights: convert it again with that dtype).
    """

    directory = Path(directory)
    model_type, config = read_manifest(directory)
    manifest = checkpoint.read_manifest_dict(directory)
    decoder = restore_module(directory, checkpoint.PARAMS_DIR, config, dtype, lambda c: Decoder(c, rngs=nnx.Rngs(0)),
                             checkpoint.read_quantization(manifest))
    return _with_tokenizer(family_for(model_type).load(directory, manifest, decoder, dtype), directory)


def _with_tokenizer(model, directory: Path):
    """Sets `model.tokenizer` from the directory's tokenizer files; warns once when there are none."""

    tokenizer = load_tokenizer(directory)
    trim_heap()  # parsing tokenizer.json frees ~34 MB (SmolLM2's) that glibc would otherwise keep resident
    defaults = model.family.template_defaults
    # every rendering (Chat, the server's routes, duplex, evaluation) gets the family's template variables, e.g.
    # MiniCPM-o 4.5's enable_thinking=False, unless its caller passes its own
    model.tokenizer = tokenizer.with_template_defaults(defaults) if tokenizer is not None and defaults else tokenizer
    if model.tokenizer is None:
        warnings.warn(f"{directory} has no tokenizer files (tokenizer.json), so text input and output are "
                      f"unavailable and the model takes token ids; to fix this, copy tokenizer.json and "
                      f"tokenizer_config.json from the Hugging Face release into {directory}, or re-run "
                      f"`omnijax-convert` from a release directory that has them", UserWarning, stacklevel=3)
    return model


__all__ = ["ALL_FAMILIES", "FAMILIES", "family_for", "family_for_hf", "load", "read_manifest"]
