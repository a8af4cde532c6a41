"""MiniCPM-o 4.5 full-duplex decoding decisions: the release's greedy rule for each generated token of a unit.

Per decision, on the last-position logits `[V]` of what was fed so far:
    1. the raw argmax is `<|chunk_eos|>`: take it (the unit ends);
    2. otherwise forbidden ids (the TTS pad, the tokenizer's bad tokens, `<|chunk_eos|>` itself) get -inf;
    3. repetition penalty: the logit of every distinct id in the recent decode history (a window of the last
       `history_window` decoded tokens) is divided by `repetition_penalty` — divided even when negative, which
       raises it (the release does this; it is not the usual sign-aware penalty);
    4. the `<|turn_eos|>` logit is divided by `turn_eos_penalty` when positive, multiplied when negative;
    5. argmax; a decoded `<|listen|>` while the turn is open becomes `<|tts_bos|>`.
All in numpy on host: decisions are taken between jitted forward steps.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class DuplexDecodeRule:
    """The release's greedy duplex decision (token ids of the model's vocabulary)."""

    chunk_eos: int
    turn_eos: int
    listen: int
    tts_bos: int
    forbidden: tuple[int, ...] = ()
    repetition_penalty: float = 1.05
    turn_eos_penalty: float = 1.1
    history_window: int = 512

    def choose(self, logits: np.ndarray, history: Sequence[int], *, turn_open: bool = False) -> int:
        """One decision from last-position logits `[V]` and the ids decoded so far (oldest first)."""
        logits = np.asarray(logits, np.float64)
        if logits.ndim != 1:
            raise ValueError(f"logits must be [vocab], got shape {logits.shape}")
        if int(np.argmax(logits)) == self.chunk_eos:
            return self.chunk_eos
        z = logits.copy()
        z[[i for i in self.forbidden if i < z.shape[0]] + [self.chunk_eos]] = -np.inf
        recent = sorted({int(t) for t in list(history)[-self.history_window:] if 0 <= t < z.shape[0]})
        z[recent] = z[recent] / self.repetition_penalty
        t = self.turn_eos
        z[t] = z[t] / self.turn_eos_penalty if z[t] > 0 else z[t] * self.turn_eos_penalty
        token = int(np.argmax(z))
        return self.tts_bos if token == self.listen and turn_open else token


@dataclasses.dataclass(frozen=True)
class DuplexTokens:
    """Marker ids of the 4.5 duplex layout."""

    unit_start: int
    unit_end: int
    image_start: int
    image_end: int
    listen: int
    chunk_eos: int
    chunk_tts_eos: int

    @classmethod
    def of(cls, model) -> "DuplexTokens":
        """The duplex markers of a loaded checkpoint (`model.special_tokens`, from its tokenizer files).

        Raises ValueError naming the markers the checkpoint does not declare (there is no release default for
        them here: pass `DuplexTokens(...)` explicitly for such a checkpoint).
        """
        texts = {"unit_start": "<unit>", "unit_end": "</unit>", "image_start": "<image>", "image_end": "</image>",
                 "listen": "<|listen|>", "chunk_eos": "<|chunk_eos|>", "chunk_tts_eos": "<|chunk_tts_eos|>"}
        special = getattr(model, "special_tokens", None) or {}
        missing = [text for text in texts.values() if text not in special]
        if missing:
            raise ValueError(f"the checkpoint's tokenizer declares no id for {missing} (convert a checkpoint that "
                             f"ships its tokenizer files, or pass tokens=DuplexTokens(...))")
        return cls(**{field: int(special[text]) for field, text in texts.items()})


@dataclasses.dataclass
class UnitResult:
    """One unit's outcome: the ids decoded (in order), whether the model listened, and each decision's logits."""

    tokens: list
    listened: bool
    logits: list


class DuplexSession:
    """The 4.5 full-duplex loop on one `MiniCPMOModel`: a system prompt with a reference voice clip, then one unit per
    second of input (an optional video frame and 1 s of 16 kHz audio) answered by up to `max_speak_tokens - 1`
    greedy tokens.

    The LLM runs through `omnijax.Session` (the streaming scan's jitted step; every chunk is padded to one width so
    it compiles once); the audio runs through the streaming Whisper encoder with its own cache; decisions use the
    release's `DuplexDecodeRule`. Positions are session indices (1D RoPE). `fed` records every (ids or embedding
    rows) chunk in order, `decoded` every decoded id (the repetition-penalty history).
    """

    def __init__(self, model, *, rule: DuplexDecodeRule, tokens: DuplexTokens | None = None, max_speak_tokens: int = 4,
                 force_listen: int = 1, num_pages: int = 64, page_size: int = 64, chunk_width: int = 128,
                 max_slice_nums: int = 1, policy=None):
        from omnijax.retention.base import NoSlide
        from omnijax.streaming import Session
        # The checkpoint's marker ids unless given (`DuplexTokens.of`).
        self.model, self.tokens, self.rule = model, DuplexTokens.of(model) if tokens is None else tokens, rule
        self.max_speak_tokens, self.force_listen, self.width = max_speak_tokens, force_listen, chunk_width
        self.max_slice_nums = max_slice_nums
        self.session = Session(model, policy=policy or NoSlide(), num_pages=num_pages, page_size=page_size)
        self.decoded: list[int] = []
        self.units = 0
        self._mel = None
        self._audio_cache = None
        self._unit_id = 0

    def feed(self, rows: list) -> np.ndarray:
        """Feeds a list of items (an int id, or a `[n, D]` embedding block) as one chunk; returns the last logits.

        Raises RuntimeError once the pool has run out (some token was not cached), rather than decide on without it.
        """
        from omnijax.chunks import Chunk, pad_chunk
        from omnijax.units import SpanKind
        D = self.model.config.hidden_size
        ids, embeds, mask = [], [], []
        for item in rows:
            if isinstance(item, (int, np.integer)):
                ids.append(int(item))
                embeds.append(np.zeros((1, D), np.float32))
                mask.append(False)
            else:
                block = np.asarray(item, np.float32)
                ids += [0] * block.shape[0]
                embeds.append(block)
                mask += [True] * block.shape[0]
        n = len(ids)
        if n > self.width:
            raise ValueError(f"a chunk of {n} rows exceeds chunk_width {self.width}")
        chunk = Chunk(token_ids=np.asarray([ids]), valid=np.ones((1, n), bool), positions=np.arange(n)[None, None],
                      unit=np.full((1, n), self._unit_id, np.int32),
                      span=np.where(np.asarray([mask]), SpanKind.AUDIO, SpanKind.BOUNDARY).astype(np.int8),
                      offset=np.arange(n, dtype=np.int32)[None], answer_tokens=np.zeros((1,), np.int32),
                      answer_unit=np.zeros((1,), np.int32), advance=np.full((1,), n, np.int32),
                      embeds=np.concatenate(embeds)[None], embed_mask=np.asarray([mask]))
        out = self.session.feed(pad_chunk(chunk, self.width))
        logits = np.asarray(out.logits[0])  # waits for the step
        if bool(out.stats.layout.exhausted[0]):
            # A decision made without the tokens the pool could not hold would be silently wrong from here on.
            raise RuntimeError(f"the duplex session's KV pool ran out: {int(out.stats.layout.dropped[0])} token(s) "
                               f"were not cached; give a larger num_pages (now {self.session.state.kv.num_pages}) or "
                               f"a policy that bounds the cache")
        return logits

    def prepare(self, prefix_ids, suffix_ids, ref_audio=None) -> None:
        """The system part: `prefix_ids`, the reference clip's offline audio embeddings, `suffix_ids`."""
        from omnijax.models.minicpmo import audio as audio_lib
        from omnijax.models.minicpmo import audio_features
        rows = list(prefix_ids)
        if ref_audio is not None:
            rows.append(np.asarray(audio_lib.encode_audio(self.model.audio, audio_features.log_mel(ref_audio))))
        self.feed(rows + list(suffix_ids))
        self._unit_id += 1

    def step(self, pcm, frame=None) -> UnitResult:
        """One unit: `<unit>` [`<image>` frame `</image>`] audio, then the listen/speak decision and its tokens."""
        from omnijax.models.minicpmo import audio_features, audio_stream
        from omnijax.models.minicpmo import vision as vision_lib
        t = self.tokens
        chunk, self._mel = audio_features.mel_stream_step(self._mel or audio_features.mel_stream_start(), pcm)
        if chunk is None:
            raise ValueError("not enough audio for a unit yet (the first unit needs its full 1 s chunk)")
        audio, self._audio_cache = audio_stream.encode_audio_streaming(self.model.audio, chunk, self._audio_cache)
        rows = [t.unit_start]
        if frame is not None:
            embeds, _ = vision_lib.encode_image(self.model.vision, frame, max_slice_nums=self.max_slice_nums)
            embeds = np.asarray(embeds)
            rows += [t.image_start, embeds.reshape(-1, embeds.shape[-1]), t.image_end]
        rows.append(np.asarray(audio))
        logits = self.feed(rows)
        result = UnitResult(tokens=[], listened=False, logits=[logits])
        if self.units < self.force_listen:
            result.listened = True
            self.feed([t.listen])
        else:
            for i in range(self.max_speak_tokens - 1):
                token = self.rule.choose(logits, self.decoded)
                logits = self.feed([token])
                if token in (t.listen, t.chunk_eos, t.chunk_tts_eos):
                    result.listened = token == t.listen
                    break
                result.tokens.append(token)
                result.logits.append(logits)
                self.decoded.append(token)
            else:
                self.feed([t.chunk_eos])
        self.feed([t.unit_end])
        self.units += 1
        self._unit_id += 1
        return result
