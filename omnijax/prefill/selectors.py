"""Prefill compression selectors and per-layer budget schedules.

A selector is a frozen dataclass (static, part of the compiled program) with

    select(q_obs, keys, budget) -> Selection

where `q_obs [B, W, H, d]` are the queries of the prompt's last W tokens (post-RoPE; None for selectors that need
none), `keys [B, S, G, d]` the layer's full prompt keys and `budget` the tokens kept per KV head (a layer keeps
`G * budget` entries). Budgets are token counts and include the observation window. Scoring (SnapKV's pooled
window attention) is separate from selection (per-head or head-adaptive top-k), and scoring runs with memory
independent of the prompt length unless `impl="reference"`.

Selectors: `SnapKV`, `RecentTokens`, `AdaKV`, `ChunkKV` (whole chunks ranked by mean SnapKV score) and `KeyDiff`
(keys least like the mean key direction), all in `REGISTRY` by name. `ChunkKV` and `KeyDiff` keep exactly what
kvpress 0.5.5's `ChunkKVPress(SnapKVPress)` and `KeyDiffPress` keep; `kvpress_budget` turns a kvpress compression
ratio into the budget that keeps the same count.

Budget schedules turn a total token budget into per-layer budgets that sum to it exactly: `uniform_budgets` and
`pyramid_budgets` (PyramidKV: more tokens in lower layers, an arithmetic ramp).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import ClassVar, Protocol

import jax
import jax.numpy as jnp

from omnijax._checks import check_power_of_two
from omnijax.kernels import streaming_topk as topk_lib
from omnijax.prefill.cache import Selection
from omnijax.registry import Registry

SCORE_IMPLS = ("reference", "xla", "pallas")


class Selector(Protocol):
    """What a prefill selector has: `select(q_obs, keys, budget)` picks the prompt positions each KV head keeps;
    `needs_window` says whether it reads the observation window's queries. `REGISTRY` holds the ones omnijax ships."""

    name: ClassVar[str]
    needs_window: ClassVar[bool]

    def select(self, q_obs: jax.Array | None, keys: jax.Array, budget: int) -> Selection:
        ...


class WindowedScoring(Protocol):
    """The scoring settings a windowed selector (SnapKV, AdaKV, ChunkKV) shares: the top-k's implementation, its
    block size and the pooling kernel."""

    impl: str
    block_size: int
    pool_kernel: int


# The prefill selectors by name (`omnijax.registry.Registry`): `register` adds a class under its `name`.
REGISTRY: Registry[Selector] = Registry("prefill selector", Selector)
register = REGISTRY.register


def _uniform_offsets(batch: int, num_kv_heads: int, per_head: int) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(num_kv_heads + 1, dtype=jnp.int32) * per_head, (batch, num_kv_heads + 1))


def _with_window(prefix_index: jax.Array, S: int, window: int) -> jax.Array:
    """`[B, G, k]` ascending prefix indices + the window's `window` indices -> `[B, G, k + window]` ascending."""
    B, G, _ = prefix_index.shape
    win = jnp.broadcast_to(jnp.arange(S - window, S, dtype=jnp.int32), (B, G, window))
    return jnp.concatenate([prefix_index.astype(jnp.int32), win], axis=-1)


def topk_scores(q_obs: jax.Array, keys: jax.Array, k: int, *, impl: str, block_size: int,
                pool_kernel: int) -> tuple[jax.Array, jax.Array]:
    """SnapKV top-k over the prompt prefix (window excluded): `(index [B, G, k] ascending, score [B, G, k])`."""
    if impl == "reference":
        return topk_lib.streaming_topk_reference(q_obs, keys, k=k, pool_kernel=pool_kernel)
    if impl == "xla":
        return topk_lib.streaming_topk_blockwise(q_obs, keys, k=k, block_size=block_size, pool_kernel=pool_kernel)
    if impl == "pallas":
        return topk_lib.streaming_topk(q_obs, keys, k=k, block_size=block_size, pool_kernel=pool_kernel,
                                       interpret=jax.default_backend() == "cpu")
    raise ValueError(f"unknown scoring impl {impl!r}; available: {SCORE_IMPLS}")


