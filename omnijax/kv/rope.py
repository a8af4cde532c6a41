"""Rotary position embedding: 1D RoPE and Qwen's 3-axis mrope, plus re-rotation of cached keys.

Layout is rotate-half (the two halves of the head dimension pair up). With `mrope_section = (s_t, s_h, s_w)`,
frequency j uses the t position for j < s_t, h for s_t <= j < s_t + s_h, and w after that; the same split repeats on
the second half. With `interleaved=True` (Qwen3-Omni, Qwen3-VL) the axes take frequencies in turn instead: frequency j
uses h when `j % 3 == 1 and j < 3 * s_h`, w when `j % 3 == 2 and j < 3 * s_w`, t otherwise. Angles are always
computed in float32; positions may be fractional (Qwen3-Omni's temporal ids).

Llama-3 RoPE scaling rescales the inverse frequencies by wavelength (`llama3_inverse_frequencies`). A scaled base is
a `ScaledTheta`, accepted wherever a `theta` is, so every caller (the decoder, the re-rotation of cached keys) rotates
with the same frequencies.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class ScaledTheta:
    """A RoPE base with Llama-3 (`rope_type` "llama3") frequency scaling; hashable, usable as a static value.

    Attributes:
        theta: the RoPE base.
        factor: the long-wavelength divisor (8 in Llama 3.1).
        low_freq_factor: `original_max_positions / low_freq_factor` is the wavelength above which frequencies are
            divided by `factor`.
        high_freq_factor: `original_max_positions / high_freq_factor` is the wavelength below which frequencies are
            kept; between the two the result is interpolated.
        original_max_positions: the pretraining context length (`original_max_position_embeddings`).
    """

    theta: float
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: float


def llama3_inverse_frequencies(inv_freq: np.ndarray, factor: float, low_freq_factor: float,
                               high_freq_factor: float, original_max_positions: float) -> np.ndarray:
    """Llama-3 scaling of unscaled inverse frequencies (float32, as transformers' `_compute_llama3_parameters`).

    Frequencies whose wavelength `2 pi / f` exceeds `original_max_positions / low_freq_factor` are divided by
    `factor`; those below `original_max_positions / high_freq_factor` are kept; in between,
    `s = (original_max_positions / wavelength - low) / (high - low)` blends `(1 - s) f / factor + s f`.

    Args:
        inv_freq: `[n]` unscaled inverse frequencies.
        factor, low_freq_factor, high_freq_factor, original_max_positions: the scaling parameters (`ScaledTheta`).

    Returns:
        `[n]` float32 scaled inverse frequencies.
    """
    inv_freq = np.asarray(inv_freq, np.float32)
    low_wavelength = original_max_positions / low_freq_factor
    high_wavelength = original_max_positions / high_freq_factor
    wavelength = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelength > low_wavelength, inv_freq / np.float32(factor), inv_freq)
    smooth = (np.float32(original_max_positions) / wavelength - np.float32(low_freq_factor)) / np.float32(
        high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelength < high_wavelength) & ~(wavelength > low_wavelength)
    return np.where(medium, blended, scaled).astype(np.float32)


def inverse_frequencies(head_dim: int, theta: float | ScaledTheta) -> jnp.ndarray:
    """[head_dim // 2] float32 inverse frequencies, `theta ** (-2j / head_dim)` (Llama-3 scaled for a
    `ScaledTheta`)."""
    base = theta.theta if isinstance(theta, ScaledTheta) else theta
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    inv_freq = (1.0 / (base ** exponents)).astype(np.float32)
    if isinstance(theta, ScaledTheta):
        inv_freq = llama3_inverse_frequencies(inv_freq, theta.factor, theta.low_freq_factor, theta.high_freq_factor,
                                              theta.original_max_positions)
    return jnp.asarray(inv_freq, dtype=jnp.float32)


def axis_of_frequency(head_dim: int, mrope_section: tuple[int, int, int] | None,
                      interleaved: bool = False) -> np.ndarray:
    """[head_dim // 2] int: which position axis drives each rotary frequency (all 0 for 1D RoPE)."""
    if mrope_section is None:
        return np.zeros(head_dim // 2, dtype=np.int32)
    if not interleaved:
        return np.repeat(np.arange(3, dtype=np.int32), mrope_section)
    j = np.arange(head_dim // 2)
    axis = np.zeros(head_dim // 2, dtype=np.int32)
    axis[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
    return axis


def rope_angles(positions: jnp.ndarray, head_dim: int, theta: float | ScaledTheta,
                mrope_section: tuple[int, int, int] | None, interleaved: bool = False) -> jnp.ndarray:
    """Rotation angles per token and frequency.

    Args:
        positions: `[axes, ...]` positions (integer, or float for fractional temporal ids); `axes` is 3 for mrope
            or 1 for plain RoPE (a 1-axis input drives all three mrope axes).
        head_dim: per-head width.
        theta: RoPE base, or a `ScaledTheta` (Llama-3 scaling).
        mrope_section: per-axis frequency split, or None.
        interleaved: the axes take frequencies in turn (see the module docstring).

    Returns:
        `[..., head_dim // 2]` float32 angles.
    """
    inv_freq = inverse_frequencies(head_dim, theta)
    axis = axis_of_frequency(head_dim, mrope_section, interleaved)
    pos = positions.astype(jnp.float32)
    if pos.shape[0] == 1:
        chosen = pos[0][..., None] * inv_freq  # [..., head_dim // 2]
    else:
        per_axis = pos[..., None] * inv_freq  # [axes, ..., head_dim // 2]
        chosen = jnp.take_along_axis(
            per_axis, jnp.asarray(axis).reshape((1,) + (1,) * (pos.ndim - 1) + (-1,)), axis=0)[0]
    return chosen


def rotation(angles: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """`(cos, sin)`, each `[..., head_dim // 2]` float32, of `angles`: what `rotate` applies.

    A layer loop computes them once per chunk and rotates every layer's queries and keys with them; left inside the
    loop body, XLA:GPU would launch the cosine and the sine again in every layer (it does not hoist them).
    """
    return jnp.cos(angles), jnp.sin(angles)


def rotate(x: jnp.ndarray, rot: tuple[jnp.ndarray, jnp.ndarray]) -> jnp.ndarray:
    """Rotates `x` `[..., heads, head_dim]` by `rot = rotation(angles)` (broadcast over heads).

    The rotation runs in float32 and the result is cast back to `x.dtype`, so bfloat16 inputs see one rounding.
    """
    cos, sin = (r[..., None, :] for r in rot)
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def apply_rope(x: jnp.ndarray, angles: jnp.ndarray) -> jnp.ndarray:
    """Rotates `x` `[..., heads, head_dim]` by `angles` `[..., head_dim // 2]`: `rotate(x, rotation(angles))`."""
    return rotate(x, rotation(angles))
