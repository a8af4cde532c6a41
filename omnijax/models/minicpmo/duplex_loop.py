"""MiniCPM-o 4.5's full-duplex loop, once, without I/O: `DuplexLoop` says what to feed and decides on the logits.

The loop is a sans-IO core. Its `prepare` and `unit` programs are generators: each yields a `DuplexFeed` (the rows to
feed next, with their span kinds and unit id) and is sent back the last-position logits `[V]` of that feed; the
`unit` program returns the unit's `UnitResult`. Two drivers run it, each owning only its transport:

- `omnijax.streaming.duplex.DuplexSession` feeds an `omnijax.Session` synchronously;
- `omnijax.serve.engine.duplex.DuplexStream` feeds one session of the serving engine's worker (one batched tick per
  chunk, awaited), encoding media in a helper thread.

Per unit (one second of 16 kHz audio and an optional video frame):
    1. host (`DuplexLoop.encode`, which changes nothing): the streaming log-mel step, the streaming Whisper encoder
       on its own cache and the vision encoder;
    2. feed `<unit> [<image> source slices </image>] audio`; its last logits decide the first token;
    3. the first `force_listen` units take `<|listen|>`; later ones decide up to `max_speak_tokens - 1` tokens with
       `DuplexDecodeRule.choose` over the loop's decode history (its last `history_window` ids), one feed per token;
       `<|listen|>`, `<|chunk_eos|>` and `<|chunk_tts_eos|>` end the unit early, otherwise `<|chunk_eos|>` closes it;
    4. feed the closing token and `</unit>` together (their logits are never used, so one feed leaves the same
       cache as two).

Positions are session indices: a feed's rows take the next positions of the session (1D RoPE). Rows carry span
kinds for retention policies (SYSTEM prompt text, AUDIO, IMAGE/SLICE, BOUNDARY markers, RESPONSE tokens).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import TYPE_CHECKING, Generator, Sequence

import numpy as np
import numpy.typing as npt

from omnijax.chunks import builders
from omnijax.chunks.chunk import Chunk
from omnijax.chunks.spans import SpanKind
from omnijax.models.minicpmo import audio_features
from omnijax.models.minicpmo.audio_features import DUPLEX_MEL_STREAM, SAMPLE_RATE, InvalidPcmError
from omnijax.models.minicpmo.duplex import DuplexDecodeRule, DuplexTokens, UnitResult, encode_reference, encode_unit

if TYPE_CHECKING:
    from PIL import Image

    from omnijax.models.minicpmo.model import MiniCPMOModel

__all__ = ["DuplexDriver", "DuplexFeed", "DuplexLoop", "EncodedUnit", "Item", "UNIT_SAMPLES", "rows_chunks",
           "speak_ids", "unit_pcm"]

UNIT_SAMPLES = DUPLEX_MEL_STREAM.chunk_samples  # 16000: one unit of 16 kHz audio

# A row item: a token id, or a `[n, D]` block of embedding rows, with its span kind.
Item = tuple[int | np.ndarray, SpanKind]


@dataclasses.dataclass(frozen=True)
class DuplexFeed:
    """What the loop asks its driver to feed next: `items` in order, every row of unit `unit`."""

    items: tuple[Item, ...]
    unit: int


@dataclasses.dataclass(frozen=True)
class EncodedUnit:
    """One unit's encoded inputs (`DuplexLoop.encode`) and the encoder states to commit once it is fed."""

    audio: np.ndarray  # [10, D]
    image: np.ndarray | None  # [1 + slices, q, D]: the source image first, then its slices
    mel_state: object
    audio_cache: object


# The yield/send type of the loop's programs: yields a feed, is sent that feed's last logits [V].
Program = Generator[DuplexFeed, np.ndarray, UnitResult]


