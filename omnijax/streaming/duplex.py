"""MiniCPM-o 4.5's full-duplex loop driven synchronously over `omnijax.Session`: a system prompt with a reference
voice clip, then one unit per second of input, each answered (or listened to) by the release's decision rule
(`omnijax.models.minicpmo.duplex`)."""

from __future__ import annotations

import jax
import numpy as np

from omnijax.chunks.chunk import Chunk, pad_chunk
from omnijax.chunks.spans import SpanKind
from omnijax.models.minicpmo.duplex import DuplexDecodeRule, DuplexTokens, UnitResult, encode_reference, encode_unit
from omnijax.retention.base import NoSlide
from omnijax.streaming.session import Session


class DuplexSession:
    """The 4.5 full-duplex loop on one `MiniCPMOModel`: a system prompt with a reference voice clip, then one unit per
    second of input (an optional video frame and 1 s of 16 kHz audio) answered by up to `max_speak_tokens - 1`
    greedy tokens.

    The LLM runs through `omnijax.Session` (the streaming scan's jitted step; every chunk is padded to one width so
    it compiles once); the audio runs through the streaming Whisper encoder with its own cache; decisions use the
    release's `DuplexDecodeRule` through its jitted `select` (the history as one fixed `[1, history_window]` width,
    so it compiles once too). Positions are session indices (1D RoPE). `fed` records every (ids or embedding
    rows) chunk in order, `decoded` every decoded id (the repetition-penalty history).
    """

    def __init__(self, model, *, rule: DuplexDecodeRule, tokens: DuplexTokens | None = None, max_speak_tokens: int = 4,
                 force_listen: int = 1, num_pages: int = 64, page_size: int = 64, chunk_width: int = 128,
                 max_slice_nums: int = 1, policy=None):
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
        self._select = jax.jit(rule.select)

    def decide(self, logits: np.ndarray) -> int:
        """The rule's decision on last-position logits `[V]`, with `decoded` as the history (the jitted `select`;
        the same as `rule.choose(logits, self.decoded)`)."""
        W = self.rule.history_window
        history = np.full((1, W), -1, np.int32)
        recent = self.decoded[max(0, len(self.decoded) - W):]
        history[0, W - len(recent):] = recent
        return int(self._select(np.asarray(logits, np.float32)[None], history)[0])

    def feed(self, rows: list) -> np.ndarray:
        """Feeds a list of items (an int id, or a `[n, D]` embedding block) as one chunk; returns the last logits.

        Raises RuntimeError once the pool has run out (some token was not cached), rather than decide on without it.
        """
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
        rows = list(prefix_ids)
        if ref_audio is not None:
            rows.append(encode_reference(self.model, ref_audio))
        self.feed(rows + list(suffix_ids))
        self._unit_id += 1

    def step(self, pcm, frame=None) -> UnitResult:
        """One unit: `<unit>` [`<image>` frame `</image>`] audio, then the listen/speak decision and its tokens."""
        t = self.tokens
        mel, audio, cache, image = encode_unit(self.model, self._mel, self._audio_cache, pcm, frame,
                                               max_slice_nums=self.max_slice_nums)
        self._mel, self._audio_cache = mel, cache  # committed only once the unit's inputs are all encoded
        rows = [t.unit_start]
        if image is not None:
            rows += [t.image_start, image.reshape(-1, image.shape[-1]), t.image_end]
        rows.append(audio)
        logits = self.feed(rows)
        result = UnitResult(tokens=[], listened=False, logits=[logits])
        if self.units < self.force_listen:
            result.listened = True
            self.feed([t.listen])
        else:
            for i in range(self.max_speak_tokens - 1):
                token = self.decide(logits)
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
