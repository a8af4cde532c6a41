"""The batched talker programs of Qwen2.5-Omni's speech pool (`omnijax.serve.engine.speech_qwen25`): the prefill
of the rows admitted since the last tick and one talker step over the rows that can step, each ending with
`talker_forward.generate_greedy`'s pick (repetition penalty, suppressed ids, argmax) per row. Only active rows write.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from omnijax.kept_executables import cached_jit
from omnijax.kv import paged as paged_lib
from omnijax.models.qwen2_5_omni import talker_forward
from omnijax.models.qwen2_5_omni.talker import TalkerConfig

__all__ = ["pick", "prefill", "step"]


def pick(logits: jax.Array, seen: jax.Array, banned: jax.Array, penalty: jax.Array) -> jax.Array:
    """`[B]` int32: `talker_forward.generate_greedy`'s choice per row (traceable): the repetition penalty on the ids
    `seen` (negative logits multiplied, positive ones divided), the `banned` ids at -inf, then argmax."""
    scores = logits.astype(jnp.float32)
    scores = jnp.where(seen, jnp.where(scores < 0, scores * penalty, scores / penalty), scores)
    return jnp.argmax(jnp.where(banned, -jnp.inf, scores), axis=-1).astype(jnp.int32)


@cached_jit(static_argnames="config", donate_argnames="kv")
def prefill(config: TalkerConfig, params: Any, kv: paged_lib.PagedKV, rows: jax.Array, valid: jax.Array,
             positions: jax.Array, seen: jax.Array, banned: jax.Array, penalty: jax.Array
             ) -> tuple[paged_lib.PagedKV, jax.Array]:
    """The talker prompts of the rows where `valid [B, T]` (left-aligned `rows [B, T, Dt]`, `positions [3, B, T]`):
    `(kv, first token [B])`."""
    kv, logits = talker_forward.talker_chunk(config, params, kv, rows, valid, positions)
    last = jnp.maximum(jnp.sum(valid, axis=1) - 1, 0)
    logits = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
    return kv, pick(logits, seen, banned, penalty)


@cached_jit(static_argnames="config", donate_argnames="kv")
def step(config: TalkerConfig, params: Any, kv: paged_lib.PagedKV, token: jax.Array, text_row: jax.Array,
          position: jax.Array, active: jax.Array, seen: jax.Array, banned: jax.Array, penalty: jax.Array
          ) -> tuple[paged_lib.PagedKV, jax.Array]:
    """One talker token of the `active [B]` rows (`token [B]` the last one, `text_row [B, Dt]`, `position [B]`):
    `(kv, next token [B])` (meaningless for inactive rows, which write nothing)."""
    x = params["codec_embedding"][token].astype(jnp.float32) + text_row.astype(jnp.float32)
    B = token.shape[0]
    pos = jnp.broadcast_to(position.astype(jnp.int32)[None, :, None], (3, B, 1))
    kv, logits = talker_forward.talker_chunk(config, params, kv, x[:, None], active[:, None], pos)
    return kv, pick(logits[:, 0], seen, banned, penalty)
