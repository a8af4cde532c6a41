"""Qwen3-Omni audio encoder settings: `Qwen3AudioConfig` (read from a Hugging Face `audio_config` by `from_hf`) and
the token count the encoder makes of a clip.

The encoder itself is `omnijax.models.qwen3_omni.audio`, which re-exports every public name here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

if TYPE_CHECKING:
    import jax

from omnijax._checks import JsonConfig, check_config_fields, int_fields
from omnijax.models.encoders.common import (
    HF_GENERATION_CONFIG_ATTRIBUTES,
    HF_PRETRAINED_CONFIG_ATTRIBUTES,
    ConfigAttributeError,
    understood_attributes,
)
from omnijax.models.encoders.whisper import UnsupportedAudioConfigError, check_whisper_attributes

__all__ = ["QWEN3_OMNI_30B_A3B_AUDIO", "Qwen3AudioConfig", "Qwen3AudioConfigError", "audio_token_count", "ceil_half",
           "conv_tokens"]

_MODEL_TYPE = "qwen3_omni_moe_audio_encoder"
Length = TypeVar("Length", int, np.ndarray, "jax.Array")  # a length, or an array of them (host or device)
_REFERENCE_CHUNK = 100  # frames per chunk hard-coded in the reference's token-count formula
_REFERENCE_CHUNK_TOKENS = 13


def ceil_half(n: Length) -> Length:
    """Output length of a kernel-3, stride-2, padding-1 convolution over `n` positions (works on arrays too)."""
    return (n + 1) // 2


def conv_tokens(n: Length) -> Length:
    """Tokens three stride-2 convolutions make of `n` frames."""
    return ceil_half(ceil_half(ceil_half(n)))


def audio_token_count(frames: int) -> int:
    """Audio tokens for `frames` mel frames: 13 per full 100-frame chunk plus `ceil^3` of the rest.

    Equals transformers' `_get_feat_extract_output_lengths` (0 for 0 frames).
    """
    if isinstance(frames, bool) or not isinstance(frames, (int, np.integer)) or frames < 0:
        raise ValueError(f"frames must be a non-negative integer, got {frames!r}")
    frames = int(frames)
    return _REFERENCE_CHUNK_TOKENS * (frames // _REFERENCE_CHUNK) + conv_tokens(frames % _REFERENCE_CHUNK)


class Qwen3AudioConfigError(ConfigAttributeError):
    """Inconsistent Qwen3-Omni audio encoder settings. Attributes: `attribute`, `value`."""

    subject = "Qwen3-Omni audio config"


@dataclasses.dataclass(frozen=True)
class Qwen3AudioConfig(JsonConfig):
    """Static hyperparameters of the Qwen3-Omni audio encoder (defaults: Qwen3-Omni-30B-A3B).

    Attributes:
        num_mel_bins: mel bins M of the input features.
        d_model: encoder width D; divisible by the head count, even and at least 4 (sinusoidal positions).
        encoder_layers: transformer layers L.
        encoder_attention_heads: attention heads.
        encoder_ffn_dim: feed-forward width F.
        downsample_hidden_size: channels C of the three Conv2d.
        output_dim: output width O (the LLM hidden size).
        n_window: half the chunk length in frames; must be 50 (the reference's token formula assumes 100).
        n_window_infer: attention window in frames; `n_window_infer // (2 * n_window)` chunks per window (>= 1).
        max_source_positions: rows of the sinusoidal position table; at least the 13 tokens of a chunk.
        dtype: compute dtype name ("float32" or "bfloat16"); parameters are stored in it too.
    """

    num_mel_bins: int = 128
    d_model: int = 1280
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    downsample_hidden_size: int = 480
    output_dim: int = 2048
    n_window: int = 50
    n_window_infer: int = 800
    max_source_positions: int = 1500
    dtype: str = "float32"

    def __post_init__(self):
        check_config_fields(self, Qwen3AudioConfigError, positive=int_fields(type(self)))
        if self.d_model % self.encoder_attention_heads:
            raise Qwen3AudioConfigError("encoder_attention_heads", self.encoder_attention_heads,
                                        f"does not divide d_model={self.d_model}")
        if self.d_model % 2 or self.d_model < 4:
            raise Qwen3AudioConfigError("d_model", self.d_model, "must be even and at least 4 (sinusoidal positions)")
        if 2 * self.n_window != _REFERENCE_CHUNK:
            raise Qwen3AudioConfigError("n_window", self.n_window, "must be 50: the reference's token-count formula "
                                        "hard-codes 100-frame chunks")
        if self.n_window_infer < self.chunk_frames:
            raise Qwen3AudioConfigError("n_window_infer", self.n_window_infer,
                                        f"must be at least one chunk ({self.chunk_frames} frames)")
        if self.max_source_positions < self.tokens_per_chunk:
            raise Qwen3AudioConfigError("max_source_positions", self.max_source_positions,
                                        f"must cover the {self.tokens_per_chunk} tokens of a chunk")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads

    @property
    def chunk_frames(self) -> int:
        """Mel frames per chunk (`2 * n_window` = 100)."""
        return 2 * self.n_window

    @property
    def tokens_per_chunk(self) -> int:
        """Tokens of a full chunk (13)."""
        return conv_tokens(self.chunk_frames)

    @property
    def window_chunks(self) -> int:
        """Chunks per attention window (`n_window_infer // chunk_frames`, rounded down as the reference does)."""
        return self.n_window_infer // self.chunk_frames

    @property
    def conv_out_features(self) -> int:
        """P: the flattened `[channels, mel / 8]` conv features `conv_out` projects."""
        return self.downsample_hidden_size * conv_tokens(self.num_mel_bins)

    @classmethod
    def from_hf(cls, audio_config: Mapping[str, Any], dtype: str = "float32") -> "Qwen3AudioConfig":
        """Reads a Hugging Face `Qwen3OmniMoeAudioEncoderConfig` (a dict or an object with `to_dict`).

        Missing attributes take the Hugging Face class defaults (note its `n_window` default, 100, is refused).
        Dropout rates, `conv_chunksize` (a memory split), generation settings and the generic attributes of every
        Hugging Face config are ignored.

        Raises:
            UnsupportedAudioConfigError: an attribute not understood; a `model_type` other than
                `qwen3_omni_moe_audio_encoder`; `activation_function` other than `gelu`; `scale_embedding` true
                (the reference never applies it); `num_hidden_layers != encoder_layers`; `layer_norm_eps` other
                than 1e-5; `n_window` other than 50.
            Qwen3AudioConfigError: the values are inconsistent.
        """
        data = dict(audio_config.to_dict() if hasattr(audio_config, "to_dict") else audio_config)
        values = understood_attributes(data, _HF_DEFAULTS, _HF_HARMLESS, error=UnsupportedAudioConfigError,
                                       where="audio_config.", encoder="Qwen3-Omni audio encoder")
        check_whisper_attributes(data, model_type=_MODEL_TYPE, encoder_layers=values["encoder_layers"],
                                 layer_norm_eps=1e-5,
                                 implemented=f"only the Qwen3-Omni audio tower ({_MODEL_TYPE}) is implemented")
        if 2 * values["n_window"] != _REFERENCE_CHUNK:
            raise UnsupportedAudioConfigError("audio_config.n_window", values["n_window"], "only 50 is implemented: "
                                              "the reference's token-count formula hard-codes 100-frame chunks")
        return cls(**values, dtype=dtype)


# Math-bearing attributes and the Hugging Face class defaults.
_HF_DEFAULTS = dict(num_mel_bins=128, d_model=1280, encoder_layers=32, encoder_attention_heads=20,
                    encoder_ffn_dim=5120, downsample_hidden_size=480, output_dim=3584, n_window=100,
                    n_window_infer=400, max_source_positions=1500)
# Checked by `check_whisper_attributes`, without effect at inference, or generic/generation settings.
_HF_HARMLESS = HF_PRETRAINED_CONFIG_ATTRIBUTES | HF_GENERATION_CONFIG_ATTRIBUTES | frozenset("""
    activation_function scale_embedding num_hidden_layers layer_norm_eps dropout attention_dropout activation_dropout
    conv_chunksize
""".split())

QWEN3_OMNI_30B_A3B_AUDIO = Qwen3AudioConfig()
