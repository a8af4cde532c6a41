"""MiniCPM-o 4.5 full duplex on the serving path: `DuplexStream`, the duplex loop served by an `EngineWorker`.

`omnijax.models.minicpmo.duplex.DuplexSession` runs the 4.5 full-duplex loop on its own `omnijax.Session`. A
`DuplexStream` runs the same loop on one session of an `omnijax.serve.engine.worker.EngineWorker`: every LLM chunk goes
through `worker.frame(sid, chunk)` and the decision logits come back in the tick's `FrameOutput.logits`, so many
duplex streams share the engine's batched ticks (one tick per chunk; the engine needs `return_logits=True`).

Per unit (one second of 16 kHz audio and an optional video frame):
    1. host: streaming log-mel (`audio_features.mel_stream_step`), the streaming Whisper encoder on its own cache
       (`audio_stream.encode_audio_streaming`) and the vision encoder (`vision.encode_image`), in a helper thread;
       any refusal here leaves the stream as it was (nothing has been fed);
    2. tick: `<unit> [<image> E </image>] A10`, whose last logits decide the first token;
    3. as `DuplexSession`: the first `force_listen` units take `<|listen|>`; later ones decide up to
       `max_speak_tokens - 1` tokens with `DuplexDecodeRule.choose` over the stream's decode history (its last
       `history_window` ids), one tick per token fed; `<|listen|>`, `<|chunk_eos|>` and `<|chunk_tts_eos|>` end the
       unit early, otherwise `<|chunk_eos|>` closes it;
    4. tick: the closing token and `</unit>` together (DuplexSession feeds them one per forward; their logits are
       never used, so one chunk is the same cache one tick sooner).

Positions are session indices, as in `DuplexSession`: every chunk's offsets are 0..n-1 and its `advance` is n, so
the engine's per-row cursor of a freshly opened session walks the same positions. Rows carry span metadata for
retention policies (SYSTEM prompt text, AUDIO, IMAGE/SLICE, BOUNDARY markers, RESPONSE tokens); under `NoSlide`
(DuplexSession's default) it changes nothing. A row list longer than the engine's `chunk_tokens` is fed as several
consecutive chunks (ticks). Once a feed has failed (pool exhausted, session closed, a failed tick, cancellation),
the stream's context is incomplete and every later call raises RuntimeError.
"""

from __future__ import annotations

import asyncio
import dataclasses
import numbers
from typing import Sequence

import numpy as np

from omnijax.chunks import builders as adapters
from omnijax.chunks.spans import SpanKind
from omnijax.models.minicpmo import audio_features
from omnijax.models.minicpmo.audio_features import DUPLEX_MEL_STREAM, SAMPLE_RATE, InvalidPcmError
from omnijax.models.minicpmo.duplex import DuplexDecodeRule, DuplexTokens, UnitResult, encode_reference, encode_unit

__all__ = ["DuplexStream", "UNIT_SAMPLES", "UnitResult", "rows_chunks", "speak_ids", "speak_text"]

UNIT_SAMPLES = DUPLEX_MEL_STREAM.chunk_samples  # 16000: one unit of 16 kHz audio

# A row item: a token id, or a `[n, D]` block of embedding rows, with its span kind.
Item = tuple[int | np.ndarray, SpanKind]


def rows_chunks(items: Sequence[Item], unit: int, hidden_size: int, width: int) -> list:
    """Batch-1 chunks (`omnijax.chunks.chunk.Chunk`, each at most `width` rows) holding `items` in order.

    Args:
        items: `(token id, kind)` or `(embeddings [n, D], kind)` pairs.
        unit: the unit id of every row.
        hidden_size: D.
        width: the most rows of one chunk (the engine's `chunk_tokens`).

    Returns:
        consecutive chunks; each has offsets 0..n-1 from the cursor and advances it by its n rows. Token-only
        chunks carry no embeddings (the engine then skips their transfer); span offsets run across chunks.
    """
    ids, span, blocks, mask = [], [], [], []
    for value, kind in items:
        if isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, bool):
            ids.append(int(value))
            span.append(int(kind))
            blocks.append(np.zeros((1, hidden_size), np.float32))
            mask.append(False)
            continue
        block = np.asarray(value, np.float32)
        if block.ndim != 2 or block.shape[1] != hidden_size:
            raise ValueError(f"embedding rows must be [n, {hidden_size}], got shape {block.shape}")
        ids += [0] * block.shape[0]
        span += [int(kind)] * block.shape[0]
        blocks.append(block)
        mask += [True] * block.shape[0]
    n = len(ids)
    if n == 0:
        raise ValueError("nothing to feed")
    ids_all, span_all, mask_all = np.asarray(ids, np.int64), np.asarray(span, np.int32), np.asarray(mask, bool)
    embeds_all = np.concatenate(blocks)  # [n, D]
    offsets = adapters.span_offsets(span_all)  # [n]: within each span run of the whole list
    chunks = []
    for start in range(0, n, width):
        stop = min(n, start + width)
        piece = slice(start, stop)
        has_embeds = bool(mask_all[piece].any())
        chunk = adapters.make_chunk(ids_all[piece], np.arange(stop - start, dtype=np.int32)[None], span_all[piece],
                                    unit, embeds=embeds_all[piece] if has_embeds else None,
                                    embed_mask=mask_all[piece] if has_embeds else None)
        chunks.append(dataclasses.replace(chunk, offset=offsets[piece][None]))
    return chunks


