"""Config of MiniCPM-o 4.5's audio path (Whisper encoder `apm` + projector + pooling) and its token arithmetic.

The encoder, its conversion tables and the offline encoding live in `omnijax.models.minicpmo.audio` (which
re-exports these names); the streaming path in `omnijax.models.minicpmo.audio_stream`. The Whisper-style pieces and
config checks come from the Qwen2.5-Omni audio tower (`omnijax.models.encoders.whisper`), whose layers are the same.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, TypeVar

import jax
import numpy as np

from omnijax._checks import JsonConfig
from omnijax.models.encoders.common import TORCH_LAYER_NORM_EPS
from omnijax.models.encoders.whisper import UnsupportedAudioConfigError, check_dtype_and_sizes, check_whisper_attributes

__all__ = ["AudioConfig", "MINICPMO_4_5_AUDIO", "UnsupportedAudioConfigError", "audio_token_count", "cnn_frames"]

_MODEL_TYPE = "whisper"
_FRAMES_PER_SECOND_AFTER_CNN = 50


@dataclasses.dataclass(frozen=True)
class AudioConfig(JsonConfig):
    """Static hyperparameters of the MiniCPM-o 4.5 audio path.

    Attributes:
        num_mel_bins: mel bins M of the input features (80).
        d_model: encoder width D; divisible by the head count. The projector's input width is
            `encoder_ffn_dim // 4` in the release, so `encoder_ffn_dim == 4 * d_model` is required.
        encoder_layers: transformer layers L.
        encoder_attention_heads: attention heads.
        encoder_ffn_dim: feed-forward width F.
        max_source_positions: rows P of the learned position table (1500 = 30 s).
        output_dim: projector width H (the LLM hidden size).
        chunk_length: `audio_chunk_length` in seconds: offline attention is block-causal over chunks of
            `int(chunk_length * 50)` CNN frames; 0 or less means full attention.
        pool_step: `audio_pool_step`, the AvgPool1d kernel and stride over CNN frames.
        dtype: compute dtype name ("float32" or "bfloat16"); parameters are stored in it too.
    """

    num_mel_bins: int = 80
    d_model: int = 1024
    encoder_layers: int = 24
    encoder_attention_heads: int = 16
    encoder_ffn_dim: int = 4096
    max_source_positions: int = 1500
    output_dim: int = 4096
    chunk_length: float = 1.0
    pool_step: int = 5
    dtype: str = "float32"

    def __post_init__(self):
        check_dtype_and_sizes(self, not_sizes=("chunk_length",))
        if isinstance(self.chunk_length, bool) or not isinstance(self.chunk_length, (int, float)) or \
                not math.isfinite(self.chunk_length):
            raise ValueError(f"AudioConfig.chunk_length must be a finite number, got {self.chunk_length!r}")
        if self.chunk_length > 0 and self.chunk_frames < 1:
            raise ValueError(f"chunk_length={self.chunk_length} s is shorter than one CNN frame (20 ms)")
        if self.d_model % self.encoder_attention_heads:
            raise ValueError(f"d_model={self.d_model} is not a multiple of "
                             f"encoder_attention_heads={self.encoder_attention_heads}")
        if self.encoder_ffn_dim // 4 != self.d_model:
            raise ValueError(f"the projector reads encoder_ffn_dim // 4 = {self.encoder_ffn_dim // 4} features but "
                             f"the encoder outputs d_model = {self.d_model}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads

    @property
    def chunk_frames(self) -> int:
        """CNN frames per offline attention chunk (`int(chunk_length * 50)`; 0 = full attention)."""
        return int(self.chunk_length * _FRAMES_PER_SECOND_AFTER_CNN) if self.chunk_length > 0 else 0

    @property
    def max_mel_frames(self) -> int:
        """Longest offline clip in mel frames: one that fills the position table (3000 = 30 s)."""
        return 2 * self.max_source_positions

    @classmethod
    def from_hf(cls, hf_config: Mapping[str, Any], dtype: str = "float32") -> "AudioConfig":
        """Reads a MiniCPM-o `config.json` (the whole model's config: a dict or an object with `to_dict`).

        Uses `audio_config` (a Whisper config), the LLM `hidden_size`, `audio_chunk_length` and `audio_pool_step`.
        Whisper decoder attributes, dropout rates, spec-augment and other training-only attributes are ignored.

        Raises:
            UnsupportedAudioConfigError: `init_audio` is false or `audio_config` is missing; the audio config's
                `model_type` is not `whisper`; `activation_function` is not `gelu`; `scale_embedding` is true;
                `num_hidden_layers` differs from `encoder_layers`; `layer_norm_eps` is set to other than 1e-5; or
                `hidden_size` is missing.
            ValueError: inconsistent sizes (e.g. `encoder_ffn_dim != 4 * d_model`, as `AudioConfig` checks).
        """
        data = dict(hf_config.to_dict() if hasattr(hf_config, "to_dict") else hf_config)
        if data.get("init_audio", True) is False:
            raise UnsupportedAudioConfigError("init_audio", False, "the checkpoint has no audio encoder")
        audio = data.get("audio_config")
        if hasattr(audio, "to_dict"):
            audio = audio.to_dict()
        if not isinstance(audio, Mapping):
            raise UnsupportedAudioConfigError("audio_config", audio, "a MiniCPM-o config needs an audio_config object")
        audio = dict(audio)
        defaults = cls()
        values = {name: audio.get(name, getattr(defaults, name))
                  for name in ("num_mel_bins", "d_model", "encoder_layers", "encoder_attention_heads",
                               "encoder_ffn_dim", "max_source_positions")}
        check_whisper_attributes(audio, model_type=_MODEL_TYPE, implemented="only the Whisper encoder is implemented",
                                 encoder_layers=values["encoder_layers"], layer_norm_eps=TORCH_LAYER_NORM_EPS)
        if "hidden_size" not in data:
            raise UnsupportedAudioConfigError("hidden_size", None, "the LLM hidden size (projector width) is missing")
        return cls(**values, output_dim=data["hidden_size"],
                   chunk_length=data.get("audio_chunk_length", defaults.chunk_length),
                   pool_step=data.get("audio_pool_step", defaults.pool_step), dtype=dtype)


MINICPMO_4_5_AUDIO = AudioConfig()  # Whisper-medium encoder, Qwen3-8B width


IntOrArray = TypeVar("IntOrArray", int, np.ndarray, jax.Array)


def cnn_frames(mel_frames: IntOrArray) -> IntOrArray:
    """CNN frames for `mel_frames` mel frames: `(T - 1) // 2 + 1` (ints or integer arrays)."""
    return (mel_frames - 1) // 2 + 1


def audio_token_count(mel_frames: int, pool_step: int = 5) -> int:
    """Audio tokens of a clip of `mel_frames` mel frames: `(cnn_frames(T) - pool_step) // pool_step + 1`, 0 when the
    clip is too short for one pooling window (below 9 mel frames for pool_step 5)."""
    if isinstance(mel_frames, bool) or not isinstance(mel_frames, (int, np.integer)) or mel_frames < 0:
        raise ValueError(f"mel_frames must be a non-negative integer, got {mel_frames!r}")
    if mel_frames == 0:
        return 0
    return max(0, (cnn_frames(int(mel_frames)) - pool_step) // pool_step + 1)
