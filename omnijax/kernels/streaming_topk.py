"""SnapKV scoring + per-KV-head top-k with temporary memory independent of the prompt length (TideKV §4.2).

`streaming_topk(q_obs, keys, k=...)` selects, for every (batch, kv head), the `k` prefix keys that SnapKV (as
published) ranks highest, without ever holding the `[B, H, W, S]` score tensor:

* `q_obs [B, W, H, d]`: queries of the last W prompt tokens, post-RoPE; query i sits at prompt index S - W + i.
* `keys [B, S, G, d]`: all S prompt keys of one layer, post-RoPE. H = G * R; query head h belongs to kv head h // R.
* candidates are the S - W prefix keys `j < S - W`; the window's own W keys are always kept by the caller and are
  never returned.

Score definition (SnapKV as published), all in float32 (bfloat16 inputs are upcast, so products are exact):

    logits[b, h, i, j] = q[b, i, h] . keys[b, j, h // R] / sqrt(d)   for j <= S - W + i, -inf otherwise
    p = softmax over all S keys (window columns count in the normaliser)
    s[b, h, j] = mean_i p[b, h, i, j]                                 for j < S - W (window columns dropped)
    pooled[b, h, j] = sum_{|o| <= pool_kernel // 2} s[b, h, j + o] / pool_kernel
                      (zero padding outside [0, S - W), counted in the mean; window columns are padding too)
    scores[b, g, j] = mean_r pooled[b, g * R + r, j]                  -> [B, G, S - W]

Every function returns `(indices [B, G, k] int32 ascending, scores [B, G, k] float32 in the same order)`.
Ties prefer the lower key index (the order `lax.top_k` gives on the dense scores): a running top-k keeps earlier
(lower-index) entries before a new block's entries in the merge, and `lax.top_k` keeps the earlier of equal values.

Three implementations share `_validate`:

* `streaming_topk_reference` / `snapkv_scores_reference`: dense, materialises `[B, G, R, W, S]` (the oracle).
* `streaming_topk_blockwise`: pure jnp, two `lax.scan`s over key blocks. Pass 1 streams a running max m and sum
  Z = sum exp(logit - m) per (batch, head, query). Pass 2 recomputes each block's logits plus a halo of
  pool_kernel // 2 keys each side, normalises with (m, Z), pools and averages the group's heads into the block's
  scores. When k + block_size is under a quarter of the prefix, each block merges into a running top-k carried by
  the scan: temporaries O(B H W (block_size + pool_kernel) + B G (k + block_size)), independent of S. For a larger
  k (prefill keeps S / 2) one `lax.top_k` over the `[B, G, S - W]` scores picks the k: temporaries O(B G S) more,
  one float per prefix key and KV head, which the merge's O(k) was already of the order of.
* `streaming_topk`: Pallas (Triton on GPU, `interpret=True` on CPU). Pass 1 is one kernel, grid (batch, kv head,
  row block), that loops over key blocks with `lax.fori_loop` (flash-attention style) and writes m, Z. Pass 2 is a
  kernel called once per key block from a `lax.scan`: grid (batch, kv head, row block), it recomputes the block's and
  the halo's logits, normalises, sums over its rows and pools along the key axis (a banded masked sum, no shifts or
  concatenates), writing partial pooled sums `[B, G, row blocks, block_size]`. The row-block sum, the tail mask and
  the top-k merge stay in jnp (Triton has no sort).

Kernel layout: the R query heads of a kv head are processed together, rows `i * R + r` (query i, head g * R + r),
padded to a multiple of `block_rows`; head_dim is zero-padded to a power of two >= 16 (Triton dot operands want dims
>= 16). When head_dim already is a power of two >= 16 and S >= block_size, pass 1 reads `keys` in place; otherwise it
reads a padded copy (O(S) keys, still no S-sized score buffer). Pass 1 handles a ragged tail with one extra block
ending at S, masking the keys already counted. Pass 2 gathers its block and halo keys with jnp (O(block_size) keys).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_EXACT = lax.Precision.HIGHEST


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _validate(q_obs, keys, k, block_size, pool_kernel) -> None:
    """Static checks shared by the three implementations. `None` skips the k check (scores helper) or the block
    check (dense path)."""
    if q_obs.ndim != 4:
        raise ValueError(f"q_obs must be [B, W, H, d], got shape {q_obs.shape}")
    if keys.ndim != 4:
        raise ValueError(f"keys must be [B, S, G, d], got shape {keys.shape}")
    B, W, H, d = q_obs.shape
    Bk, S, G, dk = keys.shape
    if Bk != B:
        raise ValueError(f"batch mismatch: q_obs has {B}, keys have {Bk}")
    if dk != d:
        raise ValueError(f"head_dim mismatch: q_obs has {d}, keys have {dk}")
    if d < 1:
        raise ValueError(f"head_dim must be positive, got {d}")
    if G < 1 or H % G:
        raise ValueError(f"query heads {H} not a multiple of kv heads {G} (GQA needs H = G * R)")
    if W < 1 or W > S:
        raise ValueError(f"window W must satisfy 1 <= W <= S, got W={W}, S={S}")
    for name, x in (("q_obs", q_obs), ("keys", keys)):
        if jnp.dtype(x.dtype) not in _DTYPES:
            raise ValueError(f"{name} must be float32 or bfloat16, got {x.dtype}")
    if q_obs.dtype != keys.dtype:
        raise ValueError(f"q_obs and keys must share a dtype, got {q_obs.dtype} and {keys.dtype}")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= S - W):
        raise ValueError(f"k must be an int in [1, S - W] = [1, {S - W}], got {k!r}")
    if block_size is not None and (not isinstance(block_size, int) or not _is_pow2(block_size)):
        raise ValueError(f"block_size must be a power of two, got {block_size!r}")
    if not isinstance(pool_kernel, int) or pool_kernel < 1 or pool_kernel % 2 == 0:
        raise ValueError(f"pool_kernel must be an odd positive int, got {pool_kernel!r}")


# --------------------------------------------------------------------------------------------------------------------
# Dense reference
# --------------------------------------------------------------------------------------------------------------------


def _avg_pool(x: jax.Array, kernel: int) -> jax.Array:
    """Mean of every `kernel` consecutive entries along the last axis, no padding (the caller pads):
    `[..., n] -> [..., n - kernel + 1]`, one `lax.reduce_window` sum."""
    window = (1,) * (x.ndim - 1) + (kernel,)
    return lax.reduce_window(x, jnp.zeros((), x.dtype), lax.add, window, (1,) * x.ndim, "VALID") / kernel


def _finalize(idx: jax.Array, vals: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sort a top-k result by index ascending, scores following."""
    order = jnp.argsort(idx, axis=-1)
    return (jnp.take_along_axis(idx, order, axis=-1).astype(jnp.int32),
            jnp.take_along_axis(vals, order, axis=-1).astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("pool_kernel",))