def speak_ids(result: UnitResult, markers: Sequence[int] = ()) -> list[int]:
    """The unit's spoken token ids: `result.tokens` without the duplex markers (`DuplexStream.markers`)."""
    drop = frozenset(int(m) for m in markers)
    return [int(t) for t in result.tokens if int(t) not in drop]


def speak_text(result: UnitResult, tokenizer, markers: Sequence[int] = (), *, decoder=None) -> str:
    """The unit's spoken text: its tokens without the duplex markers and the tokenizer's special tokens.

    Args:
        result: a unit's `UnitResult`.
        tokenizer: `omnijax.models.tokenizer.Tokenizer` (anything with `decode(ids, skip_special_tokens=...)`).
        markers: ids to drop besides the tokenizer's special ones (`DuplexStream.markers`).
        decoder: a `tokenizer.stream_decoder(skip_special_tokens=True)` that carries an incomplete character from
            one unit to the next (then the text it completes is returned; `decoder.flush()` ends the stream).
    """
    ids = speak_ids(result, markers)
    if decoder is not None:
        return decoder.push(ids)
    return tokenizer.decode(ids, skip_special_tokens=True)


def unit_pcm(pcm) -> np.ndarray:
    """One unit's audio as float32 `[UNIT_SAMPLES]`; raises `InvalidPcmError` (a ValueError) otherwise."""
    pcm = np.asarray(pcm)
    if pcm.ndim != 1:
        raise InvalidPcmError(f"a unit's audio must be mono [{UNIT_SAMPLES}] samples, got shape {pcm.shape}")
    if not np.issubdtype(pcm.dtype, np.floating):
        raise InvalidPcmError(f"a unit's audio must be float samples in [-1, 1], got dtype {pcm.dtype} (int16 PCM: "
                              f"divide by 32768)")
    if pcm.size != UNIT_SAMPLES:
        raise InvalidPcmError(f"a unit takes exactly {UNIT_SAMPLES} samples (1 s at {SAMPLE_RATE} Hz), got "
                              f"{pcm.size}")
    if not np.isfinite(pcm).all():
        raise InvalidPcmError(f"a unit's audio holds {int((~np.isfinite(pcm)).sum())} NaN or infinite sample(s)")
    return pcm.astype(np.float32)


