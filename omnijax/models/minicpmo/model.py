"""MiniCPM-o 4.5 as one model: the Qwen3-mode decoder with the vision (SigLIP + resampler) and audio (Whisper +
projector + pooling) paths, merged at placeholder positions as the release's `forward` does.

`MiniCPMOModel(input_ids, pixel_values=..., tgt_sizes=..., image_bound=..., audio_features=...,
audio_feature_lens=..., audio_bounds=...)` returns `[B, S, V]` float32 logits with positions 0..S-1 (MiniCPM-o's
1D RoPE: position = index in the session). Image embeddings (64 per source image or slice, in order) replace the
rows of `image_bound` spans; audio embeddings (10 per second, clips in order) replace the rows of `audio_bounds`.
Batch 1 when media are given (bounds are per prompt, as the release's processor returns them for one sample).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from flax import nnx

from omnijax.checkpoint import format as checkpoint
from omnijax.checkpoint import name_tables
from omnijax.models.decoder import Decoder
from omnijax.models.family import FamilyModel
from omnijax.models.forward import forward
from omnijax.models.minicpmo import audio as audio_lib
from omnijax.models.minicpmo import vision as vision_lib
from omnijax.models.minicpmo.layout import TOKEN_TEXT, MiniCPMTokens

if TYPE_CHECKING:
    from omnijax.models.tokenizer import Tokenizer

# Special tokens a converted checkpoint records from its tokenizer (`special_tokens` in the manifest): the unit
# layout's markers (`omnijax.models.minicpmo.layout.TOKEN_TEXT`) and the duplex decoding's.
DUPLEX_TOKEN_TEXT = ("<|chunk_tts_eos|>", "<|turn_eos|>", "<|tts_bos|>", "<|tts_eos|>", "<|tts_pad|>")


def special_token_texts() -> tuple[str, ...]:
    return tuple(TOKEN_TEXT.values()) + DUPLEX_TOKEN_TEXT


class MiniCPMOInputError(ValueError):
    """Inputs that do not fit together (bounds vs embeddings, missing encoders, shapes)."""


def _spans(bounds, what: str, length: int) -> list[tuple[int, int]]:
    bounds = np.asarray(bounds, np.int64).reshape(-1, 2)
    for start, end in bounds:
        if not 0 <= start <= end <= length:
            raise MiniCPMOInputError(f"{what} span [{start}, {end}) lies outside the prompt of {length} tokens")
    return [(int(s), int(e)) for s, e in bounds]


class MiniCPMOModel(FamilyModel):
    """A loaded MiniCPM-o 4.5: `decoder`, optional `vision` (`MiniCPMVision`) and `audio` (`AudioEncoder`).

    `special_tokens`: token text -> id as the checkpoint's tokenizer declares them (empty when it shipped none);
    `tokens` is the unit layout's ids (`MiniCPMTokens`: the release's, overridden by the checkpoint's).
    """

    model_type = "minicpmo"

    def __init__(self, decoder: Decoder, *, vision: vision_lib.MiniCPMVision | None = None,
                 audio: audio_lib.AudioEncoder | None = None, source: str | None = None,
                 special_tokens: dict[str, int] | None = None, tokenizer: Tokenizer | None = None):
        self.decoder, self.vision, self.audio, self.source = decoder, vision, audio, source
        self.special_tokens = dict(special_tokens or {})
        self.tokenizer = tokenizer  # omnijax.models.tokenizer.Tokenizer or None (set by omnijax.load)

    @property
    def tokens(self) -> MiniCPMTokens:
        """The unit layout's token ids (`omnijax.models.minicpmo.layout.MiniCPMTokens`) of this checkpoint."""
        return MiniCPMTokens.from_special_tokens(self.special_tokens)

    def embed(self, input_ids: npt.ArrayLike, *, pixel_values: Sequence[np.ndarray] | None = None,
              tgt_sizes: npt.ArrayLike | None = None, image_bound: npt.ArrayLike | None = None,
              audio_features: npt.ArrayLike | None = None, audio_feature_lens: npt.ArrayLike | None = None,
              audio_bounds: npt.ArrayLike | None = None) -> jax.Array:
        """`[B, S, D]` LLM inputs: token embeddings with image and audio rows scattered in."""
        ids = np.asarray(input_ids)
        if ids.ndim != 2:
            raise MiniCPMOInputError(f"input_ids must be [batch, seq], got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise MiniCPMOInputError(f"input_ids must be integer token ids, got dtype {ids.dtype}")
        B, S = ids.shape
        rows = np.zeros((S, self.config.hidden_size), np.float32)
        mask = np.zeros((S,), bool)
        media = []
        if pixel_values is not None:
            if self.vision is None:
                raise MiniCPMOInputError("pixel_values given but this checkpoint has no vision encoder")
            spans = _spans(image_bound if image_bound is not None else np.zeros((0, 2)), "image_bound", S)
            embeds = np.asarray(vision_lib.encode_images(self.vision, pixel_values, tgt_sizes))  # [n, 64, D]
            media.append(("image", spans, embeds.reshape(-1, embeds.shape[-1]), embeds.shape[0] * embeds.shape[1]))
        if audio_features is not None:
            if self.audio is None:
                raise MiniCPMOInputError("audio_features given but this checkpoint has no audio encoder")
            features = np.asarray(audio_features, np.float32)
            lens = np.asarray(audio_feature_lens if audio_feature_lens is not None
                              else [features.shape[-1]] * features.shape[0]).reshape(-1)
            clips = [features[i, :, :int(n)] for i, n in enumerate(lens)]
            tokens = audio_lib.encode_audio_batch(self.audio, clips)
            embeds = np.concatenate([np.asarray(t) for t in tokens], axis=0)
            spans = _spans(audio_bounds if audio_bounds is not None else np.zeros((0, 2)), "audio_bounds", S)
            media.append(("audio", spans, embeds, embeds.shape[0]))
        if media and B != 1:
            raise MiniCPMOInputError(f"multimodal inputs take one prompt (batch 1), got batch {B}")
        for what, spans, embeds, count in media:
            need = sum(e - s for s, e in spans)
            if need != count:
                raise MiniCPMOInputError(f"{what} spans cover {need} positions but the encoder produced {count} "
                                         f"embeddings")
            at = 0
            for s, e in spans:
                rows[s:e], mask[s:e] = embeds[at:at + e - s], True
                at += e - s
        text = np.where(mask[None], 0, ids)
        if text.min() < 0 or text.max() >= self.config.vocab_size:
            raise MiniCPMOInputError(f"input_ids must lie in [0, {self.config.vocab_size}) outside media spans")
        x = self.decoder.embed_tokens(jnp.asarray(text, jnp.int32))
        return jnp.where(jnp.asarray(mask)[None, :, None], jnp.asarray(rows, x.dtype)[None], x)

    def __call__(self, input_ids, attention_mask=None, **media) -> jax.Array:
        """One-shot forward: `[B, S, V]` float32 logits (unpadded prompts; positions 0..S-1)."""
        x = self.embed(input_ids, **media)
        B, S, _ = x.shape
        if attention_mask is not None and not np.asarray(attention_mask).all():
            raise MiniCPMOInputError("padded batches are not supported: attention_mask must be all ones")
        positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (1, B, S))
        graphdef, params = nnx.split(self.decoder)
        ids = jnp.zeros((B, S), jnp.int32)
        return forward(graphdef, params, ids, jnp.ones((B, S), bool), positions, x, jnp.ones((B, S), bool), None,
                        page_size=64)


