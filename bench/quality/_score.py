"""Per-token log-likelihood of a text streamed through omnijax's paged cache under a retention policy.

`omnijax.streaming.chunk_step` returns the logits of a chunk's last token only (what an answer starts from), so a
perplexity needs the step's forward with every position scored. `score_stream` is `chunk_step` without the answer,
one `lax.scan` over the chunks: the chunk is written through every layer into the retained cache
(`omnijax.models.forward.write_chunk`, the step's own forward), each of its tokens' next-token log-likelihood is
taken from that forward's hidden states, and the policy trims and the paging mode re-lays out exactly as in the step
(`retention.base.trim`, `paging.relayout`). A token is therefore scored against the cache the policy retained before
its chunk plus the chunk's earlier tokens, as the step attends.

The smallest package change that would make this file unnecessary: `chunk_step` returning, when a chunk carries
next-token targets, their log-likelihoods `[B, T]` beside the last logits (one optional field of `Chunk` and of
`ChunkOutput`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omnijax import paging as paging_lib
from omnijax.chunks.chunk import pad_chunk, stack_chunks, text_chunk
from omnijax.kv import layout as layout_lib
from omnijax.kv import paged as paged_lib
from omnijax.models.forward import write_chunk
from omnijax.retention import base as retention_lib
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.session import model_parts
from omnijax.streaming.step import init_state


def _score_chunk(model, kv, next_pos, chunk, targets, config: StreamConfig):
    """One chunk: write it, score its targets, trim. Returns `(kv, next_pos, nll [B, T], attended [B])`."""
    x = model.embed_tokens(chunk.token_ids)
    positions = chunk.positions + next_pos[None, :, None]
    meta = paged_lib.SlotMeta(pos=positions, unit=chunk.unit, span=chunk.span, offset=chunk.offset)
    kv, hidden = write_chunk(model, kv, x, chunk.valid, positions, meta, impl=config.impl,
                             track_scores=getattr(config.policy, "needs_scores", False),  # H2O, as chunk_step
                             placement=config.paging.placement)
    attended = layout_lib.layout_stats(kv, config.subblock).retained_cells  # history + this chunk
    logp = jax.nn.log_softmax(model.logits(hidden), axis=-1)  # [B, T, V] float32
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    nll = jnp.where(chunk.valid, nll, 0.0)
    next_pos = next_pos + chunk.advance
    kv, next_pos, evicted = retention_lib.trim(config.policy, kv, next_pos,
                                               rope=(model.config.rope_base, model.config.mrope_section))
    kv, _ = paging_lib.relayout(config.paging, kv, evicted, config.subblock)
    return kv, next_pos, nll, attended


@functools.partial(jax.jit, static_argnames=("graphdef", "config"))
def _scan(graphdef, params, chunks, targets, *, config: StreamConfig):
    model = nnx.merge(graphdef, params)
    state = init_state(model.config, num_pages=config.num_pages, page_size=config.page_size,
                       kv_dtype=config.kv_dtype)  # in the program
    kv, next_pos = state.kv, state.next_pos

    def body(carry, xs):
        kv, next_pos = carry
        kv, next_pos, nll, attended = _score_chunk(model, kv, next_pos, *xs, config)
        return (kv, next_pos), (nll, attended)

    _, (nll, attended) = jax.lax.scan(body, (kv, next_pos), (chunks, targets))
    return nll, attended


def score_stream(model, ids: np.ndarray, policy, *, chunk: int, cells: int | None,
                 page_size: int = 64, kv_dtype: str = "float", impl: str = "xla") -> tuple[np.ndarray, np.ndarray]:
    """Streams `ids[:-1]` in chunks of `chunk` tokens under `policy` and scores every next token `ids[1:]`.

    Args:
        model: a loaded omnijax model (any family with a text decoder).
        ids: `[N + 1]` token ids.
        policy: a retention policy object.
        chunk: tokens per streamed chunk.
        cells: the most cells the policy holds after a trim (None: the whole text, full context).
        page_size: slots per KV page.
        kv_dtype: the pool's storage (`StreamConfig.kv_dtype`: "float" or "int8").
        impl: the attention (`StreamConfig.impl`); a policy with `needs_scores` (H2O) needs "reference", the one
            that computes the attention mass it accumulates.

    Returns:
        `(nll [N], attended [num_chunks])`: each token's negative log-likelihood (nats) of its successor, and the
        cells each chunk's forward attended (the retained history plus the chunk).
    """
    ids = np.asarray(ids, np.int32)
    n = ids.shape[0] - 1
    if n < 1 or chunk < 1:
        raise ValueError(f"score_stream needs at least 2 ids and chunk >= 1, got {ids.shape[0]} ids, chunk {chunk}")
    held = n + chunk if cells is None else cells + 2 * chunk
    config = StreamConfig(policy=policy, num_pages=-(-held // page_size) + 2, page_size=page_size,
                          kv_dtype=kv_dtype, impl=impl)
    starts = range(0, n, chunk)
    chunks = stack_chunks([pad_chunk(text_chunk(ids[a:min(a + chunk, n)], unit=i + 1), chunk)
                           for i, a in enumerate(starts)])
    targets = np.zeros((len(starts), 1, chunk), np.int32)
    for i, a in enumerate(starts):
        b = min(a + chunk, n)
        targets[i, 0, :b - a] = ids[a + 1:b + 1]
    graphdef, params = model_parts(model)
    nll, attended = _scan(graphdef, params, jax.tree.map(jnp.asarray, chunks), jnp.asarray(targets), config=config)
    return np.asarray(nll)[:, 0].reshape(-1)[:n], np.asarray(attended)[:, 0]