class DuplexStream:
    """The 4.5 full-duplex loop (`DuplexSession`'s) on one session of an `EngineWorker` (module docstring).

    Args:
        model: a `MiniCPMOModel` with its audio encoder (and vision encoder for video frames); the worker's engine
            must serve its decoder.
        worker: the `EngineWorker` (its engine built with `EngineConfig(return_logits=True)`).
        sid: the worker's session id; open it first (`await worker.open(sid)`, or use `DuplexStream.open`). A
            freshly opened session, so that positions start at 0.
        rule: the release's decisions (`DuplexDecodeRule`).
        tokens: the duplex markers (default `DuplexTokens.of(model)`).
        max_speak_tokens: a speaking unit decides at most `max_speak_tokens - 1` tokens (>= 1).
        force_listen: the first `force_listen` units listen without deciding (>= 0).
        max_slice_nums: the video frames' slicing (1: the source image only, the release's duplex setting).

    Attributes:
        decoded: every decided id that did not end its unit (the repetition history), as `DuplexSession.decoded`.
        units: units answered so far.
        position: rows fed so far (the engine cursor of the session).
        failed: why the stream stopped (None while it can go on).
    """

    def __init__(self, model, worker, sid: str, *, rule: DuplexDecodeRule, tokens: DuplexTokens | None = None,
                 max_speak_tokens: int = 4, force_listen: int = 1, max_slice_nums: int = 1):
        if not isinstance(rule, DuplexDecodeRule):
            raise TypeError(f"rule must be a DuplexDecodeRule, got {type(rule).__name__}")
        for name, value, least in (("max_speak_tokens", max_speak_tokens, 1), ("force_listen", force_listen, 0),
                                   ("max_slice_nums", max_slice_nums, 1)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if model.audio is None:
            raise ValueError("a duplex stream needs the checkpoint's audio encoder (model.audio is None)")
        engine = worker.engine
        if not engine.config.return_logits:
            raise ValueError("duplex streams decide on the host: build the engine with EngineConfig(return_logits="
                             "True)")
        self.model, self.worker, self.sid, self.rule = model, worker, sid, rule
        self.tokens = DuplexTokens.of(model) if tokens is None else tokens
        self.max_speak_tokens, self.force_listen = int(max_speak_tokens), int(force_listen)
        self.max_slice_nums = int(max_slice_nums)
        self.width = engine.config.chunk_tokens
        self.hidden_size = model.config.hidden_size
        self.decoded: list[int] = []
        self.units = 0
        self.position = 0
        self.failed: str | None = None
        self._unit_id = 0  # the system prompt is unit 0, units follow
        self._prepared = False
        self._busy = False
        self._mel = audio_features.mel_stream_start()
        self._audio_cache = None  # the streaming Whisper encoder's cache (None: empty)
        t = self.tokens
        self._ends = frozenset({t.listen, t.chunk_eos, t.chunk_tts_eos})  # decisions that end a unit

    @classmethod
    async def open(cls, model, worker, sid: str, **kwargs) -> "DuplexStream":
        """Opens `sid` on the worker (may raise `Overloaded`); returns its stream (`kwargs`: the constructor's)."""
        stream = cls(model, worker, sid, **kwargs)  # refuses bad settings before a session is taken
        await worker.open(sid)
        return stream

    async def close(self) -> None:
        """Closes the worker session (its pages return to the pool); the stream cannot go on."""
        self.failed = self.failed or "closed"
        await self.worker.close(self.sid)

    @property
    def markers(self) -> frozenset[int]:
        """The duplex layout's and the rule's marker ids (BOUNDARY rows; not spoken text)."""
        t, r = self.tokens, self.rule
        return frozenset({t.unit_start, t.unit_end, t.image_start, t.image_end, t.listen, t.chunk_eos,
                          t.chunk_tts_eos, r.chunk_eos, r.turn_eos, r.listen, r.tts_bos})

    def decide(self, logits: np.ndarray) -> int:
        """The rule's decision on last-position logits `[V]` with the last `history_window` ids of `decoded` (what
        `DuplexSession.decide` computes with the jitted `select`; `choose` decides alike bit for bit)."""
        window = self.rule.history_window
        return self.rule.choose(logits, self.decoded[max(0, len(self.decoded) - window):])

    async def prepare(self, prefix_ids: Sequence[int], suffix_ids: Sequence[int], ref_audio=None) -> None:
        """The system part, once, before any unit: `prefix_ids`, the reference clip's offline audio embeddings,
        `suffix_ids` (as `DuplexSession.prepare`). Token ids must lie in the vocabulary."""
        self._check_ready()
        if self._prepared or self.units:
            raise RuntimeError("the duplex stream is already prepared")
        ids = [int(i) for i in (*prefix_ids, *suffix_ids)]
        vocab = self.model.config.vocab_size
        if any(not 0 <= i < vocab for i in ids):
            raise ValueError(f"system prompt ids must lie in [0, {vocab})")
        self._busy = True
        try:
            ref = None
            if ref_audio is not None:
                ref = await asyncio.to_thread(encode_reference, self.model, ref_audio)  # [n, D]
            items = [(int(i), SpanKind.SYSTEM) for i in prefix_ids]
            items += [] if ref is None else [(ref, SpanKind.AUDIO)]
            items += [(int(i), SpanKind.SYSTEM) for i in suffix_ids]
            if items:
                await self._feed(items)
            self._prepared = True
            self._unit_id += 1
        finally:
            self._busy = False

    async def step(self, pcm, frame=None) -> UnitResult:
        """One unit: `<unit>` [`<image>` frame `</image>`] audio, then the listen/speak decision and its tokens.

        Args:
            pcm: `[16000]` float samples (1 s at 16 kHz, nominally in [-1, 1]).
            frame: an optional video frame (`[H, W, 3]` uint8 RGB, or what `vision.encode_image` takes).

        Returns:
            `UnitResult`: the spoken tokens, whether the unit listened, and the decision logits (the unit's, then
            one per spoken token), as `DuplexSession.step` returns them.

        Raises:
            ValueError: bad audio or frame, or a frame without a vision encoder; nothing was fed.
            RuntimeError: the stream is not prepared, busy, or stopped (`failed`), or a feed failed now.
        """
        self._check_ready()
        if not self._prepared:
            raise RuntimeError("prepare the duplex stream (its system prompt) before its first unit")
        pcm = unit_pcm(pcm)
        if frame is not None and self.model.vision is None:
            raise ValueError("a video frame was given but the checkpoint has no vision encoder")
        self._busy = True
        try:
            mel, audio, cache, image = await asyncio.to_thread(encode_unit, self.model, self._mel, self._audio_cache,
                                                               pcm, frame, max_slice_nums=self.max_slice_nums)
            self._mel, self._audio_cache = mel, cache  # committed: the unit is fed from here on
            try:
                return await self._answer(audio, image)
            except BaseException as e:  # a unit cut short leaves the cache without its end
                self.failed = self.failed or f"a unit was interrupted: {type(e).__name__}: {e}"
                raise
        finally:
            self._busy = False

    # ------------------------------------------------------------------------------------------------- internals
    def _check_ready(self) -> None:
        if self.failed is not None:
            raise RuntimeError(f"the duplex stream {self.sid!r} has stopped: {self.failed}")
        if self._busy:
            raise RuntimeError(f"the duplex stream {self.sid!r} is busy: await one prepare/step at a time")

    async def _answer(self, audio: np.ndarray, image: np.ndarray | None) -> UnitResult:
        """Feeds the unit's inputs `audio [10, D]` (and `image [1 + slices, q, D]`), decides, closes the unit."""
        t = self.tokens
        items = [(t.unit_start, SpanKind.BOUNDARY)]
        if image is not None:
            q = image.shape[1]
            rows = image.reshape(-1, image.shape[-1])  # [(1 + slices) * q, D]: source first, then slices
            items += [(t.image_start, SpanKind.BOUNDARY), (rows[:q], SpanKind.IMAGE)]
            items += [(rows[q:], SpanKind.SLICE)] if rows.shape[0] > q else []
            items.append((t.image_end, SpanKind.BOUNDARY))
        items.append((audio, SpanKind.AUDIO))
        logits = await self._feed(items)
        result = UnitResult(tokens=[], listened=False, logits=[logits])
        closing = t.chunk_eos  # fed with `</unit>` when no decision ended the unit
        if self.units < self.force_listen:
            result.listened, closing = True, t.listen
        else:
            markers = self.markers
            for _ in range(self.max_speak_tokens - 1):
                token = self.decide(logits)
                if token in self._ends:
                    result.listened, closing = token == t.listen, token
                    break
                kind = SpanKind.BOUNDARY if token in markers else SpanKind.RESPONSE
                logits = await self._feed([(token, kind)])
                result.tokens.append(token)
                result.logits.append(logits)
                self.decoded.append(token)
        await self._feed([(closing, SpanKind.BOUNDARY), (t.unit_end, SpanKind.BOUNDARY)])
        self.units += 1
        self._unit_id += 1
        return result

    async def _feed(self, items: Sequence[Item]) -> np.ndarray:
        """Feeds `items` (one chunk per tick, in order); returns the last chunk's last-position logits `[V]`."""
        chunks = rows_chunks(items, self._unit_id, self.hidden_size, self.width)
        futures, outs = [], []
        try:
            for chunk in chunks:
                futures.append(self.worker.frame(self.sid, chunk))
            # Awaited one by one, not gathered: a task waiting on the future itself resumes in the loop turn the
            # worker yields between ticks, so its next chunk makes the next tick (a gather resumes a turn later).
            for future in futures:
                outs.append(await future)
        except BaseException as e:  # failed, cancelled or not open: the cache may lack some of the rows
            for future in futures:  # retrieve the other failures (no "exception was never retrieved")
                future.add_done_callback(lambda f: f.cancelled() or f.exception())
            self.failed = f"a feed did not complete: {type(e).__name__}: {e}"
            if isinstance(e, Exception) and not isinstance(e, RuntimeError):
                raise RuntimeError(f"the duplex stream {self.sid!r} could not feed: {e}") from e
            raise
        for out in outs:
            if out is None or out.preempted or out.logits is None:
                dropped = 0 if out is None else out.dropped
                self.failed = "the KV pool ran out"
                raise RuntimeError(f"the duplex stream {self.sid!r} was preempted: the KV pool ran out "
                                   f"({dropped} token(s) were not cached)")
        self.position += sum(int(c.advance[0]) for c in chunks)
        return np.asarray(outs[-1].logits, np.float32)