def _whole_prompt_or_none(selector, keys: jax.Array, budget: int) -> Selection | None:
    """What every windowed selector (SnapKV, AdaKV) does before scoring: everything when `budget` covers the prompt,
    None when it must score.

    Raises:
        ValueError: when `budget` (below the prompt length) does not exceed the selector's window.
    """
    B, S, G, _ = keys.shape
    if budget >= S:
        return _keep_all(B, S, G)
    if budget <= selector.window:
        raise ValueError(f"{type(selector).__name__} budget {budget} must exceed its window {selector.window}")
    return None


def _check_windowed(selector) -> None:
    """Refuses the settings a windowed selector (SnapKV, AdaKV) cannot score with, when it is built."""
    name = type(selector).__name__
    if not isinstance(selector.window, numbers.Integral) or selector.window < 1:
        raise ValueError(f"{name}: window must be a positive int, got {selector.window!r}")
    kernel = selector.pool_kernel
    if not isinstance(kernel, numbers.Integral) or kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"{name}: pool_kernel must be an odd positive int, got {kernel!r}")
    if selector.impl not in SCORE_IMPLS:
        raise ValueError(f"{name}: unknown scoring impl {selector.impl!r}; available: {SCORE_IMPLS}")
    check_power_of_two(f"{name}: block_size", selector.block_size)


def _prefix_topk(selector: WindowedScoring, q_obs: jax.Array, keys: jax.Array,
                 k: int) -> tuple[jax.Array, jax.Array]:
    """`topk_scores` of the prompt prefix with a windowed selector's scoring settings."""
    return topk_scores(q_obs, keys, k, impl=selector.impl, block_size=selector.block_size,
                       pool_kernel=selector.pool_kernel)


@register
@dataclasses.dataclass(frozen=True)
class SnapKV:
    """SnapKV as published: pooled window attention per KV head; the window is always kept.

    Attributes:
        window: observation window W (the prompt's last W tokens).
        pool_kernel: average-pooling kernel over keys (odd).
        impl: scoring implementation: "reference" (dense W x S scores), "xla" (two-pass blockwise, memory
            independent of S) or "pallas" (the Pallas kernels of `omnijax.kernels.streaming_topk`).
        block_size: key block of the blockwise passes (a power of two).
    """

    window: int = 64
    pool_kernel: int = 5
    impl: str = "xla"
    block_size: int = 512

    name: ClassVar[str] = "snapkv"
    needs_window: ClassVar[bool] = True

    def __post_init__(self):
        _check_windowed(self)

    def select(self, q_obs: jax.Array | None, keys: jax.Array, budget: int) -> Selection:
        if (whole := _whole_prompt_or_none(self, keys, budget)) is not None:
            return whole
        B, S, G, _ = keys.shape
        index, _ = _prefix_topk(self, q_obs, keys, budget - self.window)
        return Selection(index=_with_window(index, S, self.window).reshape(B, G * budget),
                         offset=_uniform_offsets(B, G, budget))


@register
@dataclasses.dataclass(frozen=True)
class RecentTokens:
    """The last `budget` prompt tokens in every head."""

    name: ClassVar[str] = "recent"
    needs_window: ClassVar[bool] = False

    def select(self, q_obs: jax.Array | None, keys: jax.Array, budget: int) -> Selection:
        B, S, G, _ = keys.shape
        budget = min(budget, S)
        index = jnp.broadcast_to(jnp.tile(jnp.arange(S - budget, S, dtype=jnp.int32), G), (B, G * budget))
        return Selection(index=index, offset=_uniform_offsets(B, G, budget))


