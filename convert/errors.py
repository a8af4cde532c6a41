"""Errors raised by the checkpoint converter: the classes of `omnijax.errors`, re-exported.

They live in omnijax because the model modules raise them too (reading Hugging Face configs and tensors), and the
models never import the converter. Every error the converter expects to meet derives from `ConvertError`; the
command line prints these as a one-line `error: ...` message without a traceback.
"""

from omnijax.errors import (
    CheckpointError, ConfigError, ConvertError, DestinationError, MissingTensorError, ShapeMismatchError, TensorError,
    UnexpectedTensorError, UnsupportedConfigError, UnsupportedModelError)

__all__ = ["CheckpointError", "ConfigError", "ConvertError", "DestinationError", "MissingTensorError",
           "ShapeMismatchError", "TensorError", "UnexpectedTensorError", "UnsupportedConfigError",
           "UnsupportedModelError"]
