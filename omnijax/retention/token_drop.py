"""TimeChat-Online's Differential Token Drop (Yao et al., 2025) as a pre-cache chunk filter.

DTD drops the visual tokens of a frame that barely differ from the token at the same spatial position in the
previous frame, before they reach the language model: static content is written once, changes are kept. Here it is
a pure function of a `Chunk` (or a stack of chunks, as `omnijax.stream` takes them) that marks the redundant tokens
invalid; invalid tokens are neither written nor attended, so the filter composes with any retention policy (the
policy then bounds what survives the filter). Kept tokens keep their positions and the cursor still advances by the
chunk's `advance`: the survivors keep the spatio-temporal layout of the video (a re-indexing policy closes the gaps
at its next trim).

Definitions (chosen where the paper leaves them open to a token-stream layout; the choices are parameters):

- Candidates: valid tokens with an embedding (`embed_mask`) whose span kind is in `kinds` (default VIDEO only;
  add IMAGE for MiniCPM-o's per-unit frames). Each kind forms its own chain of frames.
- Frames: with `frame_tokens=None` a frame is one span run (its `offset` restarts at 0: a Qwen2.5-Omni video run of
  one 2 s unit, a MiniCPM-o image); with `frame_tokens=n`, every n tokens of a run (`offset // n`) form a frame. A
  token's spatial index is its `offset` (resp. `offset % n`). The first candidate of a sequence always opens a frame.
- Previous frame: the frame just before in the sequence's stream order (chunk by chunk, token by token), whatever
  lies between (audio, text, other chunks). A token is compared with the previous frame's token of the same
  spatial index, as the paper compares frames t-1 and t; the previous frame's *input* features are used, whether
  or not that token itself was dropped (adjacent-frame differencing, the paper's rule).
- Similarity: feature-level cosine similarity of the embeddings in float32, `dot / max(|a| |b|, 1e-12)` (a zero
  vector is similar to nothing). A token is dropped when the similarity exceeds `threshold` (strictly). Tokens
  without a counterpart (first frame, a larger frame) are kept. The paper's pixel-level L1 variant needs the pixels,
  which a chunk does not carry.

Cross-chunk comparison needs the previous chunk: filter a whole stack (`stream`'s input) or, step by step,
`stack_chunks([previous, chunk])` and keep the last chunk of the result.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp

from omnijax.chunks.chunk import Chunk
from omnijax.chunks.spans import SpanKind

__all__ = ["DifferentialTokenDrop", "differential_token_drop"]

_EPS = 1e-12


def _lower_bound(keys_f, keys_s, qf, qs):
    """Vectorised lexicographic lower bound: for each query `(qf, qs)` the first index k with
    `(keys_f[k], keys_s[k]) >= (qf, qs)` in arrays sorted by `(f, s)` (L if none)."""
    L = keys_f.shape[0]
    lo = jnp.zeros(qf.shape, jnp.int32)
    hi = jnp.full(qf.shape, L, jnp.int32)
    for _ in range(max(L, 1).bit_length() + 1):
        open_ = lo < hi
        mid = jnp.clip((lo + hi) // 2, 0, max(L - 1, 0))
        f, s = keys_f[mid], keys_s[mid]
        less = (f < qf) | ((f == qf) & (s < qs))
        lo = jnp.where(open_ & less, mid + 1, lo)
        hi = jnp.where(open_ & ~less, mid, hi)
    return lo


def _redundant_one(cand, offset, emb, threshold, frame_tokens):
    """`[L]` bool: candidates of one kind of one sequence (stream order) whose previous-frame twin is similar."""
    L = cand.shape[0]
    big = jnp.iinfo(jnp.int32).max
    if frame_tokens is None:
        spatial, starts = offset, offset == 0
    else:
        spatial, starts = offset % frame_tokens, offset % frame_tokens == 0
    first = cand & (jnp.cumsum(cand) == 1)
    start = cand & (starts | first)
    fid = jnp.cumsum(start).astype(jnp.int32) - 1
    fid_c = jnp.where(cand, fid, big)
    sp_c = jnp.where(cand, spatial, big).astype(jnp.int32)
    idx = jnp.lexsort((sp_c, fid_c))
    keys_f, keys_s = fid_c[idx], sp_c[idx]
    at = _lower_bound(keys_f, keys_s, fid - 1, spatial.astype(jnp.int32))
    safe = jnp.clip(at, 0, L - 1)
    found = cand & (fid >= 1) & (at < L) & (keys_f[safe] == fid - 1) & (keys_s[safe] == spatial)
    partner = idx[safe]
    a = emb.astype(jnp.float32)
    b = a[partner]
    dot = jnp.sum(a * b, axis=-1)
    norm = jnp.sqrt(jnp.sum(a * a, axis=-1)) * jnp.sqrt(jnp.sum(b * b, axis=-1))
    sim = dot / jnp.maximum(norm, _EPS)
    return found & (sim > threshold)


@dataclasses.dataclass(frozen=True)
class DifferentialTokenDrop:
    """TimeChat-Online's differential token drop as a chunk filter (see the module docstring for the exact rule).

    Call it on a chunk (`[B, T]` fields) or a stack of chunks (`[C, B, T]`); it returns the same chunk(s) with the
    redundant visual tokens marked invalid. Pure jnp, jittable; the chunks must carry `embeds`.

    Example:
        chunks = DifferentialTokenDrop(threshold=0.9)(chunks)
        result = omnijax.stream(model, chunks, policy=StreamingVLM(...))

    Attributes:
        threshold: cosine similarity above which a token is redundant, in [-1, 1] (the paper tunes it per model;
            0.9 here is this library's choice: near-identical features only).
        frame_tokens: tokens per frame inside a span run; None: one frame per span run.
        kinds: span kinds filtered (each its own frame chain); default VIDEO.
    """

    threshold: float = 0.9
    frame_tokens: int | None = None
    kinds: tuple[int, ...] = (int(SpanKind.VIDEO),)

    def __post_init__(self):
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, numbers.Real) or \
                not -1.0 <= float(self.threshold) <= 1.0:
            raise ValueError(f"DifferentialTokenDrop: threshold must be a number in [-1, 1], got {self.threshold!r}")
        if self.frame_tokens is not None and (isinstance(self.frame_tokens, bool)
                                              or not isinstance(self.frame_tokens, numbers.Integral)
                                              or self.frame_tokens < 1):
            raise ValueError(f"DifferentialTokenDrop: frame_tokens must be None or an int >= 1, got "
                             f"{self.frame_tokens!r}")
        kinds = tuple(self.kinds)
        if not kinds or any(int(k) not in {int(s) for s in SpanKind} for k in kinds) or len(set(kinds)) != len(kinds):
            raise ValueError(f"DifferentialTokenDrop: kinds must be distinct SpanKind values, got {self.kinds!r}")
        object.__setattr__(self, "kinds", tuple(int(k) for k in kinds))

    def redundant(self, chunk: Chunk) -> jax.Array:
        """Bool mask shaped like `chunk.valid`: the tokens the filter drops."""
        if chunk.embeds is None or chunk.embed_mask is None:
            raise ValueError("DifferentialTokenDrop compares token embeddings: the chunk carries no embeds")
        valid = jnp.asarray(chunk.valid).astype(bool)
        stacked = valid.ndim == 3
        if valid.ndim not in (2, 3):
            raise ValueError(f"expected a chunk [B, T] or a stack [C, B, T], got valid of shape {valid.shape}")

        def flat(x):  # [C, B, T, ...] -> [B, C*T, ...] in stream order; [B, T, ...] unchanged
            x = jnp.asarray(x)
            if not stacked:
                return x
            x = jnp.moveaxis(x, 0, 1)
            return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])

        v, m = flat(valid), flat(jnp.asarray(chunk.embed_mask).astype(bool))
        span, offset, emb = flat(chunk.span), flat(chunk.offset).astype(jnp.int32), flat(chunk.embeds)
        drop = jnp.zeros(v.shape, bool)
        for kind in self.kinds:
            cand = v & m & (span == kind)
            drop = drop | jax.vmap(_redundant_one, in_axes=(0, 0, 0, None, None))(
                cand, offset, emb, float(self.threshold), self.frame_tokens)
        if stacked:
            C, B, T = valid.shape
            drop = jnp.moveaxis(drop.reshape(B, C, T), 1, 0)
        return drop

    def __call__(self, chunk: Chunk) -> Chunk:
        """The chunk (or stack) with the redundant tokens marked invalid."""
        drop = self.redundant(chunk)
        return dataclasses.replace(chunk, valid=jnp.asarray(chunk.valid).astype(bool) & ~drop)


def differential_token_drop(chunk: Chunk, threshold: float = 0.9, *, frame_tokens: int | None = None,
                            kinds: tuple[int, ...] = (int(SpanKind.VIDEO),)) -> Chunk:
    """Functional form of `DifferentialTokenDrop(threshold, frame_tokens, kinds)(chunk)`."""
    return DifferentialTokenDrop(threshold=threshold, frame_tokens=frame_tokens, kinds=kinds)(chunk)
