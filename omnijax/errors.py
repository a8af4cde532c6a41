"""Errors raised while reading a Hugging Face checkpoint or config: by the converter (`omnijax-convert`), and by the
model modules' `from_hf` config readers and Hugging Face tensor loaders (`omnijax.models`).

Every anticipated failure derives from `ConvertError`; the command line prints these as a one-line `error: ...`
message without a traceback. Anything else is a bug and keeps its traceback. `omnijax.errors` re-exports this
module (the same classes), so the models never import the converter.
"""

from __future__ import annotations

import os

__all__ = ["CheckpointError", "ConfigError", "ConfigValueError", "ConvertError", "DestinationError",
           "MissingTensorError", "ShapeMismatchError", "TensorError", "UnexpectedTensorError", "UnsupportedConfigError",
           "UnsupportedModelError"]


class ConvertError(Exception):
    """Base class of every anticipated conversion failure."""


class CheckpointError(ConvertError):
    """A source checkpoint file (or shard index) is missing, truncated or corrupt.

    Attributes:
        path: the offending file, when known.
        tensor: the offending tensor name, when known.
    """

    def __init__(self, message: str, *, path: str | os.PathLike | None = None, tensor: str | None = None):
        self.path = None if path is None else os.fspath(path)
        self.tensor = tensor
        where = []
        if self.path is not None:
            where.append(self.path)
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        super().__init__(f"{': '.join(where)}: {message}" if where else message)


class ConfigError(ConvertError):
    """`config.json` is missing, unreadable or lacks a required attribute."""


class UnsupportedConfigError(ConfigError):
    """The config sets an attribute that changes the model's math in a way omnijax does not implement.

    Attributes:
        attribute: dotted name of the attribute (e.g. `text_config.use_sliding_window`).
        value: its value in the config.
    """

    def __init__(self, attribute: str, value: object, reason: str):
        self.attribute = attribute
        self.value = value
        super().__init__(f"unsupported config attribute {attribute}={value!r}: {reason}")


class UnsupportedModelError(ConvertError):
    """`config.json` names a model type the converter does not handle."""


class TensorError(ConvertError):
    """The checkpoint's tensors do not match what the model needs (base class; also used for dtype problems)."""


class UnexpectedTensorError(TensorError):
    """The checkpoint holds a tensor that maps to no parameter (or maps to one twice)."""


class MissingTensorError(TensorError):
    """A parameter the model needs has no tensor in the checkpoint."""


class ShapeMismatchError(TensorError):
    """A tensor's shape differs from the one the config implies."""


class DestinationError(ConvertError):
    """The output directory cannot be written (exists and is not empty without `--force`, overlaps the source)."""


class ConfigValueError(ConfigError, ValueError):
    """A config value lies outside the range the model can run with (a head count of 0, a NaN `rope_theta`, a
    token id outside the vocabulary). Both a `ConfigError` (the converter reports it in one line) and a
    `ValueError` (what a dataclass config raises for a bad value).

    Attributes:
        attribute: the offending field (e.g. `num_heads (num_attention_heads)`, `config.bos_token_id`).
        value: its value.
        allowed: the values allowed, in words (e.g. "an integer >= 1", "[0, 300)").
    """

    def __init__(self, attribute: str, value: object, allowed: str):
        self.attribute = attribute
        self.value = value
        self.allowed = allowed
        super().__init__(f"{attribute}={value!r} is out of range: it must be {allowed}")