def rows_chunks(items: Sequence[Item], unit: int, hidden_size: int, width: int) -> list[Chunk]:
    """Batch-1 chunks (each at most `width` rows) holding `items` in order.

    Args:
        items: `(token id, kind)` or `(embeddings [n, D], kind)` pairs.
        unit: the unit id of every row.
        hidden_size: D.
        width: the most rows of one chunk (the engine's `chunk_tokens`, the session's chunk width).

    Returns:
        consecutive chunks; each has offsets 0..n-1 from the cursor and advances it by its n rows. Token-only
        chunks carry no embeddings (the engine then skips their transfer); span offsets run across chunks.

    Raises:
        ValueError: no items, or an embedding block that is not `[n, hidden_size]`.
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
    offsets = builders.span_offsets(span_all)  # [n]: within each span run of the whole list
    chunks = []
    for start in range(0, n, width):
        stop = min(n, start + width)
        piece = slice(start, stop)
        has_embeds = bool(mask_all[piece].any())
        chunk = builders.make_chunk(ids_all[piece], np.arange(stop - start, dtype=np.int32)[None], span_all[piece],
                                    unit, embeds=embeds_all[piece] if has_embeds else None,
                                    embed_mask=mask_all[piece] if has_embeds else None)
        chunks.append(dataclasses.replace(chunk, offset=offsets[piece][None]))
    return chunks


def speak_ids(result: UnitResult, markers: Sequence[int] = ()) -> list[int]:
    """The unit's spoken token ids: `result.tokens` without the duplex markers (`DuplexLoop.markers`)."""
    drop = frozenset(int(m) for m in markers)
    return [int(t) for t in result.tokens if int(t) not in drop]


def unit_pcm(pcm: npt.ArrayLike) -> np.ndarray:
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


class DuplexDriver:
    """What a driver of a `DuplexLoop` shows of it (`DuplexSession` and the server's `DuplexStream` both)."""

    loop: "DuplexLoop"

    @property
    def tokens(self) -> DuplexTokens:
        return self.loop.tokens

    @property
    def decoded(self) -> list[int]:
        """Every decided id that did not end its unit (the repetition history)."""
        return self.loop.decoded

    @property
    def units(self) -> int:
        """Units answered so far."""
        return self.loop.units

    @property
    def markers(self) -> frozenset[int]:
        """The duplex layout's and the rule's marker ids (BOUNDARY rows; not spoken text)."""
        return self.loop.markers

    def decide(self, logits: np.ndarray) -> int:
        """The loop's decision on last-position logits `[V]` (`DuplexLoop.decide`)."""
        return self.loop.decide(logits)


