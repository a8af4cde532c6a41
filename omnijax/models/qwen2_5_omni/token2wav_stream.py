"""Qwen2.5-Omni Token2Wav streamed: codec tokens in as the talker decodes them, PCM chunks out as soon as the DiT
and BigVGAN have them (`Token2WavStream`, `push` then `finish`), what the spoken path runs (`speech.spoken_chunks`).

The DiT (`token2wav_dit`) cuts frames into blocks of `block_size` and lets output block b read input blocks
b - n_back .. b + n_ahead per forward (n_back / n_ahead: the layers that look back / ahead). The stream solves the ODE
a chunk of blocks at a time on a window `[past | chunk | look-ahead]`:

- **past** (the `n_back` blocks before the chunk): their states at every RK4 stage are those their own solve fed the
  DiT, held fixed (`token2wav.solve_window`). One forward's output for the chunk reads nothing further back, so
  the chunk sees exactly the past it would see in the one-shot solve, at a fixed cost per chunk.
- **look-ahead** (`right_blocks` blocks after the chunk, solved and dropped; the next window solves them again from
  the same noise): the one-shot solve lets every one of the `4 (num_steps - 1)` evaluations reach n_ahead blocks
  further, so a finite look-ahead cannot equal it by construction. The difference is measured
  (`tests/models/qwen2_5_omni/test_token2wav_stream.py`, a tiny random-weight DiT: 2.6e-2 / 7.7e-4 / 1.7e-5 of the
  mel's range with 0 / 1 / 2 look-ahead blocks; trained weights not measured); with the look-ahead covering the
  rest of the utterance the stream equals the one-shot decode (1e-4 of the peak).
- Positions are the utterance's (`dit_forward`'s `offset`): the reference's DiT RoPE is not relative.

BigVGAN is non-causal with a finite reach (`vocoder_reach`: 34 mel frames each side for the release's rates and
kernels, a bound; 28 measured): PCM of mel frames [a, b) is vocoded on frames [a - left, b + right] and the frames'
own samples are kept, so the stream's PCM equals `vocode` of the stream's whole mel (every sample, no hole or
overlap at chunk boundaries) when `vocoder_right` is the reach (the default; smaller trades that for an earlier
first packet).

The initial noise is drawn per DiT block (`frame_noise`: block b from `fold_in(key(seed), b)`), so a frame's noise
does not depend on how long the utterance turns out; `speech.speak` draws the one-shot decode's noise the same way.

Latency: the first PCM needs the codes of `first_blocks + right_blocks` blocks (x `block_size / repeats` talker
tokens; 36 for the release's defaults here, 0.72 s of speech) and then final mel `vocoder_right` frames past what it
emits. The server's speech pool can drive the same object (construct one per utterance, `push` codes as the talker
decodes them, `finish` at its stop token).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from omnijax.kept_executables import cached_jit
from omnijax.models.qwen2_5_omni.bigvgan import FILTER_TAPS, BigVGANConfig, vocode, vocode_params
from omnijax.models.qwen2_5_omni.token2wav import Token2Wav, solve_window
from omnijax.models.qwen2_5_omni.token2wav_dit import DiTConfig, dit_params

__all__ = ["Token2WavStream", "Token2WavStreaming", "frame_noise", "talker_pcm", "vocoder_reach"]


@dataclasses.dataclass(frozen=True)
class Token2WavStreaming:
    """How Token2Wav is streamed (module docstring).

    Attributes:
        first_blocks: DiT blocks of the first chunk (small: the first audio sooner).
        chunk_blocks: DiT blocks of every later chunk.
        right_blocks: look-ahead blocks solved beside each chunk and dropped (more: closer to the one-shot decode,
            later first audio, more DiT work per chunk).
        vocoder_right: mel frames of right context BigVGAN reads past what it emits; None: its whole reach (the PCM
            is then exactly the vocoder's output of the stream's mel).
    """

    first_blocks: int = 1
    chunk_blocks: int = 2
    right_blocks: int = 2
    vocoder_right: int | None = None

    def __post_init__(self):
        for name, low in (("first_blocks", 1), ("chunk_blocks", 1), ("right_blocks", 0), ("vocoder_right", 0)):
            value = getattr(self, name)
            if name == "vocoder_right" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"Token2WavStreaming.{name} must be an integer >= {low}, got {value!r}")

    @classmethod
    def for_tokens(cls, config: DiTConfig, first_chunk: int, chunk: int, **more: Any) -> "Token2WavStreaming":
        """Chunks given in codec tokens (`SpeakOptions.first_chunk` / `chunk`) rounded up to whole DiT blocks
        (`block_size / repeats` tokens each: 12 for the release); `more`: the other fields."""
        for name, value in (("first_chunk", first_chunk), ("chunk", chunk)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        per = config.block_size // config.repeats
        return cls(first_blocks=-(-int(first_chunk) // per), chunk_blocks=-(-int(chunk) // per), **more)


# Input samples each side that one anti-aliased activation reads, by its filters' taps: 2x up (12 taps, 15 trimmed),
# SnakeBeta, 2x down (12 taps, pad 5 / 6) reads 5. Worked out for the architecture's 12 taps only (bigvgan.FILTER_TAPS
# is fixed by it), so another count has no entry.
_ACTIVATION_REACH = {12: 5}


@functools.lru_cache(maxsize=32)
def vocoder_reach(config: BigVGANConfig) -> tuple[int, int]:
    """`(left, right)`: the mel frames BigVGAN reads before / after the frame of any output sample (the receptive
    field of `bigvgan.vocode`, from its convolutions' kernels, dilations and strides; (34, 34) for the release, a
    bound: 28 measured).

    Traced backwards from one output sample: conv_post and the last anti-aliased activation, then per stage (last
    first) the AMP blocks' reach (the widest of the averaged blocks) and the transposed convolution's input range,
    then conv_pre."""
    act = _ACTIVATION_REACH[FILTER_TAPS]  # input samples each side of one anti-aliased activation
    half = (7 - 1) // 2  # conv_pre and conv_post (kernel 7)
    amp = max(sum(2 * act + (d + 1) * (k - 1) // 2 for d in dil)
              for k, dil in zip(config.resblock_kernel_sizes, config.resblock_dilation_sizes))
    hop = config.hop
    left = right = 0
    for phase in range(hop):  # every sample position within a mel frame
        lo = hi = phase
        lo, hi = lo - half - act, hi + half + act
        for r, k in zip(reversed(config.upsample_rates), reversed(config.upsample_kernel_sizes)):
            lo, hi = lo - amp, hi + amp
            p = (k - r) // 2  # output n = m r - p + j, 0 <= j < k
            lo, hi = -((-(lo + p - k + 1)) // r), (hi + p) // r
        lo, hi = lo - half, hi + half
        left, right = max(left, -lo), max(right, hi)
    return left, right


@cached_jit(static_argnames=("block", "mel_dim"))
def _blocks_noise(key: jax.Array, first: jax.Array, count: jax.Array, *, block: int, mel_dim: int) -> jax.Array:
    return jax.vmap(lambda b: jax.random.normal(jax.random.fold_in(key, b), (block, mel_dim), jnp.float32))(
        first + jnp.arange(count.shape[0]))


def frame_noise(seed: int, start: int, stop: int, *, block: int, mel_dim: int) -> np.ndarray:
    """The ODE's initial state of frames `[start, stop)` (`[1, stop - start, mel_dim]` float32): standard normal,
    DiT block b (frames b * block ..) drawn from `fold_in(key(seed), b)`, so any span draws the frames the whole
    utterance's draw holds."""
    if not 0 <= start <= stop:
        raise ValueError(f"frame_noise needs 0 <= start <= stop, got {start}, {stop}")
    first, last = start // block, -(-stop // block)
    if last == first:
        return np.zeros((1, 0, mel_dim), np.float32)
    draw = _blocks_noise(jax.random.key(seed), jnp.int32(first), jnp.zeros((last - first,), jnp.int8), block=block,
                         mel_dim=mel_dim)
    return np.asarray(draw).reshape(1, -1, mel_dim)[:, start - first * block:stop - first * block]


