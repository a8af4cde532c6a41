"""Qwen3-Omni vision encoder settings: `Qwen3VisionConfig`, read from a Hugging Face `vision_config` by `from_hf`.

The encoder itself is `omnijax.models.qwen3_omni.vision`, which re-exports every name here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from omnijax._checks import JsonConfig, check_config_fields
from omnijax.errors import UnsupportedConfigError
from omnijax.models.encoders.common import (
    HF_GENERATION_CONFIG_ATTRIBUTES,
    HF_PRETRAINED_CONFIG_ATTRIBUTES,
    ConfigAttributeError,
    understood_attributes,
)

__all__ = ["ACTIVATIONS", "QWEN3_OMNI_30B_A3B_VISION", "Qwen3VisionConfig", "Qwen3VisionConfigError",
           "UnsupportedVisionConfigError"]

_MODEL_TYPE = "qwen3_omni_moe_vision_encoder"
# Block MLP activations (transformers' ACT2FN names): whether each is the tanh approximation (else the exact erf GELU).
ACTIVATIONS = {"gelu_pytorch_tanh": True, "gelu_new": True, "gelu": False}


class Qwen3VisionConfigError(ConfigAttributeError):
    """Inconsistent Qwen3-Omni vision encoder settings. Attributes: `attribute`, `value`."""

    subject = "Qwen3-Omni vision config"


class UnsupportedVisionConfigError(UnsupportedConfigError, ValueError):
    """A vision config attribute changes the math in a way this encoder does not implement."""


@dataclasses.dataclass(frozen=True)
class Qwen3VisionConfig(JsonConfig):
    """Static hyperparameters of the Qwen3-Omni vision encoder (defaults: Qwen3-Omni-30B-A3B).

    Attributes:
        depth: transformer blocks L.
        hidden_size: width D.
        num_heads: attention heads; `hidden_size / num_heads` must be a multiple of 4 (2D rotary halves).
        intermediate_size: MLP width I.
        out_hidden_size: merger output width O (the LLM's hidden size).
        num_position_embeddings: rows G of the learned position table; its first `isqrt(G)**2` rows form the
            square grid that is interpolated.
        patch_size: spatial patch side in px.
        spatial_merge_size: patches per merged token side.
        temporal_patch_size: frames per patch.
        in_channels: colour channels.
        deepstack_visual_indexes: blocks whose outputs feed the DeepStack mergers (merger k serves the block
            listed k-th; the features come out in block order, as the reference lists them).
        hidden_act: block MLP activation, one of `gelu_pytorch_tanh`, `gelu_new` (tanh approximation) or `gelu`.
        dtype: compute and parameter dtype name ("float32" or "bfloat16").
    """

    depth: int = 27
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 4304
    out_hidden_size: int = 2048
    num_position_embeddings: int = 2304
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    in_channels: int = 3
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    hidden_act: str = "gelu_pytorch_tanh"
    dtype: str = "float32"

    def __post_init__(self):
        object.__setattr__(self, "deepstack_visual_indexes", tuple(int(i) for i in self.deepstack_visual_indexes))
        check_config_fields(self, Qwen3VisionConfigError,
                            positive=("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size",
                                      "num_position_embeddings", "patch_size", "spatial_merge_size",
                                      "temporal_patch_size", "in_channels"))
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise Qwen3VisionConfigError("num_heads", self.num_heads, f"hidden_size {self.hidden_size} must split "
                                         "into heads whose width is a multiple of 4")
        if self.hidden_act not in ACTIVATIONS:
            raise Qwen3VisionConfigError("hidden_act", self.hidden_act, f"must be one of {sorted(ACTIVATIONS)}")
        levels = self.deepstack_visual_indexes
        bad = [i for i in levels if not 0 <= i < self.depth]
        if bad:
            raise Qwen3VisionConfigError("deepstack_visual_indexes", list(levels), f"{bad} outside the "
                                         f"{self.depth} blocks")
        if len(set(levels)) != len(levels):
            raise Qwen3VisionConfigError("deepstack_visual_indexes", list(levels), "a block is listed twice")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """P: values per pixel row, channels * temporal patch * patch**2 (1536)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches per merged (LLM) token."""
        return self.spatial_merge_size ** 2

    @property
    def merged_dim(self) -> int:
        """E: width of 2x2 concatenated patches."""
        return self.merge_unit * self.hidden_size

    @property
    def grid_side(self) -> int:
        """Side of the learned position grid (48)."""
        return math.isqrt(self.num_position_embeddings)

    @property
    def num_deepstack(self) -> int:
        """K: DeepStack levels."""
        return len(self.deepstack_visual_indexes)

    @property
    def deepstack_slots(self) -> tuple[int, ...]:
        """Per block: the DeepStack level its output feeds, or -1."""
        return tuple(self.deepstack_visual_indexes.index(i) if i in self.deepstack_visual_indexes else -1
                     for i in range(self.depth))

    @classmethod
    def from_hf(cls, vision_config: Mapping[str, Any], dtype: str = "float32") -> "Qwen3VisionConfig":
        """Reads a Hugging Face `Qwen3OmniMoeVisionEncoderConfig` (a dict or an object with `to_dict`).

        Missing attributes take the Hugging Face class defaults. Generic and generation attributes,
        `tokens_per_second` (LLM positions only), and `in_chans` / `spatial_patch_size` (not read by the reference)
        are ignored. `apply_vit_abs_pos_embed` must be true and `image_size`, when given, must describe the
        position table (`(image_size / patch_size)**2 == num_position_embeddings`).

        Raises:
            UnsupportedVisionConfigError: an attribute is not understood; `model_type` is another model's;
                `hidden_act` is not a GELU; `apply_vit_abs_pos_embed` is false; `image_size` disagrees with the
                position table.
            Qwen3VisionConfigError: the values are inconsistent.
        """
        data = dict(vision_config.to_dict() if hasattr(vision_config, "to_dict") else vision_config)
        v = understood_attributes(data, _HF_DEFAULTS, _HF_HARMLESS, error=UnsupportedVisionConfigError,
                                  where="vision_config.", encoder="Qwen3-Omni vision encoder")
        if data.get("model_type", _MODEL_TYPE) != _MODEL_TYPE:
            raise UnsupportedVisionConfigError("vision_config.model_type", data["model_type"],
                                               f"only the Qwen3-Omni vision encoder ({_MODEL_TYPE}) is implemented")
        if v["hidden_act"] not in ACTIVATIONS:
            raise UnsupportedVisionConfigError("vision_config.hidden_act", v["hidden_act"],
                                               f"only {sorted(ACTIVATIONS)} are implemented")
        if v.pop("apply_vit_abs_pos_embed") is not True:
            raise UnsupportedVisionConfigError("vision_config.apply_vit_abs_pos_embed",
                                               data["apply_vit_abs_pos_embed"], "only the encoder that adds the "
                                               "learned position table (true) is implemented")
        image_size = v.pop("image_size")
        if image_size is not None and (image_size % v["patch_size"] or
                                       (image_size // v["patch_size"]) ** 2 != v["num_position_embeddings"]):
            raise UnsupportedVisionConfigError("vision_config.image_size", image_size, "does not describe the "
                                               f"{v['num_position_embeddings']}-row position table with patch_size "
                                               f"{v['patch_size']}")
        v["deepstack_visual_indexes"] = tuple(v["deepstack_visual_indexes"] or ())
        return cls(**v, dtype=dtype)


# Math-bearing attributes and the Hugging Face class defaults (`apply_vit_abs_pos_embed` and `image_size` are
# only checked).
_HF_DEFAULTS = dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304, num_heads=16,
                    in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584,
                    num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
                    apply_vit_abs_pos_embed=True, image_size=None)
_HF_HARMLESS = HF_PRETRAINED_CONFIG_ATTRIBUTES | HF_GENERATION_CONFIG_ATTRIBUTES | frozenset("""
    tokens_per_second in_chans spatial_patch_size
""".split())

QWEN3_OMNI_30B_A3B_VISION = Qwen3VisionConfig()
