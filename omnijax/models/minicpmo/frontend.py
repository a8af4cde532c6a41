"""What `omnijax.Chat` and the server feed a MiniCPM-o 4.5 model: text turns and `<unit>`s of 1 s audio with at most
one frame, as its streaming mode takes them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from omnijax.chunks.chunk import Chunk
from omnijax.chunks.spans import SpanKind
from omnijax.models.frontend import ChatUnits, require_encoder
from omnijax.models.minicpmo import audio as audio_lib
from omnijax.models.minicpmo import audio_features, layout
from omnijax.models.minicpmo import vision as vision_lib

if TYPE_CHECKING:
    from omnijax.models.minicpmo.model import MiniCPMOModel

CHATML_IM_START, CHATML_IM_END = 151644, 151645  # <|im_start|>, <|im_end|> of MiniCPM-o 4.5's Qwen3 vocabulary


class MiniCPMOUnits(ChatUnits):
    """MiniCPM-o 4.5 units: 1 s of audio with at most one frame each, as its streaming mode takes them."""

    unit_seconds, fps, temporal_patch_size = 1.0, 1.0, 1

    model: MiniCPMOModel

    def __init__(self, model: MiniCPMOModel, *, max_slice_nums: int = 1):
        super().__init__(model)
        self.adapter, self.tokens, self.max_slice_nums = layout, model.tokens, max_slice_nums

    @property
    def chat_markers(self) -> tuple[int, int]:
        special = self.model.special_tokens  # the checkpoint's, else the Qwen3 LLM's chatml ids
        return special.get("<|im_start|>", CHATML_IM_START), special.get("<|im_end|>", CHATML_IM_END)

    def text(self, ids: Sequence[int], unit: int, kind: SpanKind, answer_tokens: int = 0) -> Chunk:
        a = self.adapter
        if kind == SpanKind.SYSTEM:
            return a.system_unit(ids, unit, hidden_size=self.hidden_size)
        if kind == SpanKind.RESPONSE:
            return a.response_unit(ids, unit, hidden_size=self.hidden_size, tokens=self.tokens)
        return a.text_unit(ids, unit, answer_tokens, hidden_size=self.hidden_size, tokens=self.tokens)

    def _unit(self, unit: int, image=None, pcm=None, sample_rate: int = 16_000) -> Chunk:
        """`<unit> [<image> E </image> (<slice> E </slice>)*] [<|audio_start|> A <|audio_end|>] </unit>`."""
        parts = {}
        if image is not None:
            require_encoder(self.model, "vision")
        if pcm is not None:
            require_encoder(self.model, "audio")
        if image is not None:
            embeds, sliced = vision_lib.encode_image(self.model.vision, np.asarray(image),
                                                     max_slice_nums=self.max_slice_nums)
            embeds = np.asarray(embeds, np.float32)
            parts.update(image=True, slices=sliced.grid, image_embeds=embeds.reshape(-1, embeds.shape[-1]))
        if pcm is not None:
            features = audio_features.log_mel(np.asarray(pcm, np.float32), sample_rate)
            audio = np.asarray(audio_lib.encode_audio(self.model.audio, features), np.float32)
            parts.update(audio_tokens=audio.shape[0], audio_embeds=audio)
        return self.adapter.unit_chunk(unit, tokens=self.tokens, hidden_size=self.model.config.hidden_size, **parts)

    def image(self, image: np.ndarray, unit: int) -> Chunk:
        return self._unit(unit, image=image)

    def audio(self, pcm: np.ndarray, sample_rate: int, unit: int) -> Chunk:
        return self._unit(unit, pcm=pcm, sample_rate=sample_rate)

    def av(self, frames: np.ndarray, pcm: np.ndarray, unit: int, **_: Any) -> Chunk:
        frames = self.frames_of(frames)
        if frames.shape[0] != 1:
            raise ValueError(f"a MiniCPM-o unit takes one frame (1 s of audio with the frame seen in it), got "
                             f"{frames.shape[0]}")
        return self._unit(unit, image=frames[0], pcm=pcm)
