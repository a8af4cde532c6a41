"""The Qwen2.5-Omni family: the thinker with its Whisper-style audio and Qwen2.5-VL vision encoders, TMRoPE
positions, 2 s audiovisual units; and, converted from a full release, the speech output (talker, Token2Wav, voices:
`model.speech`, `speech.speak`); also the plain Qwen2 / Qwen3 decoders its converter reads (text only)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from omnijax.checkpoint import format as checkpoint
from omnijax.checkpoint.special_tokens import read_special_tokens
from omnijax.models import family as family_lib
from omnijax.models.config import token_id_fields
from omnijax.models.decoder import Decoder
from omnijax.models.encoders import whisper as audio_lib
from omnijax.models.model import Model, restore_module
from omnijax.models.qwen2_5_omni import convert, frontend, thinker
from omnijax.models.qwen2_5_omni import hf_config as hf_config_lib
from omnijax.models.qwen2_5_omni import speech as speech_lib
from omnijax.models.qwen2_5_omni import vision as vision_lib
from omnijax.models.qwen2_5_omni import voices as voices_lib
from omnijax.models.qwen2_5_omni.bigvgan import BigVGANConfig
from omnijax.models.qwen2_5_omni.config import HF_NAMES, OmniConfig
from omnijax.models.qwen2_5_omni.talker import Talker, TalkerConfig
from omnijax.models.qwen2_5_omni.token2wav import Token2Wav, Token2WavConfig
from omnijax.models.qwen2_5_omni.token2wav_dit import DiTConfig
from omnijax.models.speech import has_speech_components

SPEECH_COMPONENTS = ("talker", "token2wav", "speech")


def load_speech(directory: Path, manifest: Mapping[str, Any], dtype: str | None,
                omni: OmniConfig) -> speech_lib.Qwen25Speech | None:
    """The speech output a checkpoint converted from a full release holds (None for a thinker-only one). The talker
    takes `dtype`; Token2Wav keeps its stored dtype (transformers runs it in float32 whatever the model's)."""
    if not has_speech_components(directory, manifest, SPEECH_COMPONENTS):
        return None
    stored = TalkerConfig.from_json(manifest["talker"])
    talker = restore_module(directory, "talker", stored, dtype, lambda c: Talker(
        c.replace(decoder=c.decoder.replace(dtype=c.dtype)), rngs=nnx.Rngs(0)))
    entry = manifest["token2wav"]
    t2w = Token2WavConfig(dit=DiTConfig.from_json(entry["dit"]), bigvgan=BigVGANConfig.from_json(entry["bigvgan"]))
    token2wav = restore_module(directory, "token2wav", t2w, None, lambda c: Token2Wav(c, rngs=nnx.Rngs(0)))
    voices = voices_lib.voices_from_tree(manifest["speech"], checkpoint.load_params(
        directory, voices_lib.voices_abstract(manifest["speech"]), "speech"))
    return speech_lib.Qwen25Speech(talker, token2wav, voices, im_end_token_id=omni.im_end_token_id,
                                   placeholders={"audio_token_id": omni.audio_token_id,
                                                 "image_token_id": omni.image_token_id,
                                                 "video_token_id": omni.video_token_id})


def load(directory: Path, manifest: Mapping[str, Any], decoder: Decoder, dtype: str | None) -> Model:
    """A Qwen2.5-Omni thinker (or plain Qwen decoder) with the encoders its checkpoint holds."""
    encoders = {}
    try:
        if "audio" in manifest:
            encoders["audio"] = restore_module(directory, "audio", audio_lib.AudioConfig.from_json(manifest["audio"]),
                                               dtype, lambda c: audio_lib.AudioEncoder(c, rngs=nnx.Rngs(0)))
        if "vision" in manifest:
            encoders["vision"] = restore_module(
                directory, "vision", vision_lib.VisionConfig.from_json(manifest["vision"]), dtype,
                lambda c: vision_lib.VisionEncoder(c, rngs=nnx.Rngs(0)))
        omni = OmniConfig.from_json(manifest["omni"]) if "omni" in manifest else None
        speech = load_speech(directory, manifest, dtype, omni or OmniConfig())
    except checkpoint.CheckpointFormatError:
        raise
    except (TypeError, ValueError, KeyError) as e:
        raise checkpoint.CheckpointFormatError(f"{directory / checkpoint.MANIFEST}: {e}") from e
    model = Model(decoder, model_type=manifest["model_type"], source=str(directory), omni=omni, **encoders)
    if speech is not None and "vision" in encoders:  # an image's rows kept for the talker need the vision merge
        speech.spatial_merge_size = vision_lib.VisionConfig.from_json(manifest["vision"]).spatial_merge_size
    model.speech = speech
    return model


def special_token_ids(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The thinker's placeholder and marker ids (the `omni` entry), named `omni.<field>`; none for a plain Qwen2 /
    Qwen3 decoder."""
    if "omni" not in manifest:
        return {}
    return token_id_fields("omni", OmniConfig.from_json(manifest["omni"]), HF_NAMES)


def token_components(hf_config: Mapping[str, Any], directory: Path) -> dict[str, Any]:
    """The `omni` entry converting this source writes: the thinker config's ids, else its tokenizer's, else the
    release's (`OmniConfig.from_hf`, as `convert.convert_params` resolves them); none for a plain Qwen2 / Qwen3 LLM."""
    key = hf_config_lib.layout_of(hf_config).thinker_key
    if key is None:  # a plain LLM
        return {}
    thinker = hf_config.get(key) if key else hf_config
    if not isinstance(thinker, Mapping):  # `config_from_hf` refuses a config without its thinker object
        return {}
    return {"omni": OmniConfig.from_hf(thinker, read_special_tokens(directory)).to_json()}


def thinker_inputs(model: Model, ids: np.ndarray, **media: Any) -> tuple:
    """The encoders' outputs on a prompt's placeholders (no DeepStack in this family)."""
    embeds, embed_mask, audio_lengths = thinker.multimodal_embeddings(model, ids, **media)
    return embeds, embed_mask, None, audio_lengths


def thinker_positions(model: Model, ids: np.ndarray, mask: np.ndarray, **grids: Any) -> np.ndarray:
    """TMRoPE positions of a prompt with media."""
    return thinker.rope_index(ids, mask, model.omni, spatial_merge_size=model.vision.config.spatial_merge_size,
                              **grids)


FAMILY = family_lib.register(family_lib.Family(
    name="qwen2_5_omni",
    components={"qwen2_5_omni": ("audio", "vision", "omni") + SPEECH_COMPONENTS, "qwen2": (), "qwen3": ()},
    converter=convert,
    load=load,
    chat_units=frontend.QwenOmniUnits,
    frame_tokens=lambda samples: frontend.num_audio_tokens(samples) + 2,  # audio tokens and the two markers
    frame_unit=frontend.frame_unit,
    thinker_inputs=thinker_inputs,
    thinker_positions=thinker_positions,
    special_token_ids=special_token_ids,
    token_components=token_components,
))
