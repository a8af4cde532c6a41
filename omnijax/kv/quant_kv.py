"""int8 KV pages: `QuantPages`, the quantised storage of a paged cache's keys or values.

Scheme: symmetric absmax int8 per token and KV head. Every `[d]` vector (one token's key or value in one KV head)
is stored as `round(x / s)` clipped to [-127, 127] with one float32 scale `s = max|x| / 127`; dequantised it is
`q * s`, so each element is off by at most `s / 2`. Why this scheme:

* A token's key is written once and then only read (or re-rotated as a whole), so one scale per written vector
  needs no running statistics and no re-scaling of old slots when a new token arrives (per-channel scales, as
  KIVI uses for keys, would change the scale of every slot sharing a channel group).
* Symmetric (no zero point): RoPE-rotated keys and values are roughly centred on zero, and dequantisation is one
  multiply, fused into the gather that reads a block of pages.
* float32 scales: with a head dim of 128 a cell costs 128 + 4 bytes per head for k and again for v, against 256 in
  bf16 (1.94x fewer bytes) and 512 in float32 (3.9x); a bf16 scale would save 2 more bytes per 132 (1.5 %) at the
  price of a relative error of up to 2**-9 on every element of the vector.

`QuantPages` is a pytree standing where a float pool's `[L, N, P, G, d]` array stands (`PagedKV.k` / `.v`): the
model's layer loop carries it, `omnijax.kv.paged.write_layer` quantises what it writes, attention dequantises the
pages it reads, retention's re-rotation dequantises, rotates and requantises the moved keys, and migration moves
values and scales together. It answers `shape` (the logical shape, values' shape), `dtype` (the compute dtype keys
dequantise to), `ndim`, indexing and `reshape` over the leading axes (never the last, the quantised axis), so code
that only reads shapes or moves rows works on it unchanged. Float pools are plain arrays, untouched.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

KV_DTYPES = ("float", "int8")  # "float": the model's dtype (a plain array pool); "int8": QuantPages
QMAX = 127.0


def check_kv_dtype(kv_dtype: str) -> str:
    """Returns `kv_dtype` if it names a KV storage (`KV_DTYPES`); refuses anything else, naming the setting."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    return kv_dtype


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`x [..., d]` -> `(q [..., d] int8, scale [...] float32)`, symmetric absmax over the last axis.

    An all-zero vector gets scale 0 and codes 0 (dequantises to exact zeros).
    """
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / QMAX
    inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
    q = jnp.clip(jnp.round(x * inv[..., None]), -QMAX, QMAX).astype(jnp.int8)
    return q, scale


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    """`q [..., d] int8`, `scale [...]` -> `[..., d]` in `dtype` (computed in float32, then cast)."""
    return (q.astype(jnp.float32) * scale[..., None].astype(jnp.float32)).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantPages:
    """int8 keys or values with one float32 scale per token and KV head (module docstring).

    Attributes:
        values: `[..., d]` int8 codes (a pool's `[L, N, P, G, d]`).
        scale: `[...]` float32 scales (`[L, N, P, G]`).
        dtype_name: the compute dtype the pages dequantise to (static).
    """

    values: jax.Array
    scale: jax.Array
    dtype_name: str = dataclasses.field(default="float32", metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype the pages dequantise to (the model's), not the storage dtype (int8)."""
        return jnp.dtype(self.dtype_name)

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes + self.scale.nbytes)

    def __getitem__(self, index: Any) -> "QuantPages":
        """Indexes the leading axes of values and scales alike (an index must not reach the last axis)."""
        index = index if isinstance(index, tuple) else (index,)
        if any(i is Ellipsis for i in index) or len(index) >= self.values.ndim:
            raise IndexError(f"QuantPages index {index} reaches the quantised last axis")
        return QuantPages(self.values[index], self.scale[index], self.dtype_name)

    def reshape(self, *shape: Any) -> "QuantPages":
        """Reshapes the leading axes; the last axis (the quantised `d`) must stay last and whole."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        if shape[-1] != self.values.shape[-1]:
            raise ValueError(f"QuantPages.reshape keeps the last axis {self.values.shape[-1]}, got {shape}")
        return QuantPages(self.values.reshape(shape), self.scale.reshape(shape[:-1]), self.dtype_name)

    def dense(self, dtype: Any = None) -> jax.Array:
        """The dequantised values, in `dtype` (default the compute dtype)."""
        return dequantize(self.values, self.scale, self.dtype if dtype is None else dtype)

    @classmethod
    def of(cls, x: jax.Array, dtype: Any = None) -> "QuantPages":
        """`x [..., d]` quantised; dequantising gives `dtype` (default `x.dtype`)."""
        q, scale = quantize(x)
        return cls(q, scale, jnp.dtype(x.dtype if dtype is None else dtype).name)


def zeros(shape: tuple[int, ...], dtype: Any) -> QuantPages:
    """An all-zero int8 pool of logical `shape` (`[..., d]`) dequantising to `dtype`."""
    return QuantPages(jnp.zeros(shape, jnp.int8), jnp.zeros(shape[:-1], jnp.float32), jnp.dtype(dtype).name)


def dense(pages: jax.Array | QuantPages, dtype: Any = None) -> jax.Array:
    """Float pages as they are (cast to `dtype` if given), int8 pages dequantised."""
    if isinstance(pages, QuantPages):
        return pages.dense(dtype)
    return pages if dtype is None else pages.astype(dtype)


def take_rows(pages: jax.Array | QuantPages, rows: jax.Array) -> jax.Array | QuantPages:
    """Rows `rows` of axis 1 of `[L, R, ...]` pages (values and scales alike for int8 pages)."""
    if isinstance(pages, QuantPages):
        return QuantPages(jnp.take(pages.values, rows, axis=1), jnp.take(pages.scale, rows, axis=1),
                          pages.dtype_name)
    return jnp.take(pages, rows, axis=1)


def set_rows(pages: jax.Array | QuantPages, rows: jax.Array, new: jax.Array | QuantPages) -> jax.Array | QuantPages:
    """`pages` with rows `rows` of axis 1 replaced by `new` (out-of-range rows dropped). Float `new` written to
    int8 pages is quantised; int8 `new` is written code for code (no requantisation)."""
    if isinstance(pages, QuantPages):
        if not isinstance(new, QuantPages):
            new = QuantPages.of(new, pages.dtype)
        return QuantPages(pages.values.at[:, rows].set(new.values, mode="drop"),
                          pages.scale.at[:, rows].set(new.scale, mode="drop"), pages.dtype_name)
    return pages.at[:, rows].set(dense(new).astype(pages.dtype), mode="drop")


def kv_bytes_per_cell(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str,
                      float_bytes: int = 2) -> int:
    """Bytes one cached token (a cell: its keys and values in every layer) takes in the pool.

    "float" stores `float_bytes` per value (2 for bf16); "int8" one byte per value plus a float32 scale per token,
    layer and KV head, for keys and values each.
    """
    per_vector = head_dim * float_bytes if check_kv_dtype(kv_dtype) == "float" else head_dim + 4
    return 2 * num_layers * num_kv_heads * per_vector