@register
@dataclasses.dataclass(frozen=True)
class AdaKV:
    """Head-adaptive budgets (AdaKV) over SnapKV scores, in the flattened per-head layout.

    A layer keeps `G * budget` tokens in all: each head keeps its window and at least `floor` of its uniform share
    of prefix tokens; the rest of the layer's prefix budget goes to the highest-scoring (head, token) pairs across
    heads. Heads therefore get different segment lengths, and the layer stores exactly `G * budget` entries.
    Candidates come from each head's own top list, so scoring memory stays independent of the prompt length.
    """

    window: int = 64
    pool_kernel: int = 5
    floor: float = 0.2
    impl: str = "xla"
    block_size: int = 512

    name: ClassVar[str] = "adakv"
    needs_window: ClassVar[bool] = True

    def __post_init__(self):
        _check_windowed(self)
        if not 0.0 <= self.floor <= 1.0:
            raise ValueError(f"AdaKV: floor must lie in [0, 1], got {self.floor!r}")

    def select(self, q_obs: jax.Array | None, keys: jax.Array, budget: int) -> Selection:
        if (whole := _whole_prompt_or_none(self, keys, budget)) is not None:
            return whole
        B, S, G, _ = keys.shape
        share = budget - self.window  # uniform prefix share per head
        total = G * share  # the layer's prefix budget
        guaranteed = int(self.floor * share)
        candidates = min(total, S - self.window)  # the global top-`total` lies within each head's top-`candidates`
        index, score = _prefix_topk(self, q_obs, keys, candidates)  # [B, G, c] ascending index
        # Rank within head by score (descending, ties to the lower index); the first `guaranteed` are kept outright.
        order = jnp.argsort(-score, axis=-1, stable=True)
        rank = jnp.argsort(order, axis=-1)
        must = rank < guaranteed
        pool = jnp.where(must, jnp.inf, score).reshape(B, G * candidates)  # guaranteed entries sort first
        _, chosen = jax.lax.top_k(pool, total)  # [B, total] positions in the flattened candidate list
        keep = jnp.zeros((B, G * candidates), bool).at[jnp.arange(B)[:, None], chosen].set(True)
        keep = keep.reshape(B, G, candidates)
        counts = jnp.sum(keep, axis=-1).astype(jnp.int32) + self.window  # [B, G] per-head budgets
        offset = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), jnp.cumsum(counts, axis=1)], axis=1)
        # Flatten: each head's kept prefix indices (ascending), then its window, into its segment.
        rank_in_head = jnp.cumsum(keep, axis=-1) - 1  # [B, G, c]
        dest = jnp.where(keep, offset[:, :G, None] + rank_in_head, G * budget)
        rows = jnp.arange(B)[:, None, None]
        flat = jnp.zeros((B, G * budget), jnp.int32).at[rows, dest].set(index.astype(jnp.int32), mode="drop")
        win_dest = offset[:, 1:, None] - self.window + jnp.arange(self.window)  # [B, G, W]
        flat = flat.at[rows, win_dest].set(jnp.arange(S - self.window, S, dtype=jnp.int32))
        return Selection(index=flat, offset=offset)

def snapkv_scores(selector: WindowedScoring, q_obs: jax.Array, keys: jax.Array) -> jax.Array:
    """SnapKV's pooled window scores of every prompt-prefix token, `[B, G, S - W]` float32, with a windowed
    selector's scoring settings: dense under impl "reference", else the blockwise top-k asked for every prefix token
    (memory O(G S) for the scores, none of it W x S)."""
    W = q_obs.shape[1]
    if selector.impl == "reference":
        return topk_lib.snapkv_scores_reference(q_obs, keys, pool_kernel=selector.pool_kernel)
    B, S, G, _ = keys.shape
    index, score = _prefix_topk(selector, q_obs, keys, S - W)
    rows, heads = jnp.arange(B)[:, None, None], jnp.arange(G)[None, :, None]
    return jnp.zeros((B, G, S - W), jnp.float32).at[rows, heads, index].set(score, mode="drop")


def _check_chunk_length(selector) -> None:
    length = selector.chunk_length
    if not isinstance(length, numbers.Integral) or isinstance(length, bool) or length < 1:
        raise ValueError(f"{type(selector).__name__}: chunk_length must be a positive int, got {length!r}")


