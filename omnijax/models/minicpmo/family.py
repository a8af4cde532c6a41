"""The MiniCPM-o 4.5 family: the Qwen3-mode decoder with SigLIP/NaViT vision + resampler and Whisper audio, 1D
RoPE, `<unit>`s of 1 s audio with at most one frame, full duplex; retention keeps a unit's source image whole
(its slices refer to it)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omnijax.checkpoint import format as checkpoint
from omnijax.checkpoint.special_tokens import read_special_tokens
from omnijax.models import family as family_lib
from omnijax.models.decoder import Decoder
from omnijax.models.minicpmo import convert, frontend
from omnijax.models.minicpmo import model as model_lib


def load(directory: Path, manifest: Mapping[str, Any], decoder: Decoder, dtype: str | None) -> model_lib.MiniCPMOModel:
    """A MiniCPM-o 4.5 model with the encoders its checkpoint holds (dtype overrides are refused)."""
    if dtype is not None:
        raise ValueError("dtype overrides are not implemented for MiniCPM-o checkpoints yet; convert with "
                         "--dtype instead")
    try:
        return model_lib.load(directory, dict(manifest), decoder)
    except (TypeError, ValueError) as e:
        raise checkpoint.CheckpointFormatError(f"{directory / checkpoint.MANIFEST}: {e}") from e


def special_token_ids(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The marker ids the checkpoint's tokenizer declared (the `special_tokens` entry: token text -> id), named
    `special_tokens['<unit>']`. Markers it did not declare keep the release's layout ids (`model.tokens`), which a
    small vocabulary need not hold: they are fallbacks (the duplex loop asks for declared markers), not checked."""
    special = manifest.get("special_tokens", {})
    if not isinstance(special, Mapping):
        raise ValueError(f"special_tokens must map token text to an id, got {special!r}")
    return {f"special_tokens[{text!r}]": token_id for text, token_id in special.items()}


def token_components(hf_config: Mapping[str, Any], directory: Path) -> dict[str, Any]:
    """The `special_tokens` entry converting this source writes: the ids its tokenizer files declare for the unit
    and duplex markers (`model_lib.special_token_texts`)."""
    special = read_special_tokens(directory)
    return {"special_tokens": {text: special[text] for text in model_lib.special_token_texts() if text in special}}


FAMILY = family_lib.register(family_lib.Family(
    name="minicpmo",
    components={"minicpmo": ("vpm", "resampler", "audio", "audio_projection", "special_tokens")},
    converter=convert,
    load=load,
    chat_units=frontend.MiniCPMOUnits,
    whole_source_image=True,
    duplex=True,
    # The release's chat code renders with enable_thinking=False; its template (Qwen3's) thinks unless told not to.
    template_defaults={"enable_thinking": False},
    special_token_ids=special_token_ids,
    token_components=token_components,
))
