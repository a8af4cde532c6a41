"""The recall programs of an engine with `StreamConfig(recall=...)`, compiled before serving (issue 40): what
`omnijax.serve.app.warm_up` runs so that a session's first question compiles nothing.

Per batch bucket the server warms, scratch sessions fill the bucket and one of them is fed filler chunks until it
has stored an evicted unit, then asked a question and served until it is answered: the question's forward, its
scoring (on the recall executor), the re-laying shift, the side step under `NoSlide`, the release, the deferred
trim, and the row moves of that bucket. The programs whose shapes depend on how many tokens are moved are then run
for every power-of-two bucket: the recall write up to the recall budget (writing no token), the capture's gather up
to a row's cells, and the scoring's RoPE undo of the question's queries up to a chunk's tokens and of stored keys up
to a row's cells (the stored-key batches of a larger tier compile on the recall executor at first use, off the engine
thread). The scratch sessions are closed afterwards: the pool is left as it was.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Sequence

import numpy as np

from omnijax.chunks.chunk import text_chunk
from omnijax.kv import host_tier, host_tier_scoring
from omnijax.retention.recall import warm_writes

SCORE_TIMEOUT_S = 600.0


def warm_up_recall(engine: Any, buckets: Sequence[int]) -> dict[str, int]:
    """Compiles the recall programs of `engine` (module docstring) for the batch `buckets`, between ticks, with no
    session open. Returns what was warmed: `{"buckets": ..., "questions": ..., "writes": ..., "gathers": ...,
    "undos": ...}`. Raises ValueError when the engine has no recall or sessions are open."""
    recall = engine.recall
    if recall is None:
        raise ValueError("warm_up_recall needs an engine with StreamConfig(recall=Recall(...))")
    if engine.sessions:
        raise ValueError(f"warm_up_recall runs before serving; sessions are open: {engine.sessions}")
    c, T = engine.model_config, engine.config.chunk_tokens
    tau = engine.config.max_answer_tokens
    cells = recall.num_pages * engine.config.stream.page_size
    vocab = np.arange(3, 3 + T) % c.vocab_size
    questions = 0
    for b in buckets:
        ids = [f"warmup-recall-{b}-{i}" for i in range(b)]
        for sid in ids:
            engine.open(sid)
        try:
            first = recall.sessions[ids[0]]  # one session asks: the row moves are programs of the bucket, any row
            for i in range(max(1, cells // T)):  # filler until it has stored a unit (the pool never filled)
                if first.tier.units or engine.free_pages * engine.config.stream.page_size < 2 * T:
                    break
                engine.submit(ids[0], text_chunk(vocab, length=T, unit=2 * i), 0)
                engine.tick(per_token=False)
            if first.tier.units and tau:
                engine.submit(ids[0], text_chunk(vocab[:max(1, T // 2)], length=T, unit=10_000, answer_tokens=tau),
                              tau)
                while ids[0] not in engine.tick(per_token=False).outputs:
                    concurrent.futures.wait(recall.futures(), SCORE_TIMEOUT_S)
                questions += 1
        finally:
            for sid in ids:
                engine.close(sid)
    theta, section, interleaved = c.rope_base, c.mrope_section, c.mrope_interleaved
    at_original = recall.config.recall.at_own_positions(engine.config.stream.policy)
    kv = warm_writes(engine.state.kv, recall.config.recall.budget, rope=(theta, section), interleaved=interleaved,
                     turn=not at_original)
    engine.state = dataclasses.replace(engine.state, kv=kv)
    writes = max(0, recall.config.recall.budget - 1).bit_length() + 1
    gathers = host_tier.warm_gathers(engine.state.kv, cells)
    undos = _warm_undos(c, T, cells, (theta, section, interleaved))
    return {"buckets": len(buckets), "questions": questions, "writes": writes, "gathers": gathers, "undos": undos}


def _warm_undos(c: Any, T: int, cells: int, rope: tuple) -> int:
    """The scoring's RoPE undo (`host_tier_scoring.unrotated`) of the queries (query heads, up to `T` tokens) and of
    stored keys (kv heads, up to `cells` tokens), every bucket."""
    A = c.position_axes
    runs = 0
    for heads, limit in ((c.num_heads, T), (c.num_kv_heads, min(cells, host_tier_scoring.MASS_BATCH_TOKENS))):
        n = 1
        while True:
            host_tier_scoring.unrotated(np.zeros((c.num_layers, heads, n, c.head_dim), np.float32),
                                        np.zeros((A, n), np.int32), rope)
            runs += 1
            if n >= limit:
                break
            n = max(16, 2 * n)
    return runs
