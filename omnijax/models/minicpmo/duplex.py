"""MiniCPM-o 4.5 full-duplex decoding decisions: the release's greedy rule for each generated token of a unit.

Per decision, on the last-position logits `[V]` of what was fed so far:
    1. the raw argmax is `<|chunk_eos|>`: take it (the unit ends);
    2. otherwise forbidden ids (the TTS pad, the tokenizer's bad tokens, `<|chunk_eos|>` itself) get -inf;
    3. repetition penalty: the logit of every distinct id in the recent decode history (a window of the last
       `history_window` decoded tokens) is divided by `repetition_penalty` — divided even when negative, which
       raises it (the release does this; it is not the usual sign-aware penalty);
    4. the `<|turn_eos|>` logit is divided by `turn_eos_penalty` when positive, multiplied when negative;
    5. argmax; a decoded `<|listen|>` while the turn is open becomes `<|tts_bos|>`.

`DuplexDecodeRule` is a decoding strategy of `omnijax.decoding` (`warp`/`select`, vectorised and jittable, so it can
be `StreamConfig.decoding`); its `choose` is the numpy twin of one decision on host, kept as the reference.
Both compute in float32 with correctly rounded division, so they decide alike bit for bit.
The duplex loop (`omnijax.models.minicpmo.duplex_loop.DuplexLoop`) decides with `choose` between its feeds.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import TYPE_CHECKING, ClassVar, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

from omnijax.decoding import register, seen_tokens
from omnijax.models.minicpmo import audio as audio_lib
from omnijax.models.minicpmo import audio_features, audio_stream
from omnijax.models.minicpmo import vision as vision_lib

if TYPE_CHECKING:
    from PIL import Image

    from omnijax.models.minicpmo.audio_features import MelStreamState
    from omnijax.models.minicpmo.audio_stream import AudioStreamState
    from omnijax.models.minicpmo.model import MiniCPMOModel


def _divide(x: jax.Array, divisor: float) -> jax.Array:
    """`x / divisor`, correctly rounded like numpy's and torch's division.

    XLA rewrites a division by a constant into a multiplication by its (rounded) reciprocal, which is off by one ulp
    for about a fifth of float32 values and could flip a near tie; a divisor that depends on the data (it is
    `divisor` everywhere, except 1 where `x` is NaN, where the quotient is NaN anyway) keeps the true division.
    """
    return x / jnp.where(jnp.isnan(x), jnp.float32(1), jnp.float32(divisor))


@register
@dataclasses.dataclass(frozen=True)
class DuplexDecodeRule:
    """The release's greedy duplex decision (token ids of the model's vocabulary), as a decoding strategy.

    Attributes:
        chunk_eos: `<|chunk_eos|>`, taken whenever it is the raw argmax, never otherwise.
        turn_eos: `<|turn_eos|>`, whose logit `turn_eos_penalty` damps.
        listen: `<|listen|>` (a unit's answer ends with it; `choose(..., turn_open=True)` turns it into `tts_bos`).
        tts_bos: `<|tts_bos|>`.
        forbidden: ids never chosen (the TTS pad, the tokenizer's bad tokens).
        repetition_penalty: divides the logit of every distinct id among the last `history_window` decoded tokens
            (> 0; divides negative logits too, as the release does).
        turn_eos_penalty: divides the `turn_eos` logit when positive, multiplies it when negative (> 0).
        history_window: how many of the latest decoded tokens the repetition penalty looks at (>= 0).

    As a strategy (`StreamConfig(decoding=rule)`): `warp` gives the scores the rule takes its argmax over and
    `select` that argmax; `history [B, N]` is the decode history, oldest first, with -1 (any negative id) as padding
    anywhere in a row, and the window is its last `history_window` valid entries. In a streamed answer the history
    is the answer's own tokens (`DuplexSession` passes the whole session's). `select` is `choose` with
    `turn_open=False`: the listen -> tts_bos substitution depends on the turn's state, which only the caller knows
    (`DuplexSession` never passes it). `stop` is `(chunk_eos, listen)`, the ids that end a unit's answer in
    `DuplexSession` (which also ends one at `<|chunk_tts_eos|>`, no field of the rule).
    """

    chunk_eos: int
    turn_eos: int
    listen: int
    tts_bos: int
    forbidden: tuple[int, ...] = ()
    repetition_penalty: float = 1.05
    turn_eos_penalty: float = 1.1
    history_window: int = 512
    name: ClassVar[str] = "minicpmo_duplex"

    def __post_init__(self):
        def token_id(name, value):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ValueError(f"DuplexDecodeRule: {name} must be a token id (int >= 0), got {value!r}")
            return int(value)

        for name in ("chunk_eos", "turn_eos", "listen", "tts_bos"):
            object.__setattr__(self, name, token_id(name, getattr(self, name)))
        if isinstance(self.forbidden, (str, bytes)) or not hasattr(self.forbidden, "__iter__"):
            raise ValueError(f"DuplexDecodeRule: forbidden must be a sequence of token ids, got {self.forbidden!r}")
        # A tuple, so that the rule stays hashable (a static part of the compiled step).
        object.__setattr__(self, "forbidden", tuple(token_id("forbidden", i) for i in self.forbidden))
        for name in ("repetition_penalty", "turn_eos_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
                raise ValueError(f"DuplexDecodeRule: {name} must be > 0, got {value!r}")
        window = self.history_window
        if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 0:
            raise ValueError(f"DuplexDecodeRule: history_window must be an int >= 0, got {window!r}")

    @property
    def stop(self) -> tuple[int, ...]:
        """The ids that end a unit's answer: `chunk_eos` and `listen` (read by `omnijax.decoding.stop_ids_of`)."""
        return (self.chunk_eos, self.listen)

    def warp(self, logits: jax.Array, history: jax.Array | None = None) -> jax.Array:
        """`logits [B, V]` -> float32 `[B, V]` scores, `-inf` where the rule masks; `history [B, N]` int, oldest
        first, negative = padding (None: no history). A row whose raw argmax is `chunk_eos` keeps that logit alone."""
        x = jnp.asarray(logits).astype(jnp.float32)
        V = x.shape[-1]
        ends = jnp.argmax(x, axis=-1) == self.chunk_eos  # [B]: step 1, before anything is masked
        masked = np.zeros((V,), bool)
        masked[[i for i in (*self.forbidden, self.chunk_eos) if i < V]] = True
        z = jnp.where(masked, -jnp.inf, x)
        if history is not None and self.history_window > 0 and self.repetition_penalty != 1.0:
            history = jnp.asarray(history)
            valid = history >= 0
            later = jnp.flip(jnp.cumsum(jnp.flip(valid, -1), axis=-1, dtype=jnp.int32), -1)  # valid ones from here on
            recent = jnp.where(valid & (later <= self.history_window), history, -1)
            z = jnp.where(seen_tokens(recent, V), _divide(z, self.repetition_penalty), z)
        if self.turn_eos < V:
            t = z[:, self.turn_eos]
            z = z.at[:, self.turn_eos].set(
                jnp.where(t > 0, _divide(t, self.turn_eos_penalty), t * jnp.float32(self.turn_eos_penalty)))
        only_eos = jnp.arange(V) == self.chunk_eos
        return jnp.where(ends[:, None], jnp.where(only_eos, x, -jnp.inf), z)

    def select(self, logits: jax.Array, history: jax.Array | None = None, key: jax.Array | None = None) -> jax.Array:
        """`[B]` int32 decisions for `logits [B, V]`: the argmax of `warp` (`key` is unused: the rule draws nothing)."""
        del key
        return jnp.argmax(self.warp(logits, history), axis=-1).astype(jnp.int32)

    def choose(self, logits: np.ndarray, history: Sequence[int], *, turn_open: bool = False) -> int:
        """One decision from last-position logits `[V]` and the ids decoded so far (oldest first; negative ids are
        padding): the numpy reference of `select` for one row, plus the open-turn listen -> tts_bos substitution."""
        logits = np.asarray(logits)
        if logits.ndim != 1:
            raise ValueError(f"logits must be [vocab], got shape {logits.shape}")
        z = logits.astype(np.float32)  # a copy
        V = z.shape[0]
        if int(np.argmax(z)) == self.chunk_eos:
            return self.chunk_eos
        z[[i for i in (*self.forbidden, self.chunk_eos) if i < V]] = -np.inf
        valid = [int(t) for t in history if int(t) >= 0]
        window = valid[max(0, len(valid) - self.history_window):]
        recent = sorted({t for t in window if t < V})
        z[recent] = z[recent] / np.float32(self.repetition_penalty)
        t = self.turn_eos
        if t < V:
            z[t] = z[t] / np.float32(self.turn_eos_penalty) if z[t] > 0 else z[t] * np.float32(self.turn_eos_penalty)
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
    def of(cls, model: MiniCPMOModel) -> "DuplexTokens":
        """The duplex markers of a loaded checkpoint (`model.special_tokens`, from its tokenizer files).

        Raises ValueError naming the markers the checkpoint does not declare (there is no release default for
        them here: pass `DuplexTokens(...)` explicitly for such a checkpoint).
        """
        texts = {"unit_start": "<unit>", "unit_end": "</unit>", "image_start": "<image>", "image_end": "</image>",
                 "listen": "<|listen|>", "chunk_eos": "<|chunk_eos|>", "chunk_tts_eos": "<|chunk_tts_eos|>"}
        special = model.special_tokens
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


def encode_reference(model: MiniCPMOModel, ref_audio: npt.ArrayLike) -> np.ndarray:
    """The reference clip's offline audio embeddings `[n, D]` (the release's prepare path)."""
    return np.asarray(audio_lib.encode_audio(model.audio, audio_features.log_mel(ref_audio)), np.float32)


def encode_unit(model: MiniCPMOModel, mel_state: MelStreamState | None, audio_cache: AudioStreamState | None,
                pcm: npt.ArrayLike, frame: np.ndarray | Image.Image | None = None, *, max_slice_nums: int = 1
                ) -> tuple[MelStreamState, np.ndarray, AudioStreamState, np.ndarray | None]:
    """The host work of one duplex unit, changing nothing: the streaming log-mel step, the streaming Whisper encoder
    on its cache, and the optional frame's vision embeddings.

    Args:
        model: the `MiniCPMOModel`.
        mel_state: the log-mel stream's state (None: a fresh stream).
        audio_cache: the streaming audio encoder's cache (None: empty).
        pcm: one unit's 16 kHz audio.
        frame: an optional video frame.
        max_slice_nums: the frame's slicing.

    Returns:
        `(mel_state, audio [10, D], audio_cache, image [1 + slices, q, D] or None)`; the caller commits the new
        states once the unit is fed.
    """
    chunk, mel_state = audio_features.mel_stream_step(mel_state or audio_features.mel_stream_start(), pcm)
    if chunk is None:
        raise ValueError("not enough audio for a unit yet (the first unit needs its full 1 s chunk)")
    audio, audio_cache = audio_stream.encode_audio_streaming(model.audio, chunk, audio_cache)
    image = None
    if frame is not None:
        embeds, _ = vision_lib.encode_image(model.vision, frame, max_slice_nums=max_slice_nums)
        image = np.asarray(embeds, np.float32)
    return mel_state, np.asarray(audio, np.float32), audio_cache, image
