"""The recall tests' shared setup (issue 40): one tiny decoder, one pool, one chunk length and one answer length.

Every distinct (program, static settings, shapes) is an XLA compile of its own. Chunks of 5, 6, 8 and 10 tokens
compiled a session step, a question forward and a capture per length and per policy; padded to `T` they share one,
and the modules that use these settings share their programs through the persistent compilation cache (compiled by
the first module a worker runs, loaded by the others).
"""

from __future__ import annotations

import functools

import numpy as np

import omnijax
from omnijax.chunks.chunk import Chunk, pad_chunk, text_chunk
from omnijax.kv import host_tier, host_tier_scoring
from omnijax.models.config import TINY_OMNI
from omnijax.retention.recall import rerotate

PAGES, PAGE = 16, 8  # a session's pool: 128 cells
T = 10  # every chunk's token axis (padding tokens are invalid: nothing is written for them)
TAU = 4  # max_answer_tokens
SIZES = (8, 8, 8, 8, 6, 10)  # the context chunks' tokens (unit 2i each): 48 in all
ROPE = (10000.0, None, False)  # the tiny decoder's rope as the host tier's scoring takes it (theta, sections, ...)


@functools.cache
def decoder() -> omnijax.Decoder:
    """The tiny decoder every recall module streams (built once per process; no test writes to it)."""
    return omnijax.Decoder(TINY_OMNI)


def context(seed: int = 0, units: int = 0) -> list[Chunk]:
    """Six text chunks of `SIZES` random tokens (units `units + 2 i`), each padded to `T`."""
    rng = np.random.default_rng(seed)
    return [text_chunk(rng.integers(3, 290, n), length=T, unit=units + 2 * i) for i, n in enumerate(SIZES)]


def question(seed: int, unit: int = 100, answer: int = 3) -> Chunk:
    """Five random tokens (unit `unit`) asking for `answer` tokens, padded to `T`."""
    return text_chunk(np.random.default_rng(seed).integers(3, 290, 5), length=T, unit=unit, answer_tokens=answer)


def padded(chunks: list[Chunk]) -> list[Chunk]:
    """`chunks` padded to the longest one's length: one program per session step instead of one per length."""
    longest = max(c.length for c in chunks)
    return [pad_chunk(c, longest) for c in chunks]


def by_order(kv) -> dict:
    """{write order: (k [L, G, d], v, pos [A], unit, span, offset)} of the live slots of a batch-1 cache (int8
    pages dequantised)."""
    import jax

    from omnijax.kv.quant_kv import dense
    h = jax.device_get({"k": dense(kv.k), "v": dense(kv.v), **{f: getattr(kv, f) for f in (
        "pos", "unit", "span", "offset", "order", "valid")}})
    out = {}
    for p, s in zip(*np.nonzero(h["valid"])):
        out[int(h["order"][p, s])] = (h["k"][:, p, s], h["v"][:, p, s], h["pos"][:, p, s], int(h["unit"][p, s]),
                                      int(h["span"][p, s]), int(h["offset"][p, s]))
    return out


def random_tier(rng: np.random.Generator, runs, L: int = 2, G: int = 2, d: int = 8) -> host_tier.HostTier:
    """A tier of records cut from runs of consecutive write orders (each run `(first order, sizes)`), stored in a
    shuffled order, keys rotated at positions equal to their orders."""
    records = []
    for first, sizes in runs:
        for n in sizes:
            orders = np.arange(first, first + n)
            raw = rng.normal(size=(L, G, n, d)).astype(np.float32)
            pos = orders[None].astype(np.int32)
            k = np.asarray(rerotate(raw, np.zeros_like(pos), pos, theta=ROPE[0], mrope_section=None))
            records.append(host_tier.make_unit(len(records), k, raw, pos, np.zeros(n), np.zeros(n), orders))
            first += n
    order = rng.permutation(len(records))
    return host_tier.HostTier(budget_bytes=1 << 24, units=tuple(records[i] for i in order))


def window_members_reference(tier: host_tier.HostTier, window: int) -> list[list[int]]:
    """`host_tier_scoring.window_members` as a plain walk: from each record, follow the record whose first write
    order is one past the last one's."""
    out = []
    for u in tier.units:
        members, last = [tier.units.index(u)], int(u.order[-1])
        while len(members) < window:
            nxt = [j for j, v in enumerate(tier.units) if int(v.order[0]) == last + 1]
            if not nxt:
                break
            members.append(nxt[0])
            last = int(tier.units[nxt[0]].order[-1])
        out.append(members)
    return out


def question_queries(session: omnijax.Session, question: Chunk) -> np.ndarray:
    """The question's queries `[L, T', Hq, d]` over its valid tokens, before RoPE, as the session's recall scores
    them (the oracles' input; computed from `session`'s state, which they do not change)."""
    rs = session._recall
    next_pos = int(np.asarray(session.state.next_pos)[0])
    _, q = rs.queries(session.state, session._graphdef, session._params, question)
    valid = np.asarray(question.valid)[0]
    q = np.asarray(q)[:, valid]
    pos = np.asarray(question.positions)[:, 0][:, valid] + next_pos
    return np.swapaxes(host_tier_scoring.unrotated(np.swapaxes(q, 1, 2), pos, rs.rope), 1, 2)
