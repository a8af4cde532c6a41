"""Scoring the units a `HostTier` stores against a question's queries, and selecting the ones to recall within a
budget of cells: `score_units` ("max" / "mean" over the per-unit summaries), `score_units_mass` (every stored key,
the attention mass each unit would get), `score_units_peak` (the strongest preference any one head shows for a
unit), and `select_units`; each with its plain-Python `*_reference`.

The store itself is `omnijax.kv.host_tier`.
"""

from __future__ import annotations

import jax
import numpy as np

from omnijax.kept_executables import cached_jit
from omnijax.kv import rope as rope_lib
from omnijax.kv.host_tier import HostTier


def _check_query(query: np.ndarray, summaries: np.ndarray) -> np.ndarray:
    query = np.asarray(query, np.float32)
    L, G, d = summaries.shape[1:]
    if query.ndim == 2:
        query = np.broadcast_to(query, (L,) + query.shape)
    if query.ndim != 3 or query.shape[0] != L or query.shape[2] != d or query.shape[1] % G:
        raise ValueError(f"query must be [L={L}, Hq, d={d}] or [Hq, d] with Hq a multiple of kv heads G={G}, "
                         f"got {query.shape}")
    return query


SCORINGS = ("max", "mean")


def score_units(tier: HostTier, query: np.ndarray, scoring: str = "mean") -> np.ndarray:
    """`[U]` float32 relevance of each stored unit to a question.

    With h's logit over key t of unit u `a[u, l, h, t] = query[l, h] . k[u, l, h // (Hq / G), t] / sqrt(d)`
    (grouped-query: head h reads kv head h // (Hq / G)):

        "mean": the mean over l, h and t of a, i.e. the question's mean attention logit over the unit's keys, read from
            the summaries alone (`L * G * d` floats per unit, one einsum for all units).
        "max": the mean over l and h of the max over t of a: how strongly the unit's most salient token draws each
            head. It reads every stored key (one einsum per unit, `L * Hq * n * d` multiply-adds), and finds a single
            salient sentence the mean dilutes: on SmolLM2's multi-turn pass key (SinkWindow 256 cells, 29 stored
            pieces) "max" ranked the key's unit first where "mean" ranked it eighth, behind recent filler.

    Args:
        tier: the host tier (U >= 0 units).
        query: `[L, Hq, d]` the question's (rotated) queries averaged over its tokens, or `[Hq, d]` used at every
            layer.
        scoring: one of `SCORINGS`.
    """
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if not tier.units:
        return np.zeros((0,), np.float32)
    summaries = np.stack([u.summary for u in tier.units])  # [U, L, G, d]
    query = _check_query(query, summaries)
    L, Hq, d = query.shape
    G = summaries.shape[2]
    grouped = query.reshape(L, G, Hq // G, d)
    if scoring == "mean":
        logits = np.einsum("lgrd,ulgd->u", grouped, summaries, dtype=np.float64)
        return (logits / (L * Hq * np.sqrt(d))).astype(np.float32)
    best = [np.einsum("lgrd,lgnd->lgrn", grouped, u.k.astype(np.float32), dtype=np.float64).max(axis=-1).sum()
            for u in tier.units]
    return (np.asarray(best) / (L * Hq * np.sqrt(d))).astype(np.float32)


MASS_BATCH_TOKENS = 4096
"""Stored tokens `score_units_mass` scores per matmul (its float32 logits take `L * Hq * T * 4` bytes per token)."""
RECALL_SCORINGS = SCORINGS + ("mass", "peak", "two_stage")
"""What `omnijax.retention.recall.Recall(scoring=...)` takes: `score_units`' two, `score_units_mass`,
`score_units_peak` and `omnijax.kv.host_tier_two_stage.score_units_two_stage`."""


@cached_jit(static_argnames=("rope",))
def _unrotate(k: jax.Array, pos: jax.Array, *, rope: tuple) -> jax.Array:
    theta, section, interleaved = rope
    return rope_lib.apply_rope(k, rope_lib.rope_angles(-pos, k.shape[-1], theta, section, interleaved))


def _bucket(n: int) -> int:
    """The padded token count a RoPE undo of `n` tokens runs at (a power of two, at least 16): one compiled
    program per bucket, where eager operations compiled a dozen programs for every new count of tokens (every
    question, as the tier and the questions' lengths change)."""
    return max(16, 1 << max(0, n - 1).bit_length())


def unrotated(k: np.ndarray, pos: np.ndarray, rope: tuple) -> np.ndarray:
    """`[L, G, n, d]` float32 keys before RoPE: `k` (rotated at `pos [A, n]`) turned back by `-pos`.

    Args:
        rope: `(theta, mrope_section, interleaved)` of the model.
    """
    L, G, n, d = k.shape
    padded = np.zeros((L, _bucket(n), G, d), np.float32)  # [L, n', G, d], tokens past n are zeros at position 0
    padded[:, :n] = np.swapaxes(np.asarray(k, np.float32), 1, 2)
    at = np.zeros((np.shape(pos)[0], padded.shape[1]), np.int32)
    at[:, :n] = np.asarray(pos, np.int32)
    theta, section, interleaved = rope
    out = _unrotate(padded, at, rope=(theta, None if section is None else tuple(section), bool(interleaved)))
    return np.swapaxes(np.asarray(out)[:, :n], 1, 2)


def _check_queries(tier: HostTier, queries: np.ndarray) -> np.ndarray:
    queries = np.asarray(queries, np.float32)
    L, G, _, d = tier.units[0].k.shape
    if queries.ndim != 4 or queries.shape[0] != L or queries.shape[3] != d or queries.shape[2] % G or \
            queries.shape[1] < 1:
        raise ValueError(f"queries must be [L={L}, T>=1, Hq, d={d}] with Hq a multiple of kv heads G={G}, got "
                         f"{queries.shape}")
    return queries


def unit_log_mass(tier: HostTier, queries: np.ndarray, rope: tuple) -> np.ndarray:
    """`[L * Hq * T, U]` float64: for each query row (layer, query head, question token) the log of the unnormalised
    attention mass each stored unit would draw, `log sum_i exp(a[u, l, h, t, i])` (the logits of
    `score_units_mass`), queries and keys before RoPE. Rows are ordered (layer, kv head, head within it, token).

    Args:
        tier: the host tier (U >= 1 units).
        queries: `[L, T, Hq, d]` the question's queries before RoPE, its T valid tokens.
        rope: `(theta, mrope_section, interleaved)` of the model (to turn the stored keys back).
    """
    queries = _check_queries(tier, queries)
    L, T, Hq, d = queries.shape
    G = tier.units[0].k.shape[1]
    r = Hq // G
    # [L, G, r*T, d]: each kv head's query rows (its r query heads x T tokens), scaled by 1 / sqrt(d)
    grouped = np.ascontiguousarray(queries.reshape(L, T, G, r, d).transpose(0, 2, 3, 1, 4).reshape(L, G, r * T, d))
    grouped /= np.float32(np.sqrt(d))
    out = np.zeros((L * G * r * T, len(tier.units)), np.float64)
    # Units in batches of about MASS_BATCH_TOKENS tokens: one RoPE undo and one BLAS matmul per batch (the logits
    # [L, G, r*T, tokens] float32 bound the memory), then a log-sum-exp per unit over its segment of the batch.
    batch: list[int] = []
    for i in range(len(tier.units)):
        batch.append(i)
        if sum(tier.units[j].size for j in batch) >= MASS_BATCH_TOKENS or i == len(tier.units) - 1:
            units = [tier.units[j] for j in batch]
            keys = unrotated(np.concatenate([v.k for v in units], axis=2),
                             np.concatenate([v.pos for v in units], axis=1), rope)  # [L, G, n, d]
            a = np.matmul(grouped, np.swapaxes(keys, 2, 3))  # [L, G, r*T, n]
            starts = np.cumsum([0] + [v.size for v in units[:-1]])
            top = np.maximum.reduceat(a, starts, axis=-1)  # [L, G, r*T, units]
            sizes = np.asarray([v.size for v in units])
            mass = np.add.reduceat(np.exp(a - np.repeat(top, sizes, axis=-1)), starts, axis=-1)
            out[:, batch] = (np.log(mass.astype(np.float64)) + top).reshape(-1, len(units))
            batch = []
    return out


def window_members(tier: HostTier, window: int) -> list[np.ndarray]:
    """Per stored record i, the records of the recall window that starts at it: i and the records that follow it
    token by token (a record whose first write order is one past the previous one's last), at most `window` in
    all, fewer where such a run ends. With `window=1` every record is its own window.

    Why: with `Recall(block=B)` the write-order grid can cut a sentence in two, and the half the question scores
    lower stays in the tier (SmolLM2's pass key, RESULTS.md). A window of two B-token blocks is a 2B-token record
    at a B-token stride, so every sentence of at most B + 1 tokens lies whole in one window.

    Args:
        tier: the host tier.
        window: most records per window (> 0).
    """
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    first = {int(u.order[0]): i for i, u in enumerate(tier.units)}
    following = [first.get(int(u.order[-1]) + 1, -1) for u in tier.units]
    out = []
    for i in range(len(tier.units)):
        members = [i]
        while len(members) < window and following[members[-1]] >= 0 and following[members[-1]] not in members:
            members.append(following[members[-1]])
        out.append(np.asarray(members, np.int64))
    return out


def window_log_mass(lse: np.ndarray, members: list[np.ndarray]) -> np.ndarray:
    """`[R, U]` log attention mass of each window (`window_members`) from the records' `[R, U]` (`unit_log_mass`):
    masses add, so a window's is the log-sum-exp of its records' (what scoring the window's tokens as one record
    gives)."""
    return np.stack([np.logaddexp.reduce(lse[:, m], axis=1) for m in members], axis=1) if members else lse


def score_units_mass(tier: HostTier, queries: np.ndarray, rope: tuple, window: int = 1) -> np.ndarray:
    """`[U]` float32: the attention mass each stored unit would draw from a question, position-free.

    With `a[u, l, h, t, i] = q[l, t, h] . key[u, l, h // (Hq / G), i] / sqrt(d)` over the question's tokens t and the
    unit's tokens i, queries and keys both taken before RoPE, the score is the mean over l, h and t of
    `log sum_i exp(a)`: the log of the unnormalised attention mass the unit would receive (`unit_log_mass`). Before
    RoPE, because a stored unit's distance to the question is not the one it will have once recalled (re-indexing
    policies re-lay it), and RoPE's relative term favours whatever was evicted last: on SmolLM2's multi-turn pass key
    under OmniPick (35 stored pieces of identical filler turns and the key's turn) "max" ranked the key's piece 11th,
    "max" on the mean query 15th, this score first. The log-sum-exp grows with a unit's size (as the mass it would
    draw does). Averaged over every head, a unit most heads read a little outranks one a few heads read strongly
    (`score_units_peak` ranks by those).

    Args:
        tier: the host tier.
        queries: `[L, T, Hq, d]` the question's queries before RoPE, its T valid tokens.
        rope: `(theta, mrope_section, interleaved)` of the model (to turn the stored keys back).
        window: score the window of records starting at each record (`window_members`) instead of the record.
    """
    if not tier.units:
        return np.zeros((0,), np.float32)
    lse = window_log_mass(unit_log_mass(tier, queries, rope), window_members(tier, window))
    return lse.mean(axis=0).astype(np.float32)


def score_units_peak(tier: HostTier, queries: np.ndarray, rope: tuple, window: int = 1) -> np.ndarray:
    """`[U]` float32: the strongest preference any one head shows for each stored unit over the average stored unit
    (position-free, as `score_units_mass`).

    With `m[l, h, t, u]` the log attention mass of `unit_log_mass` (query row: layer l, query head h, question token
    t), each row is centred over the units (`m - mean_u m`: how much more than the average unit the row reads u, in
    log mass), averaged over the question's tokens, and the score is its maximum over layers and heads.

    Why not the mean over heads ("mass"): a few heads read a pass key's sentence strongly (retrieval heads), while
    most heads read the tokens right after the stream's first ones (the system prompt, a document's opening: the
    model's secondary attention sinks) a little more than anything else. Averaged over every head, those openings
    outrank the sentence the question is about. Measured on SmolLM2's single-prompt pass key (1K tokens, key at
    depth 0.7, SinkWindow / StreamingLLM / OmniPick at 128 cells, stored records cut into 16-64-token blocks and
    whole units): "mass", the mean attention share and the largest share over heads ranked the key's block 2nd-8th
    behind the openings; this score ranked it 1st in all twelve cases.

    Args:
        tier: the host tier.
        queries: `[L, T, Hq, d]` the question's queries before RoPE, its T valid tokens.
        rope: `(theta, mrope_section, interleaved)` of the model.
        window: score the window of records starting at each record (`window_members`), centred over the windows.
    """
    if not tier.units:
        return np.zeros((0,), np.float32)
    lse = unit_log_mass(tier, queries, rope)  # [L * Hq * T, U], rows (layer, kv head, head within it, token)
    lse = window_log_mass(lse, window_members(tier, window))
    T = np.shape(queries)[1]
    lift = (lse - lse.mean(axis=1, keepdims=True)).reshape(-1, T, lse.shape[1]).mean(axis=1)  # [L * Hq, U]
    return lift.max(axis=0).astype(np.float32)


def _window_score(rows: np.ndarray, T: int, base: np.ndarray | None) -> float:
    """One window's score from its log masses `rows [L * Hq * T]`: "peak" (`base` the mean over windows per row:
    the largest per-head lift, averaged over the question's tokens) or "mass" (`base` None: the mean)."""
    if base is None:
        return float(rows.mean())
    return float((rows - base).reshape(-1, T).mean(axis=1).max())


def rank_windows_marginal(lse: np.ndarray, members: list[np.ndarray], T: int, scoring: str) -> np.ndarray:
    """`[U]` float64 scores that rank windows by what each adds: a greedy walk takes, round by round, the window
    whose records not yet taken score best ("peak" centred against every whole window's mean, as
    `score_units_peak`; "mass" their mean log mass, as `score_units_mass`), and gives it that score. A window
    whose every record a better one took first scores -inf (it would add nothing).

    `select_windows` over these scores recalls what the greedy walk takes, in its order, until the budget stops
    it: the picked scores never rise (a window's untaken records only shrink), so the walk's order is the score
    order. Why: a window overlapping one already taken otherwise keeps the score of its better half. Measured on
    SmolLM2's 2K multi-turn pass key (`Recall.preset()`, OmniPick and SinkWindow, three keys each): by whole
    windows, the first turn's opening `[32, 64)` ranked 1st and `[48, 80)` 2nd on the strength of their shared
    `[48, 64)`, so the second added 16 cells holding one key token, the acknowledgement came 3rd and the 64-cell
    budget was spent before `[80, 96)` (the number); ranked by what they add, `[80, 96)` comes back (16 of the key
    sentence's 25 tokens, the number among them) in all six.

    Args:
        lse: `[L * Hq * T, U]` the records' log masses (`unit_log_mass`), rows (layer, kv head, head, token).
        members: per record, the window starting at it (`window_members`).
        T: the question's tokens.
        scoring: "peak" or "mass".
    """
    if scoring not in ("peak", "mass"):
        raise ValueError(f"scoring must be 'peak' or 'mass', got {scoring!r}")
    W = len(members)
    base = window_log_mass(lse, members).mean(axis=1) if scoring == "peak" and W else None
    holders: list[list[int]] = [[] for _ in range(lse.shape[1])]  # record -> windows holding it
    for i, m in enumerate(members):
        for j in m:
            holders[int(j)].append(i)
    taken = np.zeros(lse.shape[1], bool)
    current = np.asarray([_window_score(np.logaddexp.reduce(lse[:, m], axis=1), T, base) for m in members])
    out = np.full(W, -np.inf)
    open_ = np.ones(W, bool)
    while open_.any():
        # best open window, ties to the lower index (as select_windows walks them)
        i = int(np.flatnonzero(open_)[np.argmax(current[open_])])
        out[i], open_[i] = current[i], False
        new = [int(j) for j in members[i] if not taken[j]]
        taken[new] = True
        for w in {w for j in new for w in holders[j]}:
            if not open_[w]:
                continue
            left = [int(j) for j in members[w] if not taken[j]]
            if left:
                current[w] = _window_score(np.logaddexp.reduce(lse[:, left], axis=1), T, base)
            else:
                open_[w] = False  # adds nothing: -inf
    return out


def score_windows_marginal(tier: HostTier, queries: np.ndarray, rope: tuple, window: int,
                           scoring: str = "peak") -> np.ndarray:
    """`[U]` float32: `rank_windows_marginal` of the question's `queries [L, T, Hq, d]` (before RoPE) over the
    windows of `window` records (`window_members`) of `tier`: what `Recall(window=W)` ranks by with "peak" or
    "mass" scoring. The best window's score is `score_units_peak`'s (`score_units_mass`'s) best."""
    if not tier.units:
        return np.zeros((0,), np.float32)
    lse = unit_log_mass(tier, queries, rope)
    return rank_windows_marginal(lse, window_members(tier, window), np.shape(queries)[1], scoring).astype(np.float32)


def score_units_reference(tier: HostTier, query: np.ndarray, scoring: str = "mean") -> np.ndarray:
    """`score_units` token by token, in plain Python loops."""
    out = []
    for u in tier.units:
        L, G, n, d = u.k.shape
        q = _check_query(query, u.summary[None])
        Hq = q.shape[1]
        total = 0.0
        for layer in range(L):
            for h in range(Hq):
                g = h // (Hq // G)
                logits = [float(np.dot(q[layer, h].astype(np.float64), u.k[layer, g, t].astype(np.float64)))
                          for t in range(n)]
                total += max(logits) if scoring == "max" else sum(logits) / n
        out.append(total / (L * Hq * np.sqrt(d)))
    return np.asarray(out, np.float32)


def _check_select(scores: np.ndarray, sizes: np.ndarray, recall_budget_cells: int, top_units: int):
    scores, sizes = np.asarray(scores), np.asarray(sizes)
    if scores.ndim != 1 or scores.shape != sizes.shape:
        raise ValueError(f"scores and sizes must both be [U], got {scores.shape} and {sizes.shape}")
    for name, value in (("recall_budget_cells", recall_budget_cells), ("top_units", top_units)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if np.any(sizes < 1):
        raise ValueError(f"sizes must be >= 1 cell each, got {sizes.tolist()}")
    if np.any(np.isnan(scores)):
        raise ValueError("scores must not hold NaN")
    return scores, sizes


def select_units(scores: np.ndarray, sizes: np.ndarray, recall_budget_cells: int, top_units: int) -> np.ndarray:
    """Indices of the units to recall, ascending (storage order, oldest first).

    Units are ranked by score, highest first, ties to the lower index (the older unit); the selection is the longest
    prefix of that ranking with at most `top_units` units and at most `recall_budget_cells` cells in all. The ranking
    is honoured strictly: a unit that does not fit stops the selection, so a less relevant unit is never recalled
    while a more relevant one is left out.

    Args:
        scores: `[U]` from `score_units`.
        sizes: `[U]` cells per unit (`HostTier.sizes`).
        recall_budget_cells: most cells recalled.
        top_units: most units recalled.
    """
    scores, sizes = _check_select(scores, sizes, recall_budget_cells, top_units)
    rank = np.lexsort((np.arange(scores.size), -scores.astype(np.float64)))
    cells = np.cumsum(sizes[rank])
    fits = (cells <= recall_budget_cells) & (np.arange(scores.size) < top_units)
    count = int(np.argmin(fits)) if not fits.all() else scores.size
    return np.sort(rank[:count])


def select_units_reference(scores: np.ndarray, sizes: np.ndarray, recall_budget_cells: int,
                           top_units: int) -> np.ndarray:
    """`select_units` read plainly: walk units best first, stop at the first that breaks a limit."""
    scores, sizes = _check_select(scores, sizes, recall_budget_cells, top_units)
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    taken, cells = [], 0
    for i in order:
        if len(taken) == top_units or cells + int(sizes[i]) > recall_budget_cells:
            break
        taken.append(i)
        cells += int(sizes[i])
    return np.asarray(sorted(taken), np.int64)


def select_windows(scores: np.ndarray, sizes: np.ndarray, members: list[np.ndarray], recall_budget_cells: int,
                   top_units: int) -> np.ndarray:
    """Indices of the records to recall, ascending: windows (`window_members`; `scores[i]` is the score of the
    window starting at record i) are walked best first, ties to the lower index, and each adds its records not
    taken yet, in write order, while they fit within `recall_budget_cells` cells and `top_units` records; the walk
    stops at the first window not taken whole (the ranking honoured strictly, as `select_units`: nothing of a
    lower window comes back while part of a higher one is left out). With one-record windows this is
    `select_units`.

    Why a window's first records are taken when the whole does not fit: the budget is then filled by the best
    window left. Measured on SmolLM2's single-prompt pass key (SinkWindow, 128 cells, `Recall(budget=64, block=16,
    window=2)`, key at depth 0.4): the two best windows (the key sentence's, 48 cells) alone answered wrong; with
    the first 16 of the third (the instruction at the prompt's start) the answer was right."""
    scores, sizes = _check_select(scores, sizes, recall_budget_cells, top_units)
    if len(members) != scores.size:
        raise ValueError(f"members must hold one window per record ({scores.size}), got {len(members)}")
    taken = np.zeros(scores.size, bool)
    cells = 0
    for i in np.lexsort((np.arange(scores.size), -scores.astype(np.float64))):
        new = [int(j) for j in members[i] if not taken[j]]
        for j in new:
            if taken.sum() + 1 > top_units or cells + int(sizes[j]) > recall_budget_cells:
                return np.flatnonzero(taken)
            taken[j] = True
            cells += int(sizes[j])
    return np.flatnonzero(taken)
