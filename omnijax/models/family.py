"""A model family in one object: `Family` answers every question code asks about a model's kind (what it converts,
how it loads, which chunks its units are, how it hears a PCM frame, what retention must keep whole), and
`OmniModel` is what a loaded model offers the layers above.

Each family folder (`omnijax/models/<family>/`) defines one `Family` in its `family.py`; `omnijax.models.registry`
lists them. Adding a family is adding a folder and one line there.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

import numpy as np

from omnijax.checkpoint import format as checkpoint
from omnijax.chunks.chunk import Chunk
from omnijax.models.config import DecoderConfig
from omnijax.models.decoder import Decoder


@runtime_checkable
class SpeechOutput(Protocol):
    """A model's speech output parts (e.g. Qwen3-Omni's talker, code predictor and Code2Wav:
    `omnijax.models.qwen3_omni.speech.Qwen3Speech`): the voices it speaks with, its PCM sample rate, and how it
    speaks an answer chunk by chunk (`speak_chunks`)."""

    sample_rate: int

    @property
    def voices(self) -> tuple[str, ...]: ...

    def speak_chunks(self, model: "OmniModel", prompt_ids: Any, answer_ids: Any, *, voice: str,
                     max_new_tokens: int = 4096, first_chunk: int = 4, chunk: int = 25) -> Iterator[np.ndarray]:
        """Speaks `answer_ids` (a thinker's answer to the chat-templated `prompt_ids`) with `voice`: checks the call
        (raising before anything runs), then yields float32 PCM chunks at `sample_rate` (`max_new_tokens` bounds
        the speech's codec frames; `first_chunk`, then `chunk` frames a vocoder call)."""
        ...


@runtime_checkable
class OmniModel(Protocol):
    """What a loaded model offers: the decoder and its config, its family, where it came from, and its optional
    parts (encoders, speech output, the family's token ids and timing, the tokenizer); an absent part is None."""

    decoder: Decoder
    family: "Family"
    model_type: str
    source: str | None
    audio: Any
    vision: Any
    speech: SpeechOutput | None
    tokenizer: Any

    @property
    def config(self) -> DecoderConfig: ...


# (directory, manifest, decoder, dtype) -> the loaded model (without its tokenizer, which the registry adds).
Loader = Callable[[Path, Mapping[str, Any], Decoder, "str | None"], OmniModel]
# (model, its audio encoder or the encoder's (graphdef, params) split, [samples] float32 PCM at 16 kHz, unit,
# answer_tokens) -> a batch-1 audio unit chunk (serving's frames).
FrameUnit = Callable[[OmniModel, Any, np.ndarray, int, int], Chunk]


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
        name: the family's name (its folder under `omnijax/models/`).
        components: omnijax model type -> the manifest keys (encoders, their configs) its checkpoints may hold
            beside the decoder; the keys of this mapping are the model types the family reads.
        converter: the module that converts the family's Hugging Face checkpoints (`HF_MODEL_TYPES`,
            `config_from_hf`, `model_type_for`, `convert_params`).
        load: builds a model from a checkpoint directory's manifest and restored decoder.
        chat_units: model -> the builder of the chunks `Chat` and the server feed (an `omnijax.models.frontend
            .ChatUnits`).
        frame_tokens: PCM samples of one frame -> the chunk tokens of its audio unit (audio tokens and markers);
            None where the family does not hear frames.
        frame_unit: one PCM frame -> its audio unit chunk (see `FrameUnit`); None with `frame_tokens`.
        whole_source_image: retention keeps a unit's source image whole (MiniCPM-o's slices refer to it).
        duplex: the family decides per unit whether to listen or speak (MiniCPM-o 4.5's full duplex).
        fractional_positions: temporal position ids may be fractional (Qwen3-Omni's audio-synchronised time).
        thinker_inputs: `(model, ids, **media)` -> `(embeds, embed_mask, deepstack | None, audio_lengths)`: the
            encoders' outputs on the placeholders of a Hugging Face-style prompt (`Model.__call__`); None for a
            text-only family.
        thinker_positions: `(model, ids, mask, *, image_grid_thw, video_grid_thw, audio_lengths, second_per_grids,
            use_audio_in_video)` -> `[3, B, T]` positions of a prompt with media (the reference's `get_rope_index`).
        template_defaults: chat-template variables the family's prompts are rendered with unless a caller passes
            them (`Conversation`, and so `Chat` and the server, apply them): what the release's own inference code
            passes to its template, e.g. MiniCPM-o 4.5's `{"enable_thinking": False}`.
        special_token_ids: manifest -> the family's special ids it records (placeholders, modality and chat markers),
            named for messages (e.g. "omni.audio_token_id"; `omnijax.models.config.token_id_fields`); the loader and
            the converter refuse one outside the vocabulary (`omnijax.models.config.validate_config`). None: the
            family has no ids beyond the decoder's.
        token_components: `(hf_config, source directory)` -> the manifest entries holding special ids that
            converting that source writes (what `special_token_ids` reads), resolved from its `config.json` and
            tokenizer files without reading a tensor, so the converter refuses a bad id first.
    """

    name: str
    components: Mapping[str, tuple[str, ...]]
    converter: ModuleType
    load: Loader
    chat_units: Callable[[OmniModel], Any]
    frame_tokens: Callable[[int], int] | None = None
    frame_unit: FrameUnit | None = None
    whole_source_image: bool = False
    duplex: bool = False
    fractional_positions: bool = False
    thinker_inputs: Callable[..., tuple] | None = None
    thinker_positions: Callable[..., np.ndarray] | None = None
    template_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    special_token_ids: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None
    token_components: Callable[[Mapping[str, Any], Path], Mapping[str, Any]] | None = None

    @property
    def model_types(self) -> tuple[str, ...]:
        """The omnijax model types of this family's checkpoints."""
        return tuple(self.components)

    @property
    def hf_model_types(self) -> tuple[str, ...]:
        """The Hugging Face `model_type`s this family converts."""
        return tuple(self.converter.HF_MODEL_TYPES)

    def manifest_token_ids(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """The special ids a checkpoint manifest (or the components a conversion writes) records, name -> id; empty
        for a family without any (`special_token_ids`)."""
        return {} if self.special_token_ids is None else dict(self.special_token_ids(manifest))

    def source_token_ids(self, hf_config: Mapping[str, Any], directory: Path) -> dict[str, Any]:
        """The special ids converting the Hugging Face checkpoint in `directory` would record (`token_components`),
        named as the loader names them."""
        if self.token_components is None:
            return {}
        return self.manifest_token_ids(self.token_components(hf_config, directory))


# omnijax model type -> its family; filled by `register` as `omnijax.models.registry` imports each family's folder.
# `import omnijax` imports nothing until a name is used, so a model built from its own module (without `load`) may
# ask `family_for` before anything imported the registry: `family_for` then imports it by name (the registry is of
# this layer and imports every family this module defines the protocol of; an import statement here would be a cycle).
FAMILIES: dict[str, Family] = {}
REGISTRY_MODULE = "omnijax.models.registry"


def register(family: Family) -> Family:
    """Adds `family` under each of its model types; refuses a model type another family already claims."""
    for model_type in family.model_types:
        other = FAMILIES.get(model_type)
        if other is not None and other is not family:
            raise ValueError(f"model type {model_type!r} is claimed by families {other.name!r} and {family.name!r}")
    FAMILIES.update(dict.fromkeys(family.model_types, family))
    checkpoint.MODEL_COMPONENTS.update(family.components)
    return family


def family_for(model_type: str) -> Family:
    """The family of an omnijax model type; a clear error names the known types."""
    if model_type not in FAMILIES:
        importlib.import_module(REGISTRY_MODULE)  # registers every shipped family (see FAMILIES)
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(f"unknown model type {model_type!r}; omnijax reads {sorted(FAMILIES)}") from None


class FamilyModel:
    """What every loaded model class shares: its decoder's config, and its family found by its model type."""

    decoder: Decoder
    model_type: str
    # the speech output parts (`SpeechOutput`); None unless the family's loader found them in the checkpoint
    speech: SpeechOutput | None = None

    @property
    def config(self) -> DecoderConfig:
        return self.decoder.config

    @property
    def family(self) -> Family:
        """The model's family (`Family`), found by its model type."""
        return family_for(self.model_type)


def family_of(model: Any) -> Family | None:
    """The family of a loaded model, or None for a bare `Decoder` (which has none)."""
    family = getattr(model, "family", None)
    return family if isinstance(family, Family) else None
