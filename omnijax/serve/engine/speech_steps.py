"""The speech pool's compiled calls (`omnijax.serve.engine.speech`): the batched talker prefill and step over the
pool's paged KV rows, greedy or drawn (`TalkerSampling`), and the row bookkeeping of the pool's cache.

Drawn speech uses the keys `omnijax.models.qwen3_omni.talker_decode.TalkerDecode` uses for one sequence, per row
from its seed: talker token n with `fold_in(fold_in(key(seed), 0), n)`, frame n's code predictor with
`fold_in(fold_in(key(seed), 1), n)`; so a row draws what that utterance spoken alone draws (the warped scores and
the draw are per row). The warps are static (one compiled step per distinct setting): rows of different settings
step in separate calls of a tick, each writing only its own rows.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from omnijax.decoding import Sampling
from omnijax.kept_executables import cached_jit
from omnijax.kv import paged as paged_lib
from omnijax.models.qwen3_omni import talker_forward
from omnijax.models.qwen3_omni.talker import TalkerConfig
from omnijax.models.qwen3_omni.talker_decode import talker_scores
from omnijax.models.qwen3_omni.talker_forward import Params
from omnijax.retention import base as retention_base

__all__ = ["draw", "pick", "prefill", "reset_row", "step", "take_rows", "trim"]

Warps = tuple[Sampling, Sampling]  # (the talker's first-codebook warp, the code predictor's)


def pick(logits: jax.Array, banned: jax.Array) -> jax.Array:
    """`[B]` int32: the greedy talker token, the `banned` ids suppressed."""
    return jnp.argmax(jnp.where(banned, -jnp.inf, logits), axis=-1).astype(jnp.int32)


def _keys(seeds: jax.Array, stream: int, counts: jax.Array) -> jax.Array:
    """`[B]` PRNG keys: `fold_in(fold_in(key(seed), stream), count)` per row."""
    return jax.vmap(lambda s, n: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), stream), n))(seeds, counts)


def _draw(logits: jax.Array, banned: jax.Array, history: jax.Array, seeds: jax.Array, counts: jax.Array,
          warp: Sampling) -> jax.Array:
    scores = talker_scores(logits, banned, history, warp)
    return jax.vmap(jax.random.categorical)(_keys(seeds, 0, counts), scores).astype(jnp.int32)


@cached_jit(static_argnames="warp")
def draw(logits: jax.Array, banned: jax.Array, history: jax.Array, seeds: jax.Array, counts: jax.Array, *,
         warp: Sampling) -> jax.Array:
    """`[B]` int32: talker token `counts[b]` of each row drawn from `logits [B, V]` (suppressed, then `warp` with
    the repetition penalty over `history [B, N]`, -1 = padding) with the row's seed."""
    return _draw(logits, banned, history, seeds, counts, warp)


@cached_jit(static_argnames="config", donate_argnames="kv")
def prefill(config: TalkerConfig, params: Params, kv: paged_lib.PagedKV, embeds: jax.Array, valid: jax.Array,
            positions: jax.Array, banned: jax.Array
            ) -> tuple[paged_lib.PagedKV, jax.Array, jax.Array, jax.Array]:
    """The talker prompts of the rows where `valid`: `(kv, hidden [B, D], logits [B, V], greedy token [B])`."""
    kv, hidden, logits = talker_forward.rows_prefill(config, params, kv, embeds, valid, positions)
    return kv, hidden, logits, pick(logits, banned)


@cached_jit(static_argnames=("config", "warps"), donate_argnames="kv")
def step(config: TalkerConfig, params: Params, kv: paged_lib.PagedKV, hidden: jax.Array, token: jax.Array,
         text_row: jax.Array, position: jax.Array, active: jax.Array, banned: jax.Array, seeds: jax.Array,
         steps: jax.Array, history: jax.Array, *, warps: Warps | None = None
         ) -> tuple[paged_lib.PagedKV, jax.Array, jax.Array, jax.Array]:
    """One talker frame of the `active` rows: `(kv, codes [B, Q], hidden, next token [B])`. Greedy when `warps` is
    None (`seeds`, `steps`, `history` unused); else the code predictor draws frame `steps[b]` and the talker token
    `steps[b] + 1` of each row (keys from `seeds [B]`, the penalty over `history [B, N]`)."""
    key = None if warps is None else _keys(seeds, 1, steps)
    kv, codes, hidden, logits = talker_forward.rows_step(config, params, kv, hidden, token, text_row, position,
                                                         active, key=key, predictor=None if warps is None
                                                         else warps[1])
    nxt = pick(logits, banned) if warps is None else _draw(logits, banned, history, seeds, steps + 1, warps[0])
    return kv, codes, hidden, nxt


@cached_jit(static_argnames=("config", "policy"), donate_argnames="kv")
def trim(config: Any, policy: Any, kv: paged_lib.PagedKV, next_pos: jax.Array, active: jax.Array
         ) -> paged_lib.PagedKV:
    """The `active [B]` rows trimmed by the talker's KV policy (`SpeechConfig.talker_kv`; either family's talker
    config, `next_pos [B]` each row's next position), the others untouched: what that utterance's cache alone is
    trimmed to after the same write."""
    d = config.decoder
    kv, _, _ = retention_base.trim(policy, kv, next_pos, rope=(d.rope_base, d.mrope_section), active=active)
    return kv


@cached_jit(donate_argnames="kv")
def reset_row(kv: paged_lib.PagedKV, row: jax.Array) -> paged_lib.PagedKV:
    """Row `row` emptied, its pages released."""
    kv = paged_lib.release_pages(kv, kv.page_table[row])
    return kv.replace(page_table=kv.page_table.at[row].set(-1), seq_slots=kv.seq_slots.at[row].set(0),
                      next_order=kv.next_order.at[row].set(0), exhausted=kv.exhausted.at[row].set(False),
                      dropped=kv.dropped.at[row].set(0))


@cached_jit
def take_rows(kv: paged_lib.PagedKV, rows: jax.Array) -> paged_lib.PagedKV:
    """New row i takes old row `rows[i]`, or an empty row where -1 (old rows left out own no pages): one compiled
    program per pair of buckets."""
    src, keep = jnp.maximum(rows, 0), rows >= 0

    def select(x, fill):
        return jnp.where(keep.reshape((-1,) + (1,) * (x.ndim - 1)), x[src], jnp.asarray(fill, x.dtype))

    return kv.replace(page_table=select(kv.page_table, -1), seq_slots=select(kv.seq_slots, 0),
                      next_order=select(kv.next_order, 0), exhausted=select(kv.exhausted, False),
                      dropped=select(kv.dropped, 0))