@register
@dataclasses.dataclass(frozen=True)
class ChunkKV:
    """ChunkKV over SnapKV scores: whole chunks of `chunk_length` consecutive prompt tokens, the same chunks in
    every KV head, as kvpress 0.5.5's `ChunkKVPress(press=SnapKVPress(window_size=window, kernel_size=pool_kernel),
    chunk_length=chunk_length)` keeps them.

    Token scores are SnapKV's pooled window scores per KV head, the observation window's tokens scored one above the
    sequence's highest prefix score (over all heads), so the window is favoured but not forced: it is kept only
    inside chosen chunks. The prompt is cut into `ceil(S / chunk_length)` chunks from its start (the last one shorter
    when `chunk_length` does not divide S); a chunk's score is the mean over its tokens of the scores summed over
    KV heads; a budget of n tokens per head keeps the `n // chunk_length` best chunks (ties to the earlier chunk).
    A chosen short last chunk keeps fewer tokens than the budget: every head then has `chunk_length - S %
    chunk_length` fewer entries, and the layer's selection ends in that many unowned entries per head (index -1,
    outside every head's segment, never attended). A prompt shorter than one chunk is selected by `SnapKV` (as
    kvpress delegates to its scorer press). kvpress applies the first sequence's chunks to the whole batch and
    takes the window's score from the whole batch's maximum; here every sequence is selected on its own, so the
    two agree for batch 1.

    Attributes:
        window: observation window W (the prompt's last W tokens); the prompt must be longer.
        pool_kernel: average-pooling kernel over keys (odd).
        chunk_length: tokens per chunk; a budget must hold at least one chunk.
        impl: scoring implementation, as for `SnapKV`.
        block_size: key block of the blockwise passes (a power of two).
    """

    window: int = 64
    pool_kernel: int = 5
    chunk_length: int = 20
    impl: str = "xla"
    block_size: int = 512

    name: ClassVar[str] = "chunkkv"
    needs_window: ClassVar[bool] = True

    def __post_init__(self):
        _check_windowed(self)
        _check_chunk_length(self)

    def select(self, q_obs: jax.Array | None, keys: jax.Array, budget: int) -> Selection:
        B, S, G, _ = keys.shape
        length = self.chunk_length
        chunks = -(-S // length)
        kept = budget // length
        if budget >= S or kept >= chunks:
            return _keep_all(B, S, G)
        if S < length:  # no whole chunk: the scorer press alone
            return SnapKV(self.window, self.pool_kernel, self.impl, self.block_size).select(q_obs, keys, budget)
        if kept < 1:
            raise ValueError(f"ChunkKV budget {budget} holds no chunk of {length} tokens")
        if S <= self.window:
            raise ValueError(f"ChunkKV needs a prompt longer than its window {self.window}, got {S} tokens")
        prefix = snapkv_scores(self, q_obs, keys)  # [B, G, S - W]
        top = jnp.max(prefix, axis=(1, 2), keepdims=True) + 1.0
        token = jnp.concatenate([prefix, jnp.broadcast_to(top, (B, G, self.window))], axis=-1).sum(axis=1)  # [B, S]
        padded = jnp.pad(token, ((0, 0), (0, chunks * length - S)))
        sizes = jnp.minimum(length, S - jnp.arange(chunks) * length)  # the last chunk may be short
        chunk_score = padded.reshape(B, chunks, length).sum(axis=-1) / sizes
        _, best = jax.lax.top_k(chunk_score, kept)  # [B, kept]
        chosen = jnp.zeros((B, chunks), bool).at[jnp.arange(B)[:, None], best].set(True)
        keep = chosen[:, jnp.arange(S) // length]  # [B, S]
        count = jnp.sum(keep, axis=1).astype(jnp.int32)  # [B] tokens per head
        rank = jnp.cumsum(keep, axis=1) - 1
        size = G * kept * length
        head = jnp.arange(G)[None, :, None]
        dest = jnp.where(keep[:, None, :], head * count[:, None, None] + rank[:, None, :], size)  # [B, G, S]
        token_index = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, G, S))
        index = jnp.full((B, size), -1, jnp.int32).at[jnp.arange(B)[:, None, None], dest].set(token_index,
                                                                                            mode="drop")
        offset = jnp.arange(G + 1, dtype=jnp.int32)[None, :] * count[:, None]
        return Selection(index=index, offset=offset)


