"""Config of MiniCPM-o 4.5's vision path (SigLIP/NaViT encoder `vpm` + perceiver resampler) and its reader of the
release's `config.json`. The modules live in `omnijax.models.minicpmo.vision` (which re-exports these names).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from omnijax._checks import DTYPES, JsonConfig
from omnijax.models.encoders.common import HF_PRETRAINED_CONFIG_ATTRIBUTES, ConfigAttributeError, understood_attributes

# The same error as the Qwen2.5-Omni vision encoder's: a vision or resampler attribute changes the math in a way this
# implementation does not cover.
from omnijax.models.qwen2_5_omni.vision import UnsupportedVisionConfigError

__all__ = ["MINICPM_O_4_5_VISION", "RESAMPLER_HEAD_WIDTH", "UnsupportedVisionConfigError", "VisionConfig",
           "VisionConfigError"]

RESAMPLER_HEAD_WIDTH = 128  # the reference builds the resampler with `num_heads = embed_dim // 128`


class VisionConfigError(ConfigAttributeError):
    """Inconsistent vision settings. Attributes: `attribute`, `value`."""

    subject = "MiniCPM-o vision config"


@dataclasses.dataclass(frozen=True)
class VisionConfig(JsonConfig):
    """Static hyperparameters of the MiniCPM-o vision path (SigLIP/NaViT encoder + resampler).

    Attributes:
        hidden_size: SigLIP width D.
        intermediate_size: SigLIP MLP width I.
        num_layers: encoder blocks actually run (after `drop_vision_last_layer`).
        num_heads: SigLIP attention heads.
        embed_dim: resampler width E (the LLM's hidden size).
        resampler_heads: resampler attention heads (`embed_dim // 128` in the releases).
        query_num: learned queries, i.e. LLM tokens per image or slice.
        patch_size: patch side p in px.
        image_size: side in px of the learned position table (`image_size // patch_size` positions per side).
        num_channels: colour channels C.
        layer_norm_eps: SigLIP LayerNorm epsilon (the resampler's is fixed at 1e-6).
        dtype: compute and parameter dtype name ("float32" or "bfloat16").
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    embed_dim: int
    resampler_heads: int
    query_num: int = 64
    patch_size: int = 14
    image_size: int = 980
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    dtype: str = "float32"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise VisionConfigError("dtype", self.dtype, f"must be one of {sorted(DTYPES)}")
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "embed_dim", "resampler_heads",
                     "query_num", "patch_size", "image_size", "num_channels"):
            value = getattr(self, name)
            if isinstance(value, bool) or int(value) != value or int(value) < 1:
                raise VisionConfigError(name, value, "must be a positive integer")
        if self.hidden_size % self.num_heads:
            raise VisionConfigError("num_heads", self.num_heads, f"does not divide hidden_size {self.hidden_size}")
        if self.embed_dim % self.resampler_heads:
            raise VisionConfigError("resampler_heads", self.resampler_heads,
                                    f"does not divide embed_dim {self.embed_dim}")
        if self.embed_dim % 4:
            raise VisionConfigError("embed_dim", self.embed_dim, "must be a multiple of 4 (2D sin-cos positions)")
        if self.image_size < self.patch_size:
            raise VisionConfigError("image_size", self.image_size, f"smaller than one patch ({self.patch_size} px)")
        if not self.layer_norm_eps > 0:
            raise VisionConfigError("layer_norm_eps", self.layer_norm_eps, "must be positive")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def resampler_head_dim(self) -> int:
        return self.embed_dim // self.resampler_heads

    @property
    def num_patches_per_side(self) -> int:
        """Side of the learned position table (70)."""
        return self.image_size // self.patch_size

    @property
    def num_positions(self) -> int:
        return self.num_patches_per_side ** 2

    @property
    def patch_dim(self) -> int:
        """Values per patch row: C * p * p (588)."""
        return self.num_channels * self.patch_size ** 2

    @property
    def has_kv_proj(self) -> bool:
        """The resampler projects the encoder width to `embed_dim` (else `kv_proj` is the identity)."""
        return self.hidden_size != self.embed_dim

    @classmethod
    def from_hf(cls, hf_config: Mapping[str, Any], dtype: str = "float32") -> "VisionConfig":
        """Reads the vision fields of a MiniCPM-o `config.json` (the whole top-level dict).

        Uses `vision_config` (missing attributes take the release's SigLIP defaults), `drop_vision_last_layer`
        (default true), `query_num` (default 64) and `hidden_size` (the LLM width, required). Other top-level
        attributes belong to the LLM, the audio tower or the processor and are not read, except those known to
        change the vision path in later releases, which are refused.

        Raises:
            UnsupportedVisionConfigError: `hidden_act` is not `gelu_pytorch_tanh`, a `vision_config` attribute is not
                understood, or a top-level attribute selects a vision variant this module does not implement.
            VisionConfigError: a required value is missing or the values are inconsistent.
        """
        for key in _REFUSED_TOP_LEVEL:
            if key in hf_config:
                raise UnsupportedVisionConfigError(key, hf_config[key], "selects a vision variant (a ViT merger or "
                                                   "another downsampling) the MiniCPM-o 4.5 vision path lacks")
        vision = hf_config.get("vision_config") or {}
        if not isinstance(vision, Mapping):
            raise VisionConfigError("vision_config", vision, "must be a mapping")
        v = understood_attributes(vision, _VISION_DEFAULTS, _HF_HARMLESS, error=UnsupportedVisionConfigError,
                                  where="vision_config.", encoder="MiniCPM-o vision encoder")
        if v["hidden_act"] != "gelu_pytorch_tanh":
            raise UnsupportedVisionConfigError("vision_config.hidden_act", v["hidden_act"],
                                               "only gelu_pytorch_tanh (the tanh-approximated GELU) is implemented")
        if "hidden_size" not in hf_config:
            raise VisionConfigError("hidden_size", None, "the LLM width (the resampler's output width) is required")
        drop = hf_config.get("drop_vision_last_layer", True)
        if not isinstance(drop, bool):
            raise VisionConfigError("drop_vision_last_layer", drop, "must be true or false")
        layers = int(v["num_hidden_layers"]) - int(drop)
        if layers < 1:
            raise VisionConfigError("vision_config.num_hidden_layers", v["num_hidden_layers"],
                                    f"leaves {layers} encoder layers with drop_vision_last_layer={drop}")
        embed_dim = int(hf_config["hidden_size"])
        if embed_dim < RESAMPLER_HEAD_WIDTH:
            raise VisionConfigError("hidden_size", embed_dim, f"gives 0 resampler heads "
                                    f"(num_heads = hidden_size // {RESAMPLER_HEAD_WIDTH})")
        return cls(hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]),
                   num_layers=layers, num_heads=int(v["num_attention_heads"]), embed_dim=embed_dim,
                   resampler_heads=embed_dim // RESAMPLER_HEAD_WIDTH, query_num=int(hf_config.get("query_num", 64)),
                   patch_size=int(v["patch_size"]), image_size=int(v["image_size"]),
                   num_channels=int(v["num_channels"]), layer_norm_eps=float(v["layer_norm_eps"]), dtype=dtype)


# Math-bearing `vision_config` attributes and the defaults the release's MiniCPMOConfig gives them (SigLIP-400M
# sizes; activation, eps and channels from SiglipVisionConfig).
_VISION_DEFAULTS = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                        patch_size=14, image_size=980, num_channels=3, layer_norm_eps=1e-6,
                        hidden_act="gelu_pytorch_tanh")
# Attributes with no effect on inference (dropout is off in eval; attention kernels compute the same math).
_HF_HARMLESS = HF_PRETRAINED_CONFIG_ATTRIBUTES | {"attention_dropout", "dropout", "_attn_implementation_internal"}
# Top-level attributes of later MiniCPM-V/o releases that change the vision path (ViT-inserted merger, ...).
_REFUSED_TOP_LEVEL = ("vision_model_type", "insert_layer_id")

# Release sizes: MiniCPM-o 4.5 = SigLIP-400M (27 layers configured, the last dropped) + resampler into Qwen3-8B.
MINICPM_O_4_5_VISION = VisionConfig(hidden_size=1152, intermediate_size=4304, num_layers=26, num_heads=16,
                                    embed_dim=4096, resampler_heads=32)
