"""PCM frames as engine input: one frame of 16 kHz int16 audio -> an audio unit chunk of the model's family
(Qwen2.5-Omni: 25 audio tokens per second; Qwen3-Omni: the AuT encoder's 13 per 100 mel frames)."""

from __future__ import annotations

import numpy as np

from omnijax.serve.native.protocol import SAMPLE_RATE


def _qwen3(model) -> bool:
    return getattr(model, "model_type", None) == "qwen3_omni"


def frame_tokens(samples: int, model=None) -> int:
    """Chunk tokens of one frame of `samples` PCM samples: its audio tokens plus the two markers (Qwen2.5-Omni's
    count unless `model` is a Qwen3-Omni thinker)."""
    if _qwen3(model):
        from omnijax.models.qwen3_omni import frontend

        return frontend.num_audio_tokens(samples) + 2
    from omnijax.models.qwen2_5_omni import frontend

    return frontend.num_audio_tokens(samples) + 2


class AudioFrameEncoder:
    """PCM frame -> audio unit chunk: `log_mel` -> the model's audio encoder -> its family's `audio_unit`, padded
    to T.

    Args:
        model: an `omnijax.Model` with an audio encoder.
        chunk_tokens: the engine's padded per-tick length T.
        answer_tokens: greedy tokens asked after every frame.
    """

    def __init__(self, model, *, chunk_tokens: int, answer_tokens: int):
        from flax import nnx

        if getattr(model, "audio", None) is None:
            raise ValueError("the checkpoint has no audio encoder: omnijax-serve needs an audio_config and its "
                             "thinker.audio_tower.* tensors")
        self.model, self.chunk_tokens, self.answer_tokens = model, chunk_tokens, answer_tokens
        self._split = nnx.split(model.audio)  # split once: encode_audio accepts (graphdef, params)
        self._mel_bins = model.audio.config.num_mel_bins

    def encode(self, pcm: np.ndarray, unit: int):
        """`[samples]` int16 PCM -> a batch-1 `Chunk` of length `chunk_tokens`."""
        from omnijax.chunks.chunk import pad_chunk

        if _qwen3(self.model):  # the Qwen3-Omni processor's features (reflected edges, samples // 160 frames)
            from omnijax.models.qwen3_omni.layout import audio_unit
            from omnijax.models.qwen3_omni.audio import encode_audio
            from omnijax.models.qwen3_omni.frontend import log_mel
        else:
            from omnijax.models.qwen2_5_omni.layout import audio_unit
            from omnijax.models.encoders.whisper import encode_audio
            from omnijax.models.encoders.log_mel import log_mel

        audio = np.asarray(pcm, np.float32) / 32768.0
        features = np.asarray(encode_audio(self._split, log_mel(audio, SAMPLE_RATE, num_mel_bins=self._mel_bins)),
                              np.float32)
        chunk = audio_unit(features.shape[0], unit, features, answer_tokens=self.answer_tokens,
                           tokens=getattr(self.model, "omni", None))  # the checkpoint's <|audio_bos|>, <|AUDIO|>, ...
        return pad_chunk(chunk, self.chunk_tokens)