@register
@dataclasses.dataclass(frozen=True)
class KeyDiff:
    """KeyDiff: per KV head, the `budget` keys least similar to the head's mean key direction, as kvpress 0.5.5's
    `KeyDiffPress` keeps them (one shot over the prompt, not its block-wise iteration).

    A key's score is minus its cosine similarity to the anchor, the mean over the prompt of the head's unit keys
    (post-RoPE, as the cache holds them); the top `budget` scores are kept, ties to the earlier token. Needs no
    queries, so no observation window.
    """

    name: ClassVar[str] = "keydiff"
    needs_window: ClassVar[bool] = False

    def select(self, q_obs: jax.Array | None, keys: jax.Array, budget: int) -> Selection:
        B, S, G, _ = keys.shape
        if budget >= S:
            return _keep_all(B, S, G)
        k = keys.astype(jnp.float32)
        norm = jnp.linalg.norm(k, axis=-1)  # [B, S, G]
        anchor = jnp.mean(k / jnp.maximum(norm, 1e-12)[..., None], axis=1, keepdims=True)  # [B, 1, G, d]
        cosine = jnp.sum(k * anchor, axis=-1) / (jnp.maximum(norm, 1e-8) * jnp.maximum(
            jnp.linalg.norm(anchor, axis=-1), 1e-8))
        _, index = jax.lax.top_k(-cosine.transpose(0, 2, 1), budget)  # [B, G, budget]
        return Selection(index=jnp.sort(index, axis=-1).astype(jnp.int32).reshape(B, G * budget),
                         offset=_uniform_offsets(B, G, budget))


def kvpress_budget(compression_ratio: float, prompt_len: int, *, chunk_length: int | None = None) -> int:
    """The per-head budget that keeps what a kvpress 0.5.5 press with `compression_ratio` keeps of a prompt of
    `prompt_len` tokens: `max(1, int(S * (1 - ratio)))` tokens for a scorer press (`SnapKVPress`, `KeyDiffPress`),
    and for `ChunkKVPress` (`chunk_length` given) `max(1, int(ceil(S / chunk_length) * (1 - ratio)))` chunks, i.e.
    that many times `chunk_length` tokens (the scorer press's count when the prompt is shorter than one chunk).
    A ratio of 0 keeps the whole prompt."""
    if not 0 <= compression_ratio < 1:
        raise ValueError(f"compression_ratio must lie in [0, 1), got {compression_ratio!r}")
    if compression_ratio == 0:
        return prompt_len
    if chunk_length is None or prompt_len < chunk_length:
        return max(1, int(prompt_len * (1 - compression_ratio)))
    chunks = prompt_len // chunk_length + (prompt_len % chunk_length > 0)
    return max(1, int(chunks * (1 - compression_ratio))) * chunk_length


def _keep_all(B: int, S: int, G: int) -> Selection:
    index = jnp.broadcast_to(jnp.tile(jnp.arange(S, dtype=jnp.int32), G), (B, G * S))
    return Selection(index=index, offset=_uniform_offsets(B, G, S))


def uniform_budgets(total: int, num_layers: int) -> tuple[int, ...]:
    """`total` tokens per head over all layers, split as evenly as possible (earlier layers get the remainder)."""
    if num_layers < 1 or total < num_layers:
        raise ValueError(f"uniform budgets need num_layers >= 1 and at least one token per layer, got total {total} "
                         f"over {num_layers} layers")
    base, extra = divmod(total, num_layers)
    return tuple(base + (1 if layer < extra else 0) for layer in range(num_layers))


def pyramid_budgets(total: int, num_layers: int, *, window: int = 64, beta: float = 20.0) -> tuple[int, ...]:
    """PyramidKV: per-layer budgets on an arithmetic ramp from the bottom layer down to the top, summing to `total`.

    Beyond the window every layer keeps, the mean prefix share `a = total / L - window` is spread as a ramp from
    `2a - a / beta` (layer 0) to `a / beta` (last layer); rounding by largest remainders keeps the sum exact.
    """
    if num_layers < 1 or window < 0 or not beta >= 1:
        raise ValueError(f"pyramid budgets need num_layers >= 1, window >= 0 and beta >= 1 (the top layer keeps 1/beta "
                         f"of the mean share), got {num_layers}, {window}, {beta}")
    if total < num_layers * window:
        raise ValueError(f"total budget {total} cannot hold a {window}-token window in each of {num_layers} layers")
    prefix = total - num_layers * window
    mean = prefix / num_layers
    low, high = mean / beta, 2 * mean - mean / beta
    if num_layers == 1:
        ideal = [float(prefix)]
    else:
        ideal = [high - (high - low) * layer / (num_layers - 1) for layer in range(num_layers)]
    floors = [int(x) for x in ideal]
    short = prefix - sum(floors)
    by_remainder = sorted(range(num_layers), key=lambda layer: (-(ideal[layer] - floors[layer]), layer))
    for layer in by_remainder[:short]:
        floors[layer] += 1
    return tuple(window + f for f in floors)