def snapkv_scores_reference(q_obs: jax.Array, keys: jax.Array, *, pool_kernel: int = 5) -> jax.Array:
    """Dense SnapKV scores `[B, G, S - W]` float32 (see the module docstring). Materialises `[B, G, R, W, S]`."""
    _validate(q_obs, keys, None, None, pool_kernel)
    if keys.shape[1] == q_obs.shape[1]:
        raise ValueError(f"no prefix keys to score: S - W = 0 (S = W = {keys.shape[1]})")
    B, W, H, d = q_obs.shape
    S, G = keys.shape[1], keys.shape[2]
    R, Sp, h = H // G, S - W, pool_kernel // 2
    q = q_obs.astype(jnp.float32).reshape(B, W, G, R, d)
    kf = keys.astype(jnp.float32)
    logits = jnp.einsum("bwgrd,bsgd->bgrws", q, kf, precision=_EXACT) * (float(d) ** -0.5)
    visible = jnp.arange(S)[None, :] <= (Sp + jnp.arange(W))[:, None]  # [W, S]
    logits = jnp.where(visible, logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)[..., :Sp]  # window columns dropped after normalising
    s = jnp.mean(p, axis=3)  # over the W queries -> [B, G, R, Sp]
    s = jnp.pad(s, ((0, 0), (0, 0), (0, 0), (h, h)))  # zero padding, counted in the mean
    pooled = _avg_pool(s, pool_kernel)  # [B, G, R, Sp]
    return jnp.mean(pooled, axis=2)  # over the R query heads of each kv group