def load(directory: Path, manifest: dict[str, Any], decoder: Decoder) -> MiniCPMOModel:
    """Restores the encoders of a converted MiniCPM-o checkpoint next to its decoder (each part is stored in its
    own directory under the component name of its conversion table)."""

    def restore(component, config):
        shapes = name_tables.param_shapes(component)
        abstract = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, config.jnp_dtype), shapes,
                                is_leaf=lambda x: isinstance(x, tuple))
        return checkpoint.load_params(directory, abstract, component.name)

    vision = audio = None
    if "vpm" in manifest:
        config = vision_lib.VisionConfig.from_json(manifest["vpm"])
        vision = vision_lib.vision_from_params(config, {c.name: restore(c, config)
                                                        for c in vision_lib.vision_components(config)})
    if "audio" in manifest:
        config = audio_lib.AudioConfig.from_json(manifest["audio"])
        encoder, projection = (restore(c, config) for c in audio_lib.audio_components(config))
        audio = audio_lib.encoder_from_params(config, encoder, projection)
    special = manifest.get("special_tokens", {})
    if not isinstance(special, dict) or not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                                                for k, v in special.items()):
        raise ValueError(f"special_tokens must map token text to an id, got {special!r}")
    return MiniCPMOModel(decoder, vision=vision, audio=audio, source=str(directory), special_tokens=special)
