"""The Qwen3-Omni family (Qwen3-Omni-30B-A3B): the thinker's MoE decoder, the AuT audio and Qwen3-VL (DeepStack)
vision encoders, interleaved M-RoPE with audio-synchronised (possibly fractional) time positions; and, converted
from a full release, the speech output (talker, code predictor, Code2Wav: `model.speech`, `speech.speak`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flax import nnx

from omnijax.checkpoint import format as checkpoint
from omnijax.checkpoint.special_tokens import read_special_tokens
from omnijax.models import family as family_lib
from omnijax.models.config import token_id_fields
from omnijax.models.decoder import Decoder
from omnijax.models.model import Model, restore_module
from omnijax.models.qwen3_omni import audio as audio_lib
from omnijax.models.qwen3_omni import convert, frontend, thinker
from omnijax.models.qwen3_omni import speech as speech_lib
from omnijax.models.qwen3_omni import vision as vision_lib
from omnijax.models.qwen3_omni.code2wav import Code2Wav, Code2WavConfig
from omnijax.models.qwen3_omni.config import Qwen3OmniConfig
from omnijax.models.qwen3_omni.talker import Talker, TalkerConfig
from omnijax.models.speech import has_speech_components

SPEECH_COMPONENTS = ("talker", "code2wav", "speech")


def _talker(config: TalkerConfig) -> Talker:
    """A talker whose decoders compute in the talker's dtype (`restore_module` replaces only the top-level one)."""
    return Talker(config.replace(decoder=config.decoder.replace(dtype=config.dtype),
                                 predictor=config.predictor.replace(dtype=config.dtype)), rngs=nnx.Rngs(0))


def load_speech(directory: Path, manifest: Mapping[str, Any], dtype: str | None,
                ids: Qwen3OmniConfig) -> speech_lib.Qwen3Speech | None:
    """The speech output a checkpoint converted from a full release holds (None for a thinker-only one); `ids`: the
    thinker's placeholder ids."""
    if not has_speech_components(directory, manifest, SPEECH_COMPONENTS):
        return None
    talker = restore_module(directory, "talker", TalkerConfig.from_json(manifest["talker"]), dtype, _talker)
    code2wav = restore_module(directory, "code2wav", Code2WavConfig.from_json(manifest["code2wav"]), dtype,
                              lambda c: Code2Wav(c, rngs=nnx.Rngs(0)))
    placeholders = {"audio_token_id": ids.audio_token_id, "image_token_id": ids.image_token_id,
                    "video_token_id": ids.video_token_id}
    return speech_lib.Qwen3Speech(talker, code2wav, speech_lib.SpeechTokens.from_json(manifest["speech"]),
                                  placeholders)


def load(directory: Path, manifest: Mapping[str, Any], decoder: Decoder, dtype: str | None) -> Model:
    """A Qwen3-Omni thinker with the encoders its checkpoint holds, and its token ids and position rate."""
    encoders = {}
    try:
        if "audio" in manifest:
            encoders["audio"] = restore_module(
                directory, "audio", audio_lib.Qwen3AudioConfig.from_json(manifest["audio"]), dtype,
                lambda c: audio_lib.Qwen3AudioEncoder(c, rngs=nnx.Rngs(0)))
        if "vision" in manifest:
            encoders["vision"] = restore_module(
                directory, "vision", vision_lib.Qwen3VisionConfig.from_json(manifest["vision"]), dtype,
                lambda c: vision_lib.Qwen3VisionEncoder(c, rngs=nnx.Rngs(0)))
        ids = Qwen3OmniConfig.from_json(manifest.get("qwen3_omni", {}))
        speech = load_speech(directory, manifest, dtype, ids)
    except checkpoint.CheckpointFormatError:
        raise
    except (TypeError, ValueError) as e:
        raise checkpoint.CheckpointFormatError(f"{directory / checkpoint.MANIFEST}: {e}") from e
    model = Model(decoder, model_type="qwen3_omni", source=str(directory), omni=ids, **encoders)
    model.speech = speech
    return model


def special_token_ids(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The thinker's placeholder and marker ids (the `qwen3_omni` entry; the release's where it is absent, as `load`
    reads it), named `qwen3_omni.<field>`, and the thinker-vocabulary ids of the speech output (`speech.<field>`)."""
    ids = token_id_fields("qwen3_omni", Qwen3OmniConfig.from_json(manifest.get("qwen3_omni", {})))
    if "speech" in manifest:
        ids.update(token_id_fields("speech", speech_lib.SpeechTokens.from_json(manifest["speech"])))
    return ids


def token_components(hf_config: Mapping[str, Any], directory: Path) -> dict[str, Any]:
    """The `qwen3_omni` entry converting this source writes (`convert.omni_ids`: the thinker config's ids, else its
    tokenizer's, else the release's), and the `speech` entry of a full release with audio output."""
    entries = {"qwen3_omni": convert.omni_ids(hf_config, read_special_tokens(directory)).to_json()}
    if speech_lib.has_speech_output(hf_config):
        entries["speech"] = speech_lib.SpeechTokens.from_hf(hf_config).to_json()
    return entries


FAMILY = family_lib.register(family_lib.Family(
    name="qwen3_omni",
    components={"qwen3_omni": ("audio", "vision", "qwen3_omni") + SPEECH_COMPONENTS},
    converter=convert,
    load=load,
    chat_units=frontend.Qwen3OmniUnits,
    frame_tokens=lambda samples: frontend.num_audio_tokens(samples) + 2,  # audio tokens and the two markers
    frame_unit=frontend.frame_unit,
    fractional_positions=True,
    thinker_inputs=thinker.multimodal_inputs,
    thinker_positions=thinker.rope_index,
    special_token_ids=special_token_ids,
    token_components=token_components,
))