@functools.partial(jax.jit, static_argnames=("k", "pool_kernel"))
def streaming_topk_reference(q_obs: jax.Array, keys: jax.Array, *, k: int,
                             pool_kernel: int = 5) -> tuple[jax.Array, jax.Array]:
    """Dense oracle: `lax.top_k` on `snapkv_scores_reference`, indices sorted ascending. Returns (indices, scores)."""
    _validate(q_obs, keys, k, None, pool_kernel)
    scores = snapkv_scores_reference(q_obs, keys, pool_kernel=pool_kernel)
    vals, idx = lax.top_k(scores, k)
    return _finalize(idx, vals)


# --------------------------------------------------------------------------------------------------------------------
# Shared streaming pieces
# --------------------------------------------------------------------------------------------------------------------


def _init_topk(B: int, G: int, k: int, S: int) -> tuple[jax.Array, jax.Array]:
    """Empty running top-k: scores -inf, index S (never a candidate; real scores are >= 0 so they displace these)."""
    return jnp.full((B, G, k), -jnp.inf, jnp.float32), jnp.full((B, G, k), S, jnp.int32)


def _merge_topk(run_s, run_i, blk_s, blk_i, k: int):
    """Merge a block's `[B, G, n]` scores (indices `blk_i [n]`) into the running `[B, G, k]` top-k.

    Running entries come first in the concatenation and all have lower key indices than the block's (blocks arrive
    in increasing order), and `lax.top_k` keeps the earlier of equal values: ties go to the lower key index.
    """
    B, G, _ = run_s.shape
    cat_s = jnp.concatenate([run_s, blk_s], axis=-1)
    cat_i = jnp.concatenate([run_i, jnp.broadcast_to(blk_i.astype(jnp.int32), (B, G, blk_i.shape[0]))], axis=-1)
    vals, pos = lax.top_k(cat_s, k)
    return vals, jnp.take_along_axis(cat_i, pos, axis=-1)


def _gather_keys(keys: jax.Array, pos: jax.Array) -> jax.Array:
    """Keys at absolute positions `pos` (clipped into range; callers mask invalid positions) -> [B, n, G, d]."""
    return jnp.take(keys, jnp.clip(pos, 0, keys.shape[1] - 1), axis=1)


