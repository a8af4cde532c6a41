"""`evaluate`: many streaming sessions x several retention / paging configurations as jitted, sharded programs.

Each configuration is one compiled program: `jax.vmap` over a batch of sessions of a `lax.scan` over chunks whose
body is `omnijax.streaming.chunk_step` (the step `omnijax.stream` scans), each session with its own batch-1 cache. The
session axis is the data axis: with a mesh (`omnijax.eval.mesh.make_mesh`) sessions are split over `data` and the
weights replicated or split over `model` (heads, MLP intermediate, vocabulary); XLA's SPMD partitioner partitions
the scan from the input shardings.

What is computed follows what is asked for: with neither `keep_logits`, `score_ids` nor answers
(`max_answer_tokens` 0), no output depends on the model's activations and XLA prunes the model: only the retention
and paging decisions and their statistics are computed, which makes layout-only sweeps cheap.

Sessions are padded to one chunk schedule: every chunk to the longest chunk length, every session to the most
chunks with empty chunks (no valid token, no answer, cursor unchanged), and the session count to a multiple of the
batch size with empty sessions. Padding is cut away again on the host: each `SessionResult` holds only its own
chunks.

    configs = [EvalConfig("full", StreamConfig(max_answer_tokens=8)),
               EvalConfig("omnipick", StreamConfig(policy=OmniPick(), paging="tile_skip", max_answer_tokens=8,
                                                   num_pages=48))]
    results = omnijax.evaluate(model, sessions, configs, mesh=distributed.make_mesh(model=2))
    results["omnipick"].sessions[0].stats["retained_cells"]   # [chunks]
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from tqdm.auto import tqdm

from omnijax.chunks import builders as adapters
from omnijax.chunks import chunk as chunks_lib
from omnijax.chunks.chunk import Chunk
from omnijax.compilation_cache import cached_jit
from omnijax.decoding import folded_keys, seed_of
from omnijax.eval import mesh as distributed
from omnijax.eval.recall_eval import run_recall_sessions
from omnijax.models.decoder import Decoder
from omnijax.models.family import OmniModel
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.recall_session import RecallStats
from omnijax.streaming.session import bind_config, graphdef_config, model_parts
from omnijax.streaming.step import chunk_step, init_state

# Per-chunk statistics reported for every session (each `[chunks]` in `SessionResult.stats`).
STAT_NAMES = ("retained_cells", "physical_span", "active_pages", "active_subblocks", "table_pages", "free_pages",
              "evicted", "moved", "next_pos", "exhausted", "dropped")


@dataclasses.dataclass(frozen=True, init=False)
class EvalConfig:
    """One named configuration: a `StreamConfig` (static: part of its compiled program) and what to return.

    `EvalConfig(name, config, keep_logits=...)`. Unlike `stream`, which refuses a chunk asking for more answer tokens
    than `config.max_answer_tokens`, an evaluation caps each chunk's `answer_tokens` at it (0: no answers at all,
    for layout-only sweeps over the same sessions); `SessionResult.tokens` holds what was generated. The `StreamConfig`
    fields are also accepted as keywords
    (`EvalConfig("omnipick", policy=OmniPick(), paging="tile_skip")` builds the same object) and read as attributes
    (`cfg.policy`, `cfg.num_pages`, ...). `config.num_pages` None sizes each session's pool for the longest session
    without eviction.

    Attributes:
        name: key of its results.
        config: the sessions' settings (`omnijax.StreamConfig`).
        keep_logits: also return each chunk's last-position logits (`[chunks, vocab]` per session).
    """

    name: str
    config: StreamConfig
    keep_logits: bool

    def __init__(self, name: str, config: StreamConfig | None = None, *, keep_logits: bool = False,
                 **fields: Any):
        if not isinstance(name, str) or not name:
            raise ValueError(f"an EvalConfig needs a non-empty name, got {name!r}")
        try:
            config = StreamConfig.of(config, **fields)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name}: {e}") from e
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "keep_logits", bool(keep_logits))

    def __getattr__(self, field: str):
        if field != "config" and field in StreamConfig.__dataclass_fields__:
            return getattr(self.config, field)
        raise AttributeError(f"'EvalConfig' object has no attribute {field!r}")


@dataclasses.dataclass
class SessionResult:
    """One session under one configuration, its padding removed.

    Attributes:
        num_chunks: the session's own chunks (C).
        stats: `STAT_NAMES` -> `[C]` numpy arrays, after each chunk and its answer.
        tokens: `[C, tau]` int32 greedy tokens (-1 = none).
        logits: `[C, V]` float32 last-position logits, or None (`EvalConfig.keep_logits`).
        scores: `[C, K]` float32 log-probabilities of `evaluate(score_ids=...)` at each chunk's last position,
            or None.
        recall: the session's recall figures under a config with `StreamConfig(recall=...)`, else None.
    """

    num_chunks: int
    stats: dict[str, np.ndarray]
    tokens: np.ndarray
    logits: np.ndarray | None = None
    scores: np.ndarray | None = None
    recall: RecallStats | None = None

    def answers(self) -> dict[int, list[int]]:
        """Chunk index -> its generated tokens, for chunks that generated any."""
        out = {}
        for c, row in enumerate(self.tokens):
            ids = [int(t) for t in row if t >= 0]
            if ids:
                out[c] = ids
        return out


@dataclasses.dataclass
class ConfigResult:
    """All sessions under one configuration.

    Attributes:
        config: the configuration.
        sessions: one `SessionResult` per input session, in input order.
        wall_s: seconds running every batch and gathering its results (after compilation).
        compile_s: seconds lowering and compiling the program (once per configuration).
        num_pages: pool pages per session.
        batch_size: sessions per program call.
        mesh_shape: `{"data": ..., "model": ...}` (1 x 1 without a mesh).
    """

    config: EvalConfig
    sessions: list[SessionResult]
    wall_s: float
    compile_s: float
    num_pages: int
    batch_size: int
    mesh_shape: dict[str, int]

    @property
    def chunks_per_s(self) -> float:
        """Session chunks (padding excluded) per second of `wall_s`."""
        return sum(s.num_chunks for s in self.sessions) / max(self.wall_s, 1e-9)


def _session_chunks(session) -> list[Chunk]:
    chunks = adapters.unstack(session)
    if not chunks:
        raise ValueError("a session needs at least one chunk")
    for c in chunks:
        if not isinstance(c, Chunk):
            raise TypeError(f"a session is a stacked Chunk or a sequence of Chunks, got an element {c!r:.80}")
        if np.ndim(c.token_ids) != 2 or np.shape(c.token_ids)[0] != 1:
            raise ValueError(f"sessions are made of batch-1 chunks, got token_ids of shape {np.shape(c.token_ids)}")
    return chunks


def empty_chunk(template: Chunk) -> Chunk:
    """A chunk shaped like `template` with no valid token, no answer and no cursor move (schedule padding)."""
    zeros = lambda x: None if x is None else np.zeros_like(np.asarray(x))  # noqa: E731
    return Chunk(*[zeros(getattr(template, f.name)) for f in dataclasses.fields(Chunk)])


def pad_sessions(sessions: Sequence, *, num_sessions: int | None = None) -> tuple[Chunk, np.ndarray]:
    """Pads sessions to one schedule and stacks them.

    Args:
        sessions: each a stacked batch-1 session (`[C, 1, T]` fields) or a sequence of batch-1 chunks.
        num_sessions: pad the session axis to this many with empty sessions (default: no extra sessions).

    Returns:
        `(chunks, num_chunks)`: every field `[S, C, 1, T, ...]` (positions `[S, C, A, 1, T]`), and each input
        session's own chunk count `[len(sessions)]`.
    """
    per_session = [_session_chunks(s) for s in sessions]
    if not per_session:
        raise ValueError("no sessions to evaluate")
    every = [c for chunks in per_session for c in chunks]
    if len({c.embeds is None for c in every}) != 1:
        raise ValueError("either every chunk of every session carries embeddings or none does (see "
                         "omnijax.models.qwen2_5_omni.layout.with_embeds)")
    length = max(c.length for c in every)
    axes = max(np.shape(c.positions)[0] for c in every)
    num_chunks = max(len(chunks) for chunks in per_session)
    total = len(per_session) if num_sessions is None else num_sessions
    if total < len(per_session):
        raise ValueError(f"num_sessions {total} < {len(per_session)} sessions")

    def norm(c: Chunk) -> Chunk:
        c = chunks_lib.pad_chunk(c, length)
        pos = np.asarray(c.positions)
        return dataclasses.replace(c, positions=np.broadcast_to(pos, (axes,) + pos.shape[1:]).copy())

    filler = empty_chunk(norm(every[0]))
    rows = [[norm(c) for c in chunks] + [filler] * (num_chunks - len(chunks)) for chunks in per_session]
    rows += [[filler] * num_chunks] * (total - len(rows))
    stacked = [jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *row) for row in rows]
    return (jax.tree.map(lambda *xs: np.stack(xs), *stacked),
            np.asarray([len(chunks) for chunks in per_session], np.int64))


def session_pages_needed(chunks: Chunk, tau: int, page_size: int) -> int:
    """Pool pages the most demanding session needs without eviction (`[S, C, 1, T]` chunks)."""
    valid = np.asarray(chunks.valid).sum(axis=(1, 2, 3))  # [S]
    answers = np.minimum(np.asarray(chunks.answer_tokens), tau).sum(axis=(1, 2))
    return max(1, int(np.max(-(-(valid + answers) // page_size))))


_STATIC = ("graphdef", "config", "keep_logits", "mesh")


@cached_jit(static_argnames=_STATIC)
def _run(graphdef, params, chunks, score_ids, *, config: StreamConfig, keep_logits, mesh):
    """`chunks [S, C, 1, T]` -> per-session, per-chunk outputs `[S, C, ...]` (one compiled program per config)."""
    model = nnx.merge(graphdef, params)
    S = chunks.token_ids.shape[0]
    one = init_state(model.config, num_pages=config.num_pages, page_size=config.page_size, batch=1,
                     kv_dtype=config.kv_dtype)
    state = jax.tree.map(lambda x: jnp.broadcast_to(x, (S,) + x.shape), one)
    # session s samples with keys folded from the seed and s
    state = dataclasses.replace(state, key=folded_keys(seed_of(config.decoding), jnp.arange(S))[:, None])
    if mesh is not None:
        specs = distributed.session_state_specs(state, model.config, mesh)
        state = jax.lax.with_sharding_constraint(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))

    def session(state, session_chunks):
        def body(s, chunk):
            # one row per session: none shared; vmapped, so no conditional prefill (it would select the whole cache)
            s, out = chunk_step(model, s, chunk, config, shared_pages=False, skip_empty=False)
            layout = out.stats.layout
            stats = {name: getattr(layout, name, None) for name in STAT_NAMES}
            stats.update(evicted=out.stats.evicted, moved=out.stats.moved, next_pos=out.stats.next_pos)
            row = {"stats": {k: jnp.reshape(v, (-1,))[0] for k, v in stats.items()}, "tokens": out.tokens[0]}
            logits = out.logits[0]  # [V]
            if keep_logits:
                row["logits"] = logits
            if score_ids is not None:
                row["scores"] = jax.nn.log_softmax(logits)[score_ids]
            return s, row

        return jax.lax.scan(body, state, session_chunks)[1]

    return jax.vmap(session)(state, chunks)


def evaluate(model: OmniModel | Decoder, sessions: Sequence, configs: Sequence[EvalConfig], *,
             mesh: Mesh | None = None, batch_size: int | None = None, score_ids: Sequence[int] | None = None,
             progress: bool = True) -> dict[str, ConfigResult]:
    """Runs every session under every configuration; results are gathered to the host.

    Args:
        model: an `omnijax.Model` or a `Decoder`.
        sessions: each a stacked batch-1 session (`[C, 1, T]`) or a list of batch-1 chunks (see `pad_sessions`).
        configs: `EvalConfig`s with distinct names.
        mesh: a `(data, model)` mesh (`omnijax.eval.mesh.make_mesh`); None runs on the default device.
        batch_size: sessions per program call, a multiple of the data axis; default the data axis size times 4
            (at most the session count rounded up to the data axis).
        score_ids: token ids whose log-probabilities at each chunk's last position are returned
            (`SessionResult.scores`), e.g. the option letters of a multiple-choice question.
        progress: draw a tqdm bar over session batches (process 0 only).

    A config with `StreamConfig(recall=Recall(...))` runs its sessions one at a time, each through its own
    `omnijax.Session` (`omnijax.eval.recall_eval`: recall is host work between steps), on the default device: a
    mesh is refused with it, `batch_size` does not apply to it (its `ConfigResult.batch_size` is 1), its
    `compile_s` is 0 (the steps compile inside `wall_s`), and each `SessionResult.recall` holds the figures.

    Returns:
        Config name -> `ConfigResult`, in the order of `configs`.
    """
    configs = list(configs)
    if not configs:
        raise ValueError("no configurations to evaluate")
    recalling = [c.name for c in configs if c.config.recall is not None]
    if recalling and mesh is not None:
        raise ValueError(f"config(s) {recalling}: StreamConfig(recall=...) runs each session through a batch-1 "
                         f"omnijax.Session on the default device; give mesh=None or recall=None")
    if len({c.name for c in configs}) != len(configs):
        raise ValueError(f"config names must be distinct, got {[c.name for c in configs]}")
    graphdef, params = model_parts(model)
    config = graphdef_config(model)
    data = distributed.axis_size(mesh, distributed.DATA)
    count = len(sessions)
    if not count:
        raise ValueError("no sessions to evaluate")
    if batch_size is None:
        batch_size = min(4 * data, -(-count // data) * data)
    if batch_size < 1 or batch_size % data:
        raise ValueError(f"batch_size {batch_size} must be a positive multiple of the data axis ({data})")
    num_batches = -(-count // batch_size)
    chunks, own = pad_sessions(sessions, num_sessions=num_batches * batch_size)
    tau_max = int(np.asarray(chunks.answer_tokens).max(initial=0))
    for s in range(count):
        session = jax.tree.map(lambda x: x[s], chunks)
        try:
            chunks_lib.validate(session, config, max_answer_tokens=tau_max, stacked=True)
        except ValueError as e:
            raise ValueError(f"session {s}: {e}") from e
    for c in configs:  # each config decodes every session
        if chunks.sampling is not None and not getattr(c.config.decoding, "per_row", False):
            raise ValueError(f"config {c.name!r}: the sessions carry per-row sampling settings but it decodes with "
                             f"{c.config.decoding!r}, which would ignore them; use omnijax.decoding.RowSampling()")
    ids = None if score_ids is None else np.asarray(score_ids, np.int32)
    if ids is not None and (ids.ndim != 1 or ids.min(initial=0) < 0 or ids.max(initial=0) >= config.vocab_size):
        raise ValueError(f"score_ids must be a list of ids in [0, {config.vocab_size}), got {score_ids}")
    if mesh is not None:
        params = distributed.put(params, mesh, distributed.decoder_param_specs(params, config, mesh))
        ids = None if ids is None else distributed.put(ids, mesh, jax.sharding.PartitionSpec())
    shape = {distributed.DATA: data, distributed.MODEL: distributed.axis_size(mesh, distributed.MODEL)}

    def batch(b):
        part = jax.tree.map(lambda x: x[b * batch_size:(b + 1) * batch_size], chunks)
        return distributed.put_sessions(part, mesh) if mesh is not None else jax.tree.map(jnp.asarray, part)

    bar = None
    if progress and distributed.is_main_process():
        bar = tqdm(total=len(configs) * num_batches, unit="batch", desc="evaluate")
    results = {}
    for cfg in configs:
        stream_config = bind_config(model, cfg.config, allow_recall=True)
        num_pages = stream_config.num_pages or session_pages_needed(
            chunks, stream_config.max_answer_tokens, stream_config.page_size) + stream_config.paging.extra_pages
        if stream_config.recall is not None:
            results[cfg.name] = _recall_result(model, cfg, stream_config.replace(num_pages=num_pages), chunks, own,
                                               ids, count, shape)
            if bar is not None:
                bar.update(num_batches)
            continue
        static = dict(config=stream_config.replace(num_pages=num_pages), keep_logits=cfg.keep_logits, mesh=mesh)
        if bar is not None:
            bar.set_description(f"evaluate {cfg.name}")
        start = time.perf_counter()
        first = batch(0)
        compiled = _run.executable(graphdef, params, first, ids, **static)  # kept on disk when it can be
        compile_s = time.perf_counter() - start
        outs, pending, start = [], None, time.perf_counter()
        for b in range(num_batches):
            out = compiled(params, first if b == 0 else batch(b), ids)  # dispatched asynchronously
            if pending is not None:  # gather the previous batch while this one runs
                outs.append(distributed.to_host(pending))
                if bar is not None:
                    bar.update(1)
            pending = out
        outs.append(distributed.to_host(pending))
        if bar is not None:
            bar.update(1)
        wall_s = time.perf_counter() - start
        merged = jax.tree.map(lambda *xs: np.concatenate(xs), *outs)
        _warn_exhausted(cfg.name, merged, own, count, stacklevel=3)
        results[cfg.name] = ConfigResult(
            config=cfg, sessions=[_session_result(merged, s, int(own[s])) for s in range(count)], wall_s=wall_s,
            compile_s=compile_s, num_pages=num_pages, batch_size=batch_size, mesh_shape=shape)
    if bar is not None:
        bar.close()
    return results


def _recall_result(model, cfg: EvalConfig, stream_config: StreamConfig, chunks: Chunk, own: np.ndarray,
                   ids: np.ndarray | None, count: int, shape: dict[str, int]) -> ConfigResult:
    """One config with recall, its sessions one at a time (`omnijax.eval.recall_eval`)."""
    start = time.perf_counter()
    merged, figures = run_recall_sessions(model, chunks, own[:count], stream_config, keep_logits=cfg.keep_logits,
                                          score_ids=ids, stat_names=STAT_NAMES)
    wall_s = time.perf_counter() - start
    _warn_exhausted(cfg.name, merged, own, count, stacklevel=4)
    return ConfigResult(config=cfg, sessions=[dataclasses.replace(_session_result(merged, s, int(own[s])),
                                                                  recall=figures[s]) for s in range(count)],
                        wall_s=wall_s, compile_s=0.0, num_pages=stream_config.num_pages, batch_size=1,
                        mesh_shape=shape)


def _warn_exhausted(name: str, merged: dict, own: np.ndarray, count: int, *, stacklevel: int) -> None:
    exhausted = [s for s in range(count) if merged["stats"]["exhausted"][s, :int(own[s])].any()]
    if exhausted:
        warnings.warn(f"{name}: the KV pool ran out in session(s) {exhausted} (their tokens past that point "
                      f"were not cached; see stats['exhausted'] and stats['dropped']); give a larger num_pages "
                      f"or a bounded policy", RuntimeWarning, stacklevel=stacklevel)


def _session_result(merged: dict, s: int, num_chunks: int) -> SessionResult:
    cut = lambda x: None if x is None else x[s, :num_chunks]  # noqa: E731
    return SessionResult(num_chunks=num_chunks, stats={k: cut(v) for k, v in merged["stats"].items()},
                         tokens=cut(merged["tokens"]), logits=cut(merged.get("logits")),
                         scores=cut(merged.get("scores")))


__all__ = ["ConfigResult", "EvalConfig", "STAT_NAMES", "SessionResult", "empty_chunk", "evaluate", "pad_sessions"]