class DuplexLoop:
    """The 4.5 full-duplex loop's state and decisions, without I/O (module docstring).

    Args:
        model: a `MiniCPMOModel` with its audio encoder (and vision encoder for video frames).
        rule: the release's decisions (`DuplexDecodeRule`).
        tokens: the duplex markers (default `DuplexTokens.of(model)`).
        max_speak_tokens: a speaking unit decides at most `max_speak_tokens - 1` tokens (>= 1).
        force_listen: the first `force_listen` units listen without deciding (>= 0).
        max_slice_nums: the video frames' slicing (1: the source image only, the release's duplex setting).

    Attributes:
        decoded: every decided id that did not end its unit (the repetition history).
        units: units answered so far.
        prepared: whether the system part was fed.
    """

    def __init__(self, model: MiniCPMOModel, *, rule: DuplexDecodeRule, tokens: DuplexTokens | None = None,
                 max_speak_tokens: int = 4, force_listen: int = 1, max_slice_nums: int = 1):
        if not isinstance(rule, DuplexDecodeRule):
            raise TypeError(f"rule must be a DuplexDecodeRule, got {type(rule).__name__}")
        for name, value, least in (("max_speak_tokens", max_speak_tokens, 1), ("force_listen", force_listen, 0),
                                   ("max_slice_nums", max_slice_nums, 1)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if model.audio is None:
            raise ValueError("a duplex loop needs the checkpoint's audio encoder (model.audio is None)")
        self.model, self.rule = model, rule
        self.tokens = DuplexTokens.of(model) if tokens is None else tokens
        self.max_speak_tokens, self.force_listen = int(max_speak_tokens), int(force_listen)
        self.max_slice_nums = int(max_slice_nums)
        self.decoded: list[int] = []
        self.units = 0
        self.prepared = False
        self._unit_id = 0  # the system prompt is unit 0, units follow
        self._mel_state = audio_features.mel_stream_start()
        self._audio_cache = None  # the streaming Whisper encoder's cache (None: empty)
        t = self.tokens
        self._ends = frozenset({t.listen, t.chunk_eos, t.chunk_tts_eos})  # decisions that end a unit

    @property
    def markers(self) -> frozenset[int]:
        """The duplex layout's and the rule's marker ids (BOUNDARY rows; not spoken text)."""
        t, r = self.tokens, self.rule
        return frozenset({t.unit_start, t.unit_end, t.image_start, t.image_end, t.listen, t.chunk_eos,
                          t.chunk_tts_eos, r.chunk_eos, r.turn_eos, r.listen, r.tts_bos})

    def decide(self, logits: np.ndarray) -> int:
        """The rule's decision on last-position logits `[V]` with the last `history_window` ids of `decoded`."""
        window = self.rule.history_window
        return self.rule.choose(logits, self.decoded[max(0, len(self.decoded) - window):])

    # ------------------------------------------------------------------------------------------ host work (pure)
    def encode_reference(self, ref_audio: npt.ArrayLike) -> np.ndarray:
        """The reference voice clip's offline audio embeddings `[n, D]`."""
        return encode_reference(self.model, ref_audio)

    def encode(self, pcm: npt.ArrayLike, frame: np.ndarray | Image.Image | None = None) -> EncodedUnit:
        """One unit's host work, changing nothing: checks the audio and frame, runs the streaming log-mel step, the
        streaming audio encoder and the vision encoder.

        Raises:
            ValueError: bad audio (`InvalidPcmError`) or frame, or a frame without a vision encoder.
        """
        pcm = unit_pcm(pcm)
        if frame is not None and self.model.vision is None:
            raise ValueError("a video frame was given but the checkpoint has no vision encoder")
        mel, audio, cache, image = encode_unit(self.model, self._mel_state, self._audio_cache, pcm, frame,
                                               max_slice_nums=self.max_slice_nums)
        return EncodedUnit(audio=audio, image=image, mel_state=mel, audio_cache=cache)

    # ---------------------------------------------------------------------------------------------- the programs
    def prepare(self, prefix_ids: Sequence[int], suffix_ids: Sequence[int],
                reference: np.ndarray | None = None) -> Generator[DuplexFeed, np.ndarray, None]:
        """The system part, once, before any unit: `prefix_ids`, the reference clip's embeddings `[n, D]`
        (`encode_reference`), `suffix_ids`.

        Raises (before yielding anything):
            RuntimeError: already prepared.
            ValueError: an id outside the vocabulary.
        """
        self.check_prepare(prefix_ids, suffix_ids)
        return self._prepare(list(prefix_ids), list(suffix_ids), reference)

    def check_prepare(self, prefix_ids: Sequence[int], suffix_ids: Sequence[int]) -> None:
        """What `prepare` refuses, checked alone (a driver checks before it encodes the reference clip).

        Raises:
            RuntimeError: already prepared.
            ValueError: an id outside the vocabulary.
        """
        if self.prepared or self.units:
            raise RuntimeError("the duplex loop is already prepared")
        vocab = self.model.config.vocab_size
        if any(not 0 <= int(i) < vocab for i in (*prefix_ids, *suffix_ids)):
            raise ValueError(f"system prompt ids must lie in [0, {vocab})")

    def _prepare(self, prefix_ids, suffix_ids, reference) -> Generator[DuplexFeed, np.ndarray, None]:
        items: list[Item] = [(int(i), SpanKind.SYSTEM) for i in prefix_ids]
        items += [] if reference is None else [(reference, SpanKind.AUDIO)]
        items += [(int(i), SpanKind.SYSTEM) for i in suffix_ids]
        if items:
            yield DuplexFeed(tuple(items), self._unit_id)
        self.prepared = True
        self._unit_id += 1

    def unit(self, encoded: EncodedUnit) -> Program:
        """One unit's program on its encoded inputs (`encode`): feeds the inputs, decides, closes the unit.

        Raises (before yielding anything): RuntimeError when the loop is not prepared.
        """
        if not self.prepared:
            raise RuntimeError("prepare the duplex loop (its system prompt) before its first unit")
        return self._unit(encoded)

    def _unit(self, encoded: EncodedUnit) -> Program:
        # The encoder states are committed once the unit's program starts feeding.
        self._mel_state, self._audio_cache = encoded.mel_state, encoded.audio_cache
        t = self.tokens
        items: list[Item] = [(t.unit_start, SpanKind.BOUNDARY)]
        if encoded.image is not None:
            q = encoded.image.shape[1]
            rows = encoded.image.reshape(-1, encoded.image.shape[-1])  # [(1 + slices) * q, D]
            items += [(t.image_start, SpanKind.BOUNDARY), (rows[:q], SpanKind.IMAGE)]
            items += [(rows[q:], SpanKind.SLICE)] if rows.shape[0] > q else []
            items.append((t.image_end, SpanKind.BOUNDARY))
        items.append((encoded.audio, SpanKind.AUDIO))
        logits = yield DuplexFeed(tuple(items), self._unit_id)
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
                logits = yield DuplexFeed(((token, kind),), self._unit_id)
                result.tokens.append(token)
                result.logits.append(logits)
                self.decoded.append(token)
        yield DuplexFeed(((closing, SpanKind.BOUNDARY), (t.unit_end, SpanKind.BOUNDARY)), self._unit_id)
        self.units += 1
        self._unit_id += 1
        return result
