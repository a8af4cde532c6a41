"""`evaluate` with `StreamConfig(recall=Recall(...))` (issue 40): each session runs alone through `omnijax.Session`.

Recall is host-side work between steps (store what a step evicted, score the stored units at a question, write the
chosen ones back), so it cannot run inside `evaluate`'s one compiled `vmap`-over-sessions program. A configuration
with recall therefore runs its sessions one after the other, each through a batch-1 `Session` with the same
settings, the same padded chunk schedule (one compiled step for every chunk) and the same sampling key `evaluate`
gives that session (`omnijax.decoding.folded_keys(seed, [s])`). What it returns has the shapes the batched
program's output has, so `evaluate` builds its `SessionResult`s from it the same way; each session's recall figures
(`omnijax.streaming.recall_session.RecallStats`) come beside it.

A mesh is refused by name (the sessions run on the default device). Throughput is that of one session at a time.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from omnijax.chunks.chunk import Chunk
from omnijax.decoding import folded_keys, seed_of
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.recall_session import RecallStats
from omnijax.streaming.session import Session, StreamModel, graphdef_config
from omnijax.streaming.step import init_state


def run_recall_sessions(model: StreamModel, chunks: Chunk, own: np.ndarray, config: StreamConfig, *,
                        keep_logits: bool, score_ids: np.ndarray | None, stat_names: Sequence[str]
                        ) -> tuple[dict[str, Any], list[RecallStats]]:
    """Runs each of the `len(own)` sessions of `chunks` (`[S, C, 1, T]`, `evaluate`'s padded schedule) through its
    own `Session(model, config)` (`config.recall` set, `config.num_pages` set).

    Each chunk's `answer_tokens` is capped at `config.max_answer_tokens`, as `evaluate` caps it.

    Args:
        model, chunks, own, config: the model, the padded sessions, each one's own chunk count, the settings.
        keep_logits, score_ids: what to return besides the tokens (as `evaluate` takes them).
        stat_names: the per-chunk statistics to report (`omnijax.eval.runner.STAT_NAMES`).

    Returns:
        `(merged, stats)`: `merged` holds what `evaluate`'s program returns, `{"stats": {name: [S, C]}, "tokens":
        [S, C, tau], "logits": [S, C, V] (keep_logits), "scores": [S, C, K] (score_ids)}` (chunks past a session's
        own count are zeros), and `stats` one `RecallStats` per session.
    """
    if config.recall is None or config.num_pages is None:
        raise ValueError("run_recall_sessions needs a config with recall and num_pages set")
    decoder_config = graphdef_config(model)
    S, C = len(own), int(np.shape(chunks.token_ids)[1])
    tau = config.max_answer_tokens
    seed = seed_of(config.decoding)
    rows: list[list[dict[str, Any]]] = []
    figures = []
    for s in range(S):
        state = init_state(decoder_config, num_pages=config.num_pages, page_size=config.page_size, batch=1,
                           seed=seed, kv_dtype=config.kv_dtype)
        state = dataclasses.replace(state, key=folded_keys(seed, jnp.arange(s, s + 1)))
        session = Session(model, config, state=state)
        row = []
        for c in range(int(own[s])):
            chunk = jax.tree.map(lambda x: None if x is None else np.asarray(x[s, c]), chunks)
            chunk = dataclasses.replace(chunk, answer_tokens=np.minimum(np.asarray(chunk.answer_tokens), tau))
            out = session.feed(chunk)
            layout = out.stats.layout
            stats = {name: getattr(layout, name, None) for name in stat_names}
            stats.update(evicted=out.stats.evicted, moved=out.stats.moved, next_pos=out.stats.next_pos)
            got = jax.device_get({"stats": {k: jnp.reshape(v, (-1,))[0] for k, v in stats.items()},
                                  "tokens": out.tokens[0], "logits": out.logits[0]})
            item = {"stats": got["stats"], "tokens": np.asarray(got["tokens"])}
            logits = np.asarray(got["logits"], np.float32)
            if keep_logits:
                item["logits"] = logits
            if score_ids is not None:
                item["scores"] = np.asarray(jax.nn.log_softmax(jnp.asarray(logits)))[np.asarray(score_ids)]
            row.append(item)
        rows.append(row)
        figures.append(session.recall_stats())
    template = next(r[0] for r in rows if r)

    def gather(read) -> np.ndarray:
        first = np.asarray(read(template))
        out = np.zeros((S, C) + first.shape, first.dtype)
        for s, row in enumerate(rows):
            for c, item in enumerate(row):
                out[s, c] = read(item)
        return out

    merged: dict[str, Any] = {"stats": {k: gather(lambda i, k=k: i["stats"][k]) for k in template["stats"]},
                              "tokens": gather(lambda i: i["tokens"])}
    for key in ("logits", "scores"):
        if key in template:
            merged[key] = gather(lambda i, key=key: i[key])
    return merged, figures
