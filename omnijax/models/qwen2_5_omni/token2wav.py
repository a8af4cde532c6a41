"""Qwen2.5-Omni Token2Wav (`token2wav.*` of the full release): codec tokens -> mel by the DiT's flow-matching ODE
solve, mel -> waveform by BigVGAN, as transformers 5.2.0's `Qwen2_5OmniToken2WavModel.forward`.

`sample_mel` is the reference's `Qwen2_5OmniToken2WavDiTModel.sample` with the initial noise passed in (the reference
draws it with `torch.randn([1, T, M])` inside): T = tokens * `repeats` frames, the time grid `linspace(0, 1,
num_steps)` warped by `sway` (`t + sway (cos(pi t / 2) - 1 + t)`, sway -1 by default: small steps near t = 0), one
step per interval of the reference's `RungeKutta4ODESolver` (Kutta's 3/8 rule: four velocity evaluations a step, so
`4 (num_steps - 1)` DiT forwards -- 36 for the default 10 steps), the velocity guided as `g + (g - u) *
guidance_scale` from the conditioned and unconditioned halves of one doubled-batch forward (one plain forward when
guidance_scale < 1e-5). The speaker enters twice: its `conditioning` vector (`[E]`, the release's `cond` of each
voice, broadcast to every frame) and its reference mel (`[T_ref, M]`, `ref_mel`, through the ECAPA encoder).

`synthesize` chains both (`[B, samples]` out; the reference squeezes the batch, and supports batch 1 only).
`token2wav_components` are the conversion tables of both halves (the converter's "token2wav" component).

Streaming: `solve_window` solves new frames beside past frames whose ODE states are held, what
`token2wav_stream.Token2WavStream` runs block by block as the talker decodes (its docstring tells what equals the
one-shot decode and what is measured).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omnijax._checks import JsonConfig
from omnijax.checkpoint.name_tables import Component
from omnijax.errors import UnsupportedConfigError
from omnijax.kept_executables import cached_jit
from omnijax.models.encoders.common import HF_PRETRAINED_CONFIG_ATTRIBUTES
from omnijax.models.qwen2_5_omni.bigvgan import BigVGAN, BigVGANConfig, bigvgan_component, vocode, vocode_params
from omnijax.models.qwen2_5_omni.token2wav_dit import DiT, DiTConfig, dit_component, dit_forward, dit_params

__all__ = ["Token2Wav", "Token2WavConfig", "sample_mel", "solve_window", "synthesize",
           "time_grid", "token2wav_components"]


@dataclasses.dataclass(frozen=True)
class Token2WavConfig(JsonConfig):
    """The DiT's and the vocoder's configs (transformers' `Qwen2_5OmniToken2WavConfig`).

    Attributes:
        dit: the flow-matching DiT.
        bigvgan: the vocoder.
    """

    dit: DiTConfig = DiTConfig()
    bigvgan: BigVGANConfig = BigVGANConfig()

    def __post_init__(self):
        if self.dit.mel_dim != self.bigvgan.mel_dim:
            raise ValueError(f"dit mel_dim {self.dit.mel_dim} != bigvgan mel_dim {self.bigvgan.mel_dim}")

    @property
    def dtype(self) -> str:
        return self.dit.dtype

    @property
    def samples_per_token(self) -> int:
        """Waveform samples per codec token (480 for the release: 20 ms at 24 kHz)."""
        return self.dit.repeats * self.bigvgan.hop

    @classmethod
    def from_hf(cls, token2wav_config: Mapping[str, Any], dtype: str = "float32") -> "Token2WavConfig":
        """Reads a Hugging Face `Qwen2_5OmniToken2WavConfig` (`dit_config`, `bigvgan_config`).

        Raises:
            UnsupportedConfigError: an attribute not understood (in either sub-config).
        """
        data = dict(token2wav_config.to_dict() if hasattr(token2wav_config, "to_dict") else token2wav_config)
        unknown = sorted(set(data) - HF_PRETRAINED_CONFIG_ATTRIBUTES - {"dit_config", "bigvgan_config"})
        if unknown:
            raise UnsupportedConfigError(f"token2wav_config.{unknown[0]}", data[unknown[0]],
                                         "not understood by the omnijax Token2Wav (refusing to guess its effect)")
        return cls(dit=DiTConfig.from_hf(data.get("dit_config") or {}, dtype),
                   bigvgan=BigVGANConfig.from_hf(data.get("bigvgan_config") or {}, dtype))


class Token2Wav(nnx.Module):
    """Both halves' parameters: `dit` (`token2wav_dit.DiT`) and `bigvgan` (`bigvgan.BigVGAN`)."""

    def __init__(self, config: Token2WavConfig, *, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.dit = DiT(config.dit, rngs=rngs)
        self.bigvgan = BigVGAN(config.bigvgan, rngs=rngs)


def token2wav_components(config: Token2WavConfig) -> list[Component]:
    """The conversion tables: `dit` (prefix `token2wav.code2wav_dit_model.`) and `bigvgan`
    (`token2wav.code2wav_bigvgan_model.`)."""
    return [dit_component(config.dit), bigvgan_component(config.bigvgan)]


def time_grid(num_steps: int, sway: float | None) -> jax.Array:
    """The reference's ODE time points `[num_steps]` (float32): linspace(0, 1), warped by `sway` unless None."""
    t = jnp.linspace(0.0, 1.0, num_steps, dtype=jnp.float32)
    if sway is not None:
        t = t + sway * (jnp.cos(math.pi / 2 * t) - 1 + t)
    return t


def solve_window(params: Mapping[str, Any], config: DiTConfig, past: jax.Array, noise: jax.Array,
                 conditioning: jax.Array, reference_mel: jax.Array, codes: jax.Array, *, num_steps: int,
                 guidance_scale: float, sway: float | None, keep_stages: bool, offset: jax.Array | int = 0
                 ) -> tuple[jax.Array, jax.Array | None]:
    """The ODE solve of new frames beside `P` past frames whose states are given (traceable; `sample_mel` and the
    streamed decode, `token2wav_stream`, call it under jit).

    Every velocity evaluation runs the DiT over `[past, new]`; the past frames' states at each RK4 stage are taken
    from `past` (what their own solve fed the DiT there), not evolved, and only the new frames' velocities are used.

    Args:
        past: `[num_steps - 1, 4, B, P, M]` the past frames' state at each step's four stage inputs (P may be 0).
        noise: `[B, N, M]` the new frames' initial state.
        codes: `[B, (P + N) / repeats]` the codec tokens of past and new frames.
        keep_stages: also return the new frames' stage inputs (`[num_steps - 1, 4, B, N, M]`), else None.
        offset: the utterance position of the first past frame (`dit_forward`'s: the DiT's RoPE is not relative).

    Returns:
        `(x1 [B, N, M] the new frames at t = 1, stages or None)`.
    """
    if num_steps < 2:
        raise ValueError(f"num_steps must be >= 2 (one ODE step), got {num_steps}")
    B, N, _ = noise.shape
    P = past.shape[3]
    speaker = jnp.broadcast_to(jnp.asarray(conditioning, jnp.float32)[:, None], (B, P + N, conditioning.shape[-1]))

    def velocity(t: jax.Array, x: jax.Array, held: jax.Array) -> jax.Array:
        x = jnp.concatenate([held, x], axis=1)
        if guidance_scale < 1e-5:
            return dit_forward(params, config, x, reference_mel, speaker, codes, t, apply_cfg=False,
                               offset=offset)[:, P:]
        out = dit_forward(params, config, x, reference_mel, speaker, codes, t, apply_cfg=True, offset=offset)
        guided, null = out[:B, P:], out[B:, P:]
        return guided + (guided - null) * guidance_scale

    def step(x: jax.Array, inputs: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array | None]:
        t0, t1, held = inputs
        dt = t1 - t0
        k1 = velocity(t0, x, held[0])  # Kutta's 3/8 rule, as the reference's RungeKutta4ODESolver
        s2 = x + dt * k1 * (1 / 3)
        k2 = velocity(t0 + dt * (1 / 3), s2, held[1])
        s3 = x + dt * (k2 - k1 * (1 / 3))
        k3 = velocity(t0 + dt * (2 / 3), s3, held[2])
        s4 = x + dt * (k1 - k2 + k3)
        k4 = velocity(t1, s4, held[3])
        return x + (k1 + 3 * (k2 + k3) + k4) * dt / 8, jnp.stack([x, s2, s3, s4]) if keep_stages else None

    t = time_grid(num_steps, sway)
    return jax.lax.scan(step, jnp.asarray(noise, jnp.float32), (t[:-1], t[1:], jnp.asarray(past, jnp.float32)))


@cached_jit(static_argnames=("config", "num_steps", "guidance_scale", "sway"))
def sample_mel(params: Mapping[str, Any], config: DiTConfig, noise: jax.Array, conditioning: jax.Array,
               reference_mel: jax.Array, codes: jax.Array, *, num_steps: int = 10, guidance_scale: float = 0.5,
               sway: float | None = -1.0) -> jax.Array:
    """The ODE solve from `noise` at t = 0 to the mel at t = 1 (pure, jitted per shape and settings).

    Args:
        params: `dit_params(model)`.
        config: the DiT's config (static).
        noise: `[B, T, M]` the initial state, T = tokens * repeats (the reference's `torch.randn`).
        conditioning: `[B, E]` the speaker vector.
        reference_mel: `[B, T_ref, M]` the speaker's reference mel.
        codes: `[B, tokens]` codec tokens.
        num_steps: time points (num_steps - 1 RK4 steps; >= 2).
        guidance_scale: classifier-free guidance weight (< 1e-5: none, one plain forward per evaluation).
        sway: the time grid's warp coefficient (None: uniform).

    Returns:
        `[B, M, T]` float32 mel, bands first (what the reference's `sample` returns).
    """
    if num_steps < 2:
        raise ValueError(f"num_steps must be >= 2 (one ODE step), got {num_steps}")
    B, _, M = noise.shape
    past = jnp.zeros((num_steps - 1, 4, B, 0, M), jnp.float32)
    mel, _ = solve_window(params, config, past, noise, conditioning, reference_mel, codes, num_steps=num_steps,
                          guidance_scale=guidance_scale, sway=sway, keep_stages=False)
    return mel.transpose(0, 2, 1)


def synthesize(model: Token2Wav, codes: Any, conditioning: Any, reference_mel: Any, noise: Any, *,
               num_steps: int = 10, guidance_scale: float = 0.5, sway: float | None = -1.0) -> jax.Array:
    """Codec tokens -> waveform `[B, tokens * samples_per_token]` in [-1, 1] (the reference's forward, with the
    initial noise given).

    Args:
        model: the parameters.
        codes: `[B, tokens]` (or `[tokens]`) codec tokens in [0, num_embeds].
        conditioning: `[B, E]` (or `[E]`) the voice's conditioning vector.
        reference_mel: `[B, T_ref, M]` (or `[T_ref, M]`) the voice's reference mel.
        noise: `[B, tokens * repeats, M]` (or unbatched) initial ODE state.
        num_steps, guidance_scale, sway: as `sample_mel`.

    Raises:
        ValueError: shapes that do not fit, or a token outside the codec table.
    """
    c = model.config
    codes, conditioning = np.atleast_2d(np.asarray(codes)), np.atleast_2d(np.asarray(conditioning, np.float32))
    reference_mel, noise = np.asarray(reference_mel, np.float32), np.asarray(noise, np.float32)
    reference_mel = reference_mel[None] if reference_mel.ndim == 2 else reference_mel
    noise = noise[None] if noise.ndim == 2 else noise
    B, n = codes.shape
    if not np.issubdtype(codes.dtype, np.integer) or codes.size == 0 or codes.min() < 0 or \
            codes.max() > c.dit.num_embeds:
        raise ValueError(f"codes must be a non-empty integer array in [0, {c.dit.num_embeds}]")
    if noise.shape != (B, n * c.dit.repeats, c.dit.mel_dim):
        raise ValueError(f"noise has shape {noise.shape}, expected {(B, n * c.dit.repeats, c.dit.mel_dim)}")
    if n * c.dit.repeats > c.dit.max_position_embeddings:
        raise ValueError(f"{n} tokens make {n * c.dit.repeats} mel frames, above max_position_embeddings "
                         f"{c.dit.max_position_embeddings}")
    if conditioning.shape != (B, c.dit.enc_emb_dim):
        raise ValueError(f"conditioning has shape {conditioning.shape}, expected {(B, c.dit.enc_emb_dim)}")
    if reference_mel.ndim != 3 or reference_mel.shape[0] != B or reference_mel.shape[2] != c.dit.mel_dim:
        raise ValueError(f"reference_mel has shape {reference_mel.shape}, expected ({B}, frames, {c.dit.mel_dim})")
    mel = sample_mel(dit_params(model.dit), c.dit, noise, conditioning, reference_mel, codes, num_steps=num_steps,
                     guidance_scale=guidance_scale, sway=sway)
    return vocode(vocode_params(model.bigvgan), c.bigvgan, mel)
