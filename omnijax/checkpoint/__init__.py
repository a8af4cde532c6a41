"""The omnijax checkpoint format and what reads and writes it: the manifest and orbax parameter trees (`format`),
the declarative tables that map Hugging Face tensors onto parameter trees (`name_tables`, `tables`), the validated
safetensors reader (`safetensors`), the conversion loop (`loop`) and the tokenizer files' special tokens."""

from omnijax.checkpoint.format import CheckpointFormatError, load_params, read_manifest_dict, save_params

__all__ = ["CheckpointFormatError", "load_params", "read_manifest_dict", "save_params"]