# --------------------------------------------------------------------------------------------------------------------
# Pure jnp two-pass version
# --------------------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("k", "block_size", "pool_kernel"))
def streaming_topk_blockwise(q_obs: jax.Array, keys: jax.Array, *, k: int, block_size: int = 512,
                             pool_kernel: int = 5) -> tuple[jax.Array, jax.Array]:
    """Two-pass blockwise SnapKV top-k in jnp; no S-sized score buffer. Returns (indices, scores) like the reference."""
    _validate(q_obs, keys, k, block_size, pool_kernel)
    B, W, H, d = q_obs.shape
    S, G = keys.shape[1], keys.shape[2]
    R, Sp, h, bs = H // G, S - W, pool_kernel // 2, block_size
    scale = float(d) ** -0.5
    q = q_obs.astype(jnp.float32).reshape(B, W, G, R, d)
    qpos = Sp + jnp.arange(W)  # absolute position of each window query

    def logits_at(pos):  # [B, G, R, W, n] float32
        kb = _gather_keys(keys, pos).astype(jnp.float32)
        return jnp.einsum("bwgrd,bngd->bgrwn", q, kb, precision=_EXACT) * scale

    # Pass 1: streaming log-sum-exp over all S keys (window included), causal by absolute index.
    def pass1(carry, j0):
        m_prev, z_prev = carry  # [B, G, R, W]
        pos = j0 + jnp.arange(bs)
        visible = (pos[None, :] <= qpos[:, None]) & (pos < S)[None, :]  # [W, bs]
        s = jnp.where(visible, logits_at(pos), -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=-1))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        p = jnp.where(visible, jnp.exp(s - m_safe[..., None]), 0.0)
        z_next = jnp.exp(m_prev - m_safe) * z_prev + jnp.sum(p, axis=-1)
        return (m_next, z_next), None

    init = (jnp.full((B, G, R, W), -jnp.inf, jnp.float32), jnp.zeros((B, G, R, W), jnp.float32))
    (m, z), _ = lax.scan(pass1, init, jnp.arange(pl.cdiv(S, bs)) * bs)
    inv_z = 1.0 / z

    # Pass 2: per prefix block (+ halo), normalised column means, pooling, group mean: the block's scores.
    def block_scores(j0):
        pos = j0 - h + jnp.arange(bs + 2 * h)  # block plus halo, absolute
        valid = (pos >= 0) & (pos < Sp)  # prefix keys are visible to every window query
        p = jnp.exp(logits_at(pos) - m[..., None]) * inv_z[..., None]
        col = jnp.where(valid, jnp.mean(p, axis=3), 0.0)  # [B, G, R, bs + 2h]; zeros = pooling padding
        pooled = _avg_pool(col, pool_kernel)  # [B, G, R, bs]
        return jnp.mean(pooled, axis=2)  # [B, G, bs]

    starts = jnp.arange(pl.cdiv(Sp, bs)) * bs
    if 4 * (k + bs) < Sp:  # a few of many: a running top-k merged per block, temporaries O(k + block_size)
        def merge(carry, j0):
            idx = j0 + jnp.arange(bs)
            return _merge_topk(*carry, jnp.where(idx < Sp, block_scores(j0), -jnp.inf), idx, k), None

        (vals, idx), _ = lax.scan(merge, _init_topk(B, G, k, S), starts)
        return _finalize(idx, vals)
    # A large share (prefill keeps S / 2): the running merge would hold O(S) entries anyway and run a top-k over
    # k + block_size of them once per block, 1.3x / 1.7x this whole function at 8K / 16K keys (k = S / 2; bench
    # tidekv RESULTS, 2026-12-07); one top-k over the `[B, G, S - W]` scores picks the same entries.
    _, blocks = lax.scan(lambda carry, j0: (carry, block_scores(j0)), None, starts)  # [n, B, G, bs]
    vals, idx = lax.top_k(blocks.transpose(1, 2, 0, 3).reshape(B, G, -1)[..., :Sp], k)
    return _finalize(idx, vals)


# --------------------------------------------------------------------------------------------------------------------
# Pallas version
# --------------------------------------------------------------------------------------------------------------------