@cached_jit(static_argnames=("config", "num_steps", "guidance_scale", "sway"))
def _solve(params: Mapping[str, Any], config: DiTConfig, past: jax.Array, noise: jax.Array, conditioning: jax.Array,
           reference_mel: jax.Array, codes: jax.Array, *, num_steps: int, guidance_scale: float,
           sway: float | None, offset: jax.Array) -> tuple[jax.Array, jax.Array]:
    return solve_window(params, config, past, noise, conditioning, reference_mel, codes, num_steps=num_steps,
                        guidance_scale=guidance_scale, sway=sway, keep_stages=True, offset=offset)


class Token2WavStream:
    """One utterance's Token2Wav, streamed (module docstring). Batch 1.

    Args:
        model: the Token2Wav parameters.
        conditioning: `[E]` the voice's conditioning vector.
        reference_mel: `[T_ref, M]` the voice's reference mel.
        streaming: the chunking (`Token2WavStreaming`).
        seed: the initial noise's seed (`frame_noise`).
        num_steps, guidance_scale, sway: the ODE's settings, as `token2wav.sample_mel`.
        keep_mel: keep the final mel (`mel()`; for measuring the stream against the one-shot solve).

    Attributes:
        codes: the codec tokens pushed so far.
        samples: PCM samples returned so far.
        dit_calls, vocoder_calls: solves and vocoder calls run so far.

    Raises:
        ValueError: a `block_size` that is not a whole number of tokens, shapes that do not fit the config.
    """

    def __init__(self, model: Token2Wav, conditioning: Any, reference_mel: Any, *,
                 streaming: Token2WavStreaming = Token2WavStreaming(), seed: int = 0, num_steps: int = 10,
                 guidance_scale: float = 0.5, sway: float | None = -1.0, keep_mel: bool = False):
        c = model.config
        dit = c.dit
        if dit.block_size % dit.repeats:
            raise ValueError(f"block_size {dit.block_size} is not a whole number of tokens (repeats {dit.repeats}): "
                             "Token2Wav cannot be streamed in blocks")
        if num_steps < 2:
            raise ValueError(f"num_steps must be >= 2 (one ODE step), got {num_steps}")
        if not isinstance(streaming, Token2WavStreaming):
            raise ValueError(f"streaming must be a Token2WavStreaming, got {type(streaming).__name__}")
        self._cond = np.asarray(conditioning, np.float32).reshape(1, -1)
        self._ref = np.asarray(reference_mel, np.float32)
        if self._cond.shape[1] != dit.enc_emb_dim or self._ref.ndim != 2 or self._ref.shape[1] != dit.mel_dim:
            raise ValueError(f"conditioning {self._cond.shape} / reference_mel {self._ref.shape} do not fit the DiT "
                             f"([{dit.enc_emb_dim}] / [frames, {dit.mel_dim}])")
        self._ref = self._ref[None]
        self.config, self.streaming = c, streaming
        self._dit, self._voc = dit_params(model.dit), vocode_params(model.bigvgan)
        self._ode = dict(num_steps=int(num_steps), guidance_scale=float(guidance_scale), sway=sway)
        self._seed, self._keep = int(seed), bool(keep_mel)
        self._back = len(dit.look_backward_layers) * dit.block_size  # past frames held (what one forward reads)
        reach = vocoder_reach(c.bigvgan)
        self._voc_left = reach[0]
        self._voc_right = reach[1] if streaming.vocoder_right is None else int(streaming.vocoder_right)
        self.codes: list[int] = []
        self.samples = self.dit_calls = self.vocoder_calls = 0
        self._final = 0  # mel frames solved for good
        self._past = np.zeros((num_steps - 1, 4, 1, 0, dit.mel_dim), np.float32)  # stage states of the held frames
        self._mel = np.zeros((dit.mel_dim, 0), np.float32)  # final mel frames [_mel_at, _final)
        self._mel_at = 0
        self._kept: list[np.ndarray] = []
        self._voiced = 0  # mel frames vocoded (PCM returned)
        self._finished = False

    def push(self, codes: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        """Adds codec tokens (in [0, num_embeds]); returns the PCM chunks (float32, 24 kHz) they complete (maybe
        none). Raises ValueError for tokens outside the codec table or a push after `finish`."""
        if self._finished:
            raise ValueError("this Token2WavStream is finished: start a new one for another utterance")
        codes = np.asarray(codes).reshape(-1)
        if codes.size and (not np.issubdtype(codes.dtype, np.integer) or codes.min() < 0 or
                           codes.max() > self.config.dit.num_embeds):
            raise ValueError(f"codes must be integers in [0, {self.config.dit.num_embeds}]")
        self.codes.extend(int(x) for x in codes)
        return self._run()

    def finish(self) -> list[np.ndarray]:
        """No more codes: solves and vocodes the rest; returns the last PCM chunks. The samples returned in all
        number `len(codes) * samples_per_token`."""
        if not self._finished:
            self._finished = True
            return self._run()
        return []

    def mel(self) -> np.ndarray:
        """`[M, frames]` the final mel solved so far (`keep_mel=True` only)."""
        if not self._keep:
            raise ValueError("construct the stream with keep_mel=True to read its mel")
        return np.concatenate(self._kept, axis=1) if self._kept else np.zeros((self.config.dit.mel_dim, 0))

    def _run(self) -> list[np.ndarray]:
        out = []
        while self._solve_next():
            pass
        end = self._final if self._finished else self._final - self._voc_right
        if end > self._voiced:
            out.append(self._vocode(end))
        return out

    def _solve_next(self) -> bool:
        dit = self.config.dit
        bs, rep = dit.block_size, dit.repeats
        total = len(self.codes) * rep
        F = self._final
        size = (self.streaming.first_blocks if F == 0 else self.streaming.chunk_blocks) * bs
        if self._finished:
            if F >= total:
                return False
            end, hi = min(F + size, total), min(F + size + self.streaming.right_blocks * bs, total)
        else:
            end, hi = F + size, F + size + self.streaming.right_blocks * bs
            if hi > total:
                return False
        lo = F - self._past.shape[3]
        noise = frame_noise(self._seed, F, hi, block=bs, mel_dim=dit.mel_dim)
        codes = np.asarray(self.codes[lo // rep:hi // rep], np.int32)[None]
        x1, stages = _solve(self._dit, dit, self._past, noise, self._cond, self._ref, codes, offset=jnp.int32(lo),
                            **self._ode)
        self.dit_calls += 1
        new = end - F
        mel = np.asarray(x1)[0, :new].T  # [M, new]
        self._past = np.concatenate([self._past, np.asarray(stages)[:, :, :, :new]], axis=3)[:, :, :, -self._back:] \
            if self._back else self._past
        if self._keep:
            self._kept.append(mel)
        keep_from = max(self._voiced - self._voc_left, 0)  # what the vocoder may still read
        self._mel = np.concatenate([self._mel[:, keep_from - self._mel_at:], mel], axis=1)
        self._mel_at, self._final = keep_from, end
        return True

    def _vocode(self, end: int) -> np.ndarray:
        hop = self.config.bigvgan.hop
        a = self._voiced
        lo, hi = max(a - self._voc_left, 0), min(end + self._voc_right, self._final)
        mel = self._mel[:, lo - self._mel_at:hi - self._mel_at]
        wav = np.asarray(vocode(self._voc, self.config.bigvgan, mel[None]))[0]
        self.vocoder_calls += 1
        pcm = wav[(a - lo) * hop:(end - lo) * hop].astype(np.float32)
        self._voiced = end
        self.samples += int(pcm.shape[0])
        return pcm


def talker_pcm(tokens: Iterable[int], stream: Token2WavStream, seen: list[int] | None = None) -> Iterator[np.ndarray]:
    """The talker's tokens, read as they are decoded, spoken through `stream`: each token is pushed as a code once
    the next one shows it was not the last (the talker's last token -- its stop id, or the one the limit cut -- is
    not spoken, as the reference drops it), PCM chunks yielded as they are ready, `finish` at the end. `seen`
    collects every token read."""
    held = None
    for token in tokens:
        if seen is not None:
            seen.append(int(token))
        if held is not None:
            yield from stream.push([held])
        held = token
    yield from stream.finish()
