"""The Llama family: Llama-2/3.x (Llama-3 RoPE scaling included) and Mistral decoders, text only, 1D RoPE."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omnijax.models import family as family_lib
from omnijax.models.decoder import Decoder
from omnijax.models.llama import convert
from omnijax.models.model import Model
from omnijax.models.qwen2_5_omni.frontend import QwenOmniUnits


def load(directory: Path, manifest: Mapping[str, Any], decoder: Decoder, dtype: str | None) -> Model:
    """A text-only decoder: nothing beside the decoder to restore."""
    return Model(decoder, model_type=manifest["model_type"], source=str(directory))


FAMILY = family_lib.register(family_lib.Family(
    name="llama",
    components={"llama": (), "mistral": ()},
    converter=convert,
    load=load,
    chat_units=QwenOmniUnits,  # text turns in the chat template's layout, 1D positions
))