def _dot_t(a, b, exact):
    """a [n, d] @ b[m, d]^T in float32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=exact, preferred_element_type=jnp.float32)


def _pass1_kernel(qpos_ref, q_ref, k_ref, m_ref, z_ref, *, scale: float, S: int, block_size: int, exact):
    """One (batch, kv head, row block) program: streaming max / sum of exp over all S keys.

    qpos_ref [block_rows] int32: absolute position of each row's query. q_ref [block_rows, dp]. k_ref [Sk, dp]: this
    kv head's keys (Sk >= max(S, block_size); rows >= S are padding). m_ref, z_ref [block_rows] float32.
    """
    bs = block_size
    q = q_ref[...]
    qpos = qpos_ref[...]
    n_full = S // bs

    def step(start, carry, lo=None):
        m_prev, z_prev = carry
        k = k_ref[pl.ds(start, bs), :]
        kpos = start + lax.broadcasted_iota(jnp.int32, (bs,), 0)
        visible = kpos[None, :] <= qpos[:, None]
        if lo is not None:  # the ragged tail block: keys before `lo` were counted already, keys >= S are padding
            visible = visible & ((kpos >= lo) & (kpos < S))[None, :]
        s = jnp.where(visible, _dot_t(q, k, exact) * scale, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        p = jnp.where(visible, jnp.exp(s - m_safe[:, None]), 0.0)
        z_next = jnp.exp(m_prev - m_safe) * z_prev + jnp.sum(p, axis=1)
        return m_next, z_next

    rows = q.shape[0]
    carry = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32))
    carry = lax.fori_loop(0, n_full, lambda i, c: step(i * bs, c), carry)
    if S % bs:
        tail_start = max(S - bs, 0)  # one block ending at S (or the padded [0, bs) when S < bs)
        carry = step(tail_start, carry, lo=n_full * bs)
    m_ref[...], z_ref[...] = carry


def _pass2_kernel(q_ref, m_ref, z_ref, kpos_ref, k_ref, hpos_ref, hk_ref, o_ref, *, scale: float, Sp: int,
                  half: int, rows: int, exact):
    """One (batch, kv head, row block) program for one key block: pooled, row-summed block scores.

    q_ref [block_rows, dp]; m_ref, z_ref [block_rows] from pass 1. kpos_ref [bs] / k_ref [bs, dp]: the block's
    absolute key positions and keys; hpos_ref [hp] / hk_ref [hp, dp]: the halo's (half keys each side, padded with
    position -1). o_ref [bs]: sum over this block's rows of the pooled probabilities (not yet divided by the row count
    or the pool kernel). Positions outside [0, Sp) contribute zero (the pooling's zero padding).
    """
    br = q_ref.shape[0]
    q = q_ref[...]
    m = m_ref[...]
    row = pl.program_id(2) * br + lax.broadcasted_iota(jnp.int32, (br,), 0)
    w = jnp.where(row < rows, 1.0 / z_ref[...], 0.0)  # padding rows weigh nothing
    kpos = kpos_ref[...]

    def col_sums(k, pos):  # [n]: sum over rows of exp(logit - m) / Z at valid prefix positions
        p = jnp.exp(_dot_t(q, k, exact) * scale - m[:, None]) * w[:, None]
        valid = (pos >= 0) & (pos < Sp)
        return jnp.sum(jnp.where(valid[None, :], p, 0.0), axis=0)

    def pool(c, pos):  # [bs]: sum of c over source positions within `half` of each block position
        diff = pos[:, None] - kpos[None, :]
        band = (diff >= -half) & (diff <= half)
        return jnp.sum(jnp.where(band, c[:, None], 0.0), axis=0)

    out = pool(col_sums(k_ref[...], kpos), kpos)
    if half:
        hpos = hpos_ref[...]
        out = out + pool(col_sums(hk_ref[...], hpos), hpos)
    o_ref[...] = out


@functools.partial(jax.jit, static_argnames=("k", "block_size", "pool_kernel", "block_rows", "interpret",
                                             "num_warps", "num_stages"))
def streaming_topk(q_obs: jax.Array, keys: jax.Array, *, k: int, block_size: int = 128, pool_kernel: int = 5,
                   block_rows: int = 64, interpret: bool = False, num_warps: int = 4,
                   num_stages: int = 2) -> tuple[jax.Array, jax.Array]:
    """Pallas two-pass SnapKV top-k. Returns (indices [B, G, k] int32 ascending, scores [B, G, k] float32).

    `block_size` (keys per block) and `block_rows` (query rows per program, rows = W * R) must be powers of two
    >= 16 (Triton dot operands). See the module docstring.
    """
    _validate(q_obs, keys, k, block_size, pool_kernel)
    if block_size < 16:
        raise ValueError(f"block_size must be >= 16 for the Pallas kernels, got {block_size}")
    if not isinstance(block_rows, int) or not _is_pow2(block_rows) or block_rows < 16:
        raise ValueError(f"block_rows must be a power of two >= 16, got {block_rows!r}")
    B, W, H, d = q_obs.shape
    S, G = keys.shape[1], keys.shape[2]
    R, Sp, half, bs = H // G, S - W, pool_kernel // 2, block_size
    rows = W * R
    br = min(block_rows, _next_pow2(max(rows, 16)))
    n_rb = pl.cdiv(rows, br)
    rows_pad = n_rb * br
    dp = max(16, _next_pow2(d))
    hp = max(16, _next_pow2(2 * half))  # halo rows, padded for the dot
    scale = float(d) ** -0.5
    exact = _EXACT if q_obs.dtype == jnp.float32 else None  # no TF32 for float32 inputs; bf16 products are exact
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)

    # Rows of kv head g: row i * R + r is window query i, query head g * R + r. Padding rows are zero queries.
    qg = q_obs.reshape(B, W, G, R, d).transpose(0, 2, 1, 3, 4).reshape(B, G, rows, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows_pad - rows), (0, dp - d)))
    qpos = jnp.pad(jnp.repeat(Sp + jnp.arange(W, dtype=jnp.int32), R), (0, rows_pad - rows), constant_values=S)

    # Pass 1: m, Z [B, G, rows_pad]. Keys are read in place unless head_dim or a short prompt needs padding.
    k1 = keys
    if dp != d or S < bs:
        k1 = jnp.pad(keys, ((0, 0), (0, max(bs - S, 0)), (0, 0), (0, dp - d)))
    Sk = k1.shape[1]
    row_spec = pl.BlockSpec((None, None, br), lambda b, g, r: (b, g, r))
    m, z = pl.pallas_call(
        functools.partial(_pass1_kernel, scale=scale, S=S, block_size=bs, exact=exact),
        grid=(B, G, n_rb),
        in_specs=[
            pl.BlockSpec((br,), lambda b, g, r: (r,)),  # query positions
            pl.BlockSpec((None, None, br, dp), lambda b, g, r: (b, g, r, 0)),  # query rows
            pl.BlockSpec((None, Sk, None, dp), lambda b, g, r: (b, 0, g, 0)),  # all keys of kv head g
        ],
        out_specs=[row_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct((B, G, rows_pad), jnp.float32)] * 2,
        interpret=interpret,
        compiler_params=params,
        name="streaming_topk_pass1",
    )(qpos, qg, k1)

    # Pass 2: one kernel call per prefix block inside a scan; the running top-k merge stays in jnp.
    block_call = pl.pallas_call(
        functools.partial(_pass2_kernel, scale=scale, Sp=Sp, half=half, rows=rows, exact=exact),
        grid=(B, G, n_rb),
        in_specs=[
            pl.BlockSpec((None, None, br, dp), lambda b, g, r: (b, g, r, 0)),  # query rows
            row_spec,  # m
            row_spec,  # Z
            pl.BlockSpec((bs,), lambda b, g, r: (0,)),  # block key positions
            pl.BlockSpec((None, bs, None, dp), lambda b, g, r: (b, 0, g, 0)),  # block keys
            pl.BlockSpec((hp,), lambda b, g, r: (0,)),  # halo key positions
            pl.BlockSpec((None, hp, None, dp), lambda b, g, r: (b, 0, g, 0)),  # halo keys
        ],
        out_specs=pl.BlockSpec((None, None, None, bs), lambda b, g, r: (b, g, r, 0)),
        out_shape=jax.ShapeDtypeStruct((B, G, n_rb, bs), jnp.float32),
        interpret=interpret,
        compiler_params=params,
        name="streaming_topk_pass2",
    )
    halo_off = jnp.concatenate([jnp.arange(-half, 0), bs + jnp.arange(half)]).astype(jnp.int32)  # [2 * half]

    def pass2(carry, j0):
        run_s, run_i = carry
        kpos = j0 + jnp.arange(bs, dtype=jnp.int32)
        hpos = jnp.pad(j0 + halo_off, (0, hp - 2 * half), constant_values=-1)
        kb = jnp.pad(_gather_keys(keys, kpos), ((0, 0), (0, 0), (0, 0), (0, dp - d)))
        hk = jnp.pad(_gather_keys(keys, hpos), ((0, 0), (0, 0), (0, 0), (0, dp - d)))
        part = block_call(qg, m, z, kpos, kb, hpos, hk)  # [B, G, n_rb, bs]
        blk = jnp.sum(part, axis=2) / (rows * pool_kernel)
        blk = jnp.where(kpos < Sp, blk, -jnp.inf)
        return _merge_topk(run_s, run_i, blk, kpos, k), None

    (vals, idx), _ = lax.scan(pass2, _init_topk(B, G, k, S), jnp.arange(pl.cdiv(Sp, bs), dtype=jnp.int32) * bs)
    return _finalize(idx, vals)
