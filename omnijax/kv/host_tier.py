"""A host-memory tier for evicted units, and the question-time scoring and selection of what to recall (issue 40).

What a retention step evicts from the device cache is gathered per unit (`gather_units`) into `UnitKV` records that
live in host memory as numpy arrays, and kept in a bounded `HostTier`. A per-unit summary (`summarize`) is kept
beside each record; at question time `host_tier_scoring.score_units` ranks the stored units against the question's
queries and `select_units` takes the best ones within a recall budget of cells. Putting a unit back into the cache at
positions consistent with the current indexing (re-rotating its keys) is `omnijax.retention.recall`.

Shapes (L layers, G kv heads, n tokens of a unit, d head dim, A position axes, U stored units, Hq query heads):

    UnitKV.k, .v      [L, G, n, d]   keys (rotated at `pos`) and values, in write order
    UnitKV.pos        [A, n] int32   logical positions the keys are rotated at
    UnitKV.span       [n] int8       span kinds; .offset [n] int32 offsets within the span; .order [n] write order
    UnitKV.summary    [L, G, d] float32 mean key per layer and kv head
    UnitKV.vpos       [n] int64      full-context position (axis 0) of each token, or None when unknown

Summary choice: the mean key per layer and kv head. A query's dot product with it is exactly the mean over the
unit's tokens of the query's attention logit (the dot product is linear), so the score is "how much, on average,
this question attends to the unit", at `L * G * d` floats per unit (1/n of its keys) and one einsum for all units.
The mean dilutes a single salient sentence, though: `score_units(..., "max")` reads every stored key instead (each
head's strongest logit over the unit's tokens; measured in `score_units`), and so do the scores `Recall` ranks by:
`score_units_mass` (its default, the attention mass a unit would draw, before RoPE) and `score_units_peak`
(`Recall.preset`'s, the strongest preference one head shows for a unit), both in `host_tier_scoring`. The summaries
serve "mean" and the shortlist of "two_stage" (`omnijax.kv.host_tier_two_stage`), which read no key.

Immutability: `HostTier` is a frozen dataclass holding a tuple of `UnitKV`. `add` returns a new tier with a new tuple;
the big arrays are shared between the old and the new tier, never copied, and are marked read-only when a record is
made, so sharing them is safe. A mutable store would save nothing (no array is copied either way) and lose snapshots
for free.

int8 pools (`StreamConfig(kv_dtype="int8")`, `omnijax.kv.quant_kv`): a record holds the evicted keys and values
dequantised (`q * scale`, in the model's dtype), not the codes and scales. Scoring, block cuts, disk spill and
snapshots then read one kind of record whatever the pool, and recall writes them back through the pool's own
quantising write: with a float32 model a token recalled at its own positions gets back exactly the codes it had
(requantising `q * s` finds the same absmax, so the same scale up to rounding, and `q * s / s` rounds back to `q`);
a re-rotated key is requantised with a fresh scale, as re-indexing requantises the keys it turns. The cost is host
bytes: a record holds `d` values of the model's dtype per token and head where the pool held `d + 4` bytes (about
3.9x the device bytes for float32, 1.9x for bfloat16).

Bounding: `budget_bytes` caps the bytes of all stored records (`UnitKV.nbytes`). When an added unit does not fit, the
oldest stored units are dropped first until it does; every drop is listed in the returned `TierReport` and counted
in the tier's running totals. A unit larger than the whole budget is refused with a ValueError naming it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from omnijax.kept_executables import cached_jit
from omnijax.kv import quant_kv
from omnijax.kv.paged import PagedKV


def _frozen(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x)
    x.flags.writeable = False
    return x


@dataclasses.dataclass(frozen=True)
class UnitKV:
    """The evicted tokens of one unit, in host memory (see the module docstring for shapes).

    Attributes:
        unit: the unit id.
        k, v: `[L, G, n, d]` keys (rotated at `pos`) and values, tokens in write order.
        pos: `[A, n]` int32 positions.
        span: `[n]` int8 span kinds.
        offset: `[n]` int32 offsets within the span.
        order: `[n]` int32 write order at eviction time.
        summary: `[L, G, d]` float32 retrieval summary (`summarize`).
        vpos: `[n]` int64 position (axis 0) each token has in the full-context session (`NoSlide`), which no
            re-indexing changes; `pos[0] - vpos` is the shift re-indexing applied (uniform over axes). Filled in by
            `omnijax.streaming.recall_session` (None for a record made without it).
    """

    unit: int
    k: np.ndarray
    v: np.ndarray
    pos: np.ndarray
    span: np.ndarray
    offset: np.ndarray
    order: np.ndarray
    summary: np.ndarray
    vpos: np.ndarray | None = None

    @property
    def size(self) -> int:
        """Tokens (cache cells) of the unit."""
        return int(self.k.shape[2])

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of the record, summary and metadata included (host and disk together; computed once: the record is
        immutable, and a tier sums it over every stored record at each add)."""
        return sum(int(getattr(self, f.name).nbytes) for f in dataclasses.fields(self)
                   if f.name != "unit" and getattr(self, f.name) is not None)

    @property
    def on_disk(self) -> bool:
        """Whether the keys and values live in spill files (`omnijax.kv.host_tier_disk`), read through memory maps."""
        return isinstance(self.k, np.memmap)

    @property
    def disk_nbytes(self) -> int:
        """Bytes held on disk: the keys and values of a spilled record, else 0."""
        return int(self.k.nbytes + self.v.nbytes) if self.on_disk else 0

    @property
    def host_nbytes(self) -> int:
        """Bytes held in host memory: `nbytes` less `disk_nbytes`."""
        return self.nbytes - self.disk_nbytes

    def with_vpos(self, vpos: np.ndarray) -> "UnitKV":
        """This record with its full-context positions `vpos [n]` set (read-only)."""
        vpos = np.asarray(vpos, np.int64)
        if vpos.shape != (self.size,):
            raise ValueError(f"unit {self.unit}: vpos must be [{self.size}], got {vpos.shape}")
        return dataclasses.replace(self, vpos=_frozen(vpos))


def summarize(k: np.ndarray) -> np.ndarray:
    """`[L, G, d]` float32: the mean key per layer and kv head of keys `[L, G, n, d]` (n >= 1)."""
    return np.asarray(k, np.float32).mean(axis=2)


def make_unit(unit: int, k: np.ndarray, v: np.ndarray, pos: np.ndarray, span: np.ndarray, offset: np.ndarray,
              order: np.ndarray) -> UnitKV:
    """A `UnitKV` with its summary computed; arrays are made read-only. Shapes are checked and refused by name."""
    k, v = np.asarray(k), np.asarray(v)
    if k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"unit {unit}: k and v must both be [L, G, n, d], got {k.shape} and {v.shape}")
    n = k.shape[2]
    if n == 0:
        raise ValueError(f"unit {unit}: a stored unit needs at least one token")
    pos = np.asarray(pos, np.int32)
    if pos.ndim != 2 or pos.shape[1] != n:
        raise ValueError(f"unit {unit}: pos must be [A, {n}], got {pos.shape}")
    for name, a in (("span", span), ("offset", offset), ("order", order)):
        if np.shape(a) != (n,):
            raise ValueError(f"unit {unit}: {name} must be [{n}], got {np.shape(a)}")
    return UnitKV(unit=int(unit), k=_frozen(k), v=_frozen(v), pos=_frozen(pos),
                  span=_frozen(np.asarray(span, np.int8)), offset=_frozen(np.asarray(offset, np.int32)),
                  order=_frozen(np.asarray(order, np.int32)), summary=_frozen(summarize(k)))


def split_blocks(u: UnitKV, block: int) -> list[UnitKV]:
    """`u` cut into recall blocks of at most `block` tokens: a token with write order o falls in block `o // block`
    (the grid of the stream's write orders, so the pieces of a unit evicted in different steps land on the same
    grid), one record per block that holds tokens, in write order. Each block keeps the unit id, its tokens' arrays
    (contiguous copies, read-only) and `vpos`; its summary is the mean of its own keys. A unit within one block is
    returned as it is.

    Why: a stored record is the smallest thing recall can score and bring back. A long text unit (a 128-token
    chunk of a single prompt, a whole user turn) holds one salient sentence among filler, and recalling it whole
    costs every one of its cells; blocks let a question bring back the part that draws its attention.

    Args:
        u: the record.
        block: most tokens per block (> 0).
    """
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    grid = np.asarray(u.order, np.int64) // int(block)
    if grid[0] == grid[-1]:
        return [u]
    cuts = np.flatnonzero(np.diff(grid)) + 1
    out = []
    for lo, hi in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [u.size]])):
        k = u.k[:, :, lo:hi]
        out.append(dataclasses.replace(
            u, k=_frozen(k), v=_frozen(u.v[:, :, lo:hi]), pos=_frozen(u.pos[:, lo:hi]), span=_frozen(u.span[lo:hi]),
            offset=_frozen(u.offset[lo:hi]), order=_frozen(u.order[lo:hi]), summary=_frozen(summarize(k)),
            vpos=None if u.vpos is None else _frozen(u.vpos[lo:hi])))
    return out


def evicted_slots(before: PagedKV, after: PagedKV) -> np.ndarray:
    """`[N, P]` bool: slots live in `before` and not in `after` (a trim's evictions; call it before any migration,
    which moves survivors between slots)."""
    return np.asarray(before.valid) & ~np.asarray(after.valid)


def gather_units(kv: PagedKV, slots: np.ndarray, seq: int = 0) -> list[UnitKV]:
    """The tokens of `slots` (`[N, P]` bool, e.g. `evicted_slots`) held by sequence `seq`, one `UnitKV` per unit id,
    units oldest first (by their oldest token's write order), tokens in write order. Only the taken slots are
    copied to host (one gather and one transfer per array).

    Args:
        kv: the cache holding the tokens (the cache before the eviction).
        slots: which physical slots to take.
        seq: the sequence whose page table owns them.
    """
    if not 0 <= seq < kv.batch:
        raise ValueError(f"seq must lie in [0, {kv.batch}), got {seq}")
    N, P = kv.num_pages, kv.page_size
    table = np.asarray(kv.page_table[seq])
    owned = np.zeros((N, P), bool)
    owned[table[table >= 0]] = True
    flat = np.flatnonzero(np.asarray(slots, bool).reshape(N, P) & owned & np.asarray(kv.valid))
    return _group(_take(kv, flat))


_FIELDS = ("k", "v", "pos", "unit", "span", "offset", "order")


def _take(kv: PagedKV, flat: np.ndarray) -> dict[str, np.ndarray]:
    """The tokens at flat slots `flat` (page * P + offset) on host: `k, v [L, n, G, d]`, `pos [A, n]`, the rest
    `[n]`. Only those slots leave the device: one gather per array, then one transfer."""
    L, N, P, G, d = kv.k.shape
    if flat.size == 0:
        return {"k": np.zeros((L, 0, G, d), kv.k.dtype), "v": np.zeros((L, 0, G, d), kv.v.dtype),
                "pos": np.zeros((kv.pos.shape[0], 0), np.int32), **{f: np.zeros(0, np.int32) for f in _FIELDS[3:]}}
    n = flat.size
    at = np.zeros(1 << (n - 1).bit_length(), np.int32)  # a power of two: one compiled gather per size bucket
    at[:n] = flat
    got = jax.device_get(_gather(kv, jnp.asarray(at)))
    return {f: x[:, :n] if f in ("k", "v", "pos") else x[:n] for f, x in got.items()}


@cached_jit
def _gather(kv: PagedKV, at: jax.Array) -> dict[str, jax.Array]:
    # int8 pages (`QuantPages`) are read dequantised, in the model's dtype (module docstring, "int8 pools").
    k, v = quant_kv.dense(kv.k), quant_kv.dense(kv.v)
    L, N, P, G, d = k.shape
    return {"k": k.reshape(L, N * P, G, d)[:, at], "v": v.reshape(L, N * P, G, d)[:, at],
            "pos": kv.pos.reshape(kv.pos.shape[0], -1)[:, at], "unit": kv.unit.reshape(-1)[at],
            "span": kv.span.reshape(-1)[at], "offset": kv.offset.reshape(-1)[at], "order": kv.order.reshape(-1)[at]}


def warm_gathers(kv: PagedKV, max_tokens: int) -> int:
    """Compiles the gather every capture runs (`capture_evicted`, `save_slots`) for each power-of-two token bucket
    up to `max_tokens` (reading slot 0 of `kv`; nothing changes): a server's warm-up. Returns the buckets run."""
    buckets = [1 << k for k in range(max(0, int(max_tokens) - 1).bit_length() + 1)]
    for n in buckets:
        jax.block_until_ready(_gather(kv, jnp.asarray(np.zeros(n, np.int32))))  # as `_take` calls it
    return len(buckets)


def _pick(saved: Saved, index: np.ndarray) -> dict[str, np.ndarray]:
    """The tokens at positions `index` of `saved` on host (one gather per array, at a power-of-two bucket)."""
    n = index.size
    at = np.zeros(1 << max(0, (n - 1).bit_length()), np.int32)
    at[:n] = index
    return _along_tokens(jax.device_get(_pick_device(saved.tokens, jnp.asarray(at))), slice(n))


@cached_jit
def _pick_device(tokens: dict, at: jax.Array) -> dict:
    return _along_tokens(tokens, at)


def _along_tokens(tokens: dict, index: Any) -> dict:
    """`tokens` (as `_take` returns them) indexed on their token axis: `k`, `v`, `pos`'s second, the others' first."""
    return {f: x[:, index] if f in ("k", "v", "pos") else x[index] for f, x in tokens.items()}


def _group(host: dict[str, np.ndarray]) -> list[UnitKV]:
    """Tokens (as `_take` returns them) grouped into one `UnitKV` per unit id, units oldest first (by their oldest
    token's write order), tokens in write order."""
    unit, order = np.asarray(host["unit"]), np.asarray(host["order"])
    units: list[UnitKV] = []
    for u in sorted(set(unit.tolist()), key=lambda u: order[unit == u].min()):
        sel = np.flatnonzero(unit == u)
        sel = sel[np.argsort(order[sel], kind="stable")]  # write order
        units.append(make_unit(u, host["k"][:, sel].transpose(0, 2, 1, 3), host["v"][:, sel].transpose(0, 2, 1, 3),
                               host["pos"][:, sel], host["span"][sel], host["offset"][sel], order[sel]))
    return units


@dataclasses.dataclass(frozen=True)
class Evicted:
    """What one step evicted from a batch-1 cache (`capture_evicted`).

    Attributes:
        units: the evicted tokens as `UnitKV` records, oldest unit first.
        lost: write orders of evicted tokens whose keys and values no copy holds any more (a token written and
            evicted in the same step whose slot a later write of that step took); reported, never stored.
    """

    units: tuple[UnitKV, ...]
    lost: tuple[int, ...]


def metadata_copy(kv: PagedKV) -> PagedKV:
    """`kv` with a device copy of every field but its pages (`k`, `v`, which stay `kv`'s own): what an in-place
    capture (`capture_evicted(..., in_place=True)`) needs of the cache before a step that is donated and updated
    in place (a few bytes per slot; the pages are not copied, and may be deleted by the donation)."""
    return kv.replace(**_copy_fields({f.name: getattr(kv, f.name) for f in dataclasses.fields(kv)
                                      if f.name not in ("k", "v")}))


@cached_jit
def _copy_fields(fields: dict) -> dict:
    """Device copies of `fields`, one program (not one dispatch per field): a jitted output never aliases an input
    that is not donated."""
    return {name: jnp.copy(x) for name, x in fields.items()}


@dataclasses.dataclass(frozen=True)
class Saved:
    """Tokens gathered on device before a step (`save_slots`), for an in-place capture (`capture_evicted(...,
    saved=...)`) to read those the step overwrote.

    Attributes:
        slots: `[n]` flat slot indices (page * P + offset), ascending.
        tokens: the gathered fields (device arrays, padded to a power of two of tokens).
    """

    slots: np.ndarray
    tokens: dict


def save_slots(kv: PagedKV, row: int) -> Saved:
    """The live tokens of row `row` of `kv`, gathered on device (only that row's slots are read; nothing leaves the
    device): what an in-place capture of a step that may overwrite slots it evicted (its answer tokens refill the
    holes) reads them from."""
    m = jax.device_get({"table": kv.page_table[row], "valid": kv.valid})
    N, P = kv.num_pages, kv.page_size
    owned = np.zeros((N, P), bool)
    owned[m["table"][m["table"] >= 0]] = True
    flat = np.flatnonzero((owned & m["valid"]).reshape(-1))
    at = np.zeros(1 << max(0, (flat.size - 1).bit_length()), np.int32)
    at[:flat.size] = flat
    return Saved(slots=flat, tokens=_gather(kv, jnp.asarray(at)))


def capture_evicted(before: PagedKV, after: PagedKV, *, skip: tuple[int, int] = (0, 0),
                    shared_pool: bool = False, in_place: bool = False, saved: Saved | None = None,
                    written: dict | None = None, row: int = 0) -> Evicted:
    """The tokens a step evicted, exactly as they were cached when evicted (batch-1 caches).

    Tokens are known by their write order (unique in a sequence, kept by re-indexing and migration). Evicted =
    live in `before` or written by the step (orders from `before.next_order` to `after.next_order`), and live
    nowhere in `after`; orders in `[skip[0], skip[1])` are left out (recalled tokens the tier still holds). A token
    live in `before` is read there (its key as rotated at eviction). A token the step wrote and evicted is read from
    its slot in `after`, which still holds it when invalid and still carrying its order (eviction neither clears
    nor re-rotates a dropped slot; any later write of the step sets the slot's order), else it is `lost`; with
    `written`, from the step's record of it, whatever took its slot since (a survivor a relayout moved, an answer).

    Args:
        before: a copy of the cache before the step (the step's own input is donated).
        after: the cache after the step.
        skip: `[lo, hi)` write orders not to capture.
        shared_pool: the caches are one row of a pool other sequences share (a row of the engine's state, its
            per-row fields sliced to batch 1): other rows' slots carry write orders of their own, so a token the
            step wrote and evicted is looked for only on the pages the row listed before or after the step; one
            whose page the step also gave back is counted `lost` (reported, never stored from another row's slot).
        in_place: the step updated the cache in place, so `before` holds the metadata before it
            (`metadata_copy`) but its pages are `after`'s: a token live before is read from its slot in `after`
            while the slot still holds it (invalid, same write order), else from `saved` when that has it, else it
            is `lost` (reported). A step that writes nothing after its trim (no answer tokens) overwrites no slot
            it evicted.
        saved: with `in_place`, tokens gathered before the step (`save_slots`).
        written, row: the step's `ChunkOutput.written` (its chunk's tokens before its trim) and this cache's row.
    """
    if before.batch != 1 or after.batch != 1:
        raise ValueError(f"capture_evicted takes batch-1 caches, got batch {before.batch} and {after.batch}")
    meta = jax.device_get({"bv": before.valid, "bo": before.order, "bt": before.page_table, "av": after.valid,
                           "ao": after.order, "at": after.page_table, "first": before.next_order,
                           "end": after.next_order})  # whole arrays: indexing them on device dispatches a gather
    N, P = before.num_pages, before.page_size
    table = meta["bt"][0]
    owned = np.zeros((N, P), bool)
    owned[table[table >= 0]] = True
    old_live = (meta["bv"] & owned).reshape(-1)
    after_table = meta["at"][0]
    owned_after = np.zeros((N, P), bool)
    owned_after[after_table[after_table >= 0]] = True
    live_after = set(meta["ao"].reshape(-1)[(meta["av"] & owned_after).reshape(-1)].tolist())
    lo, hi = skip

    def wanted(order: np.ndarray) -> np.ndarray:
        return ~np.isin(order, list(live_after)) & ~((order >= lo) & (order < hi))

    from_before = np.flatnonzero(old_live & wanted(meta["bo"].reshape(-1)))
    first, end = int(meta["first"][0]), int(meta["end"][0])
    gone: list[int] = []
    from_saved = _take(after, np.zeros(0, int))
    if in_place:  # `before`'s pages are `after`'s: a slot a later write of the step took no longer holds its token
        before = before.replace(k=after.k, v=after.v)
        bo = meta["bo"].reshape(-1)
        intact = ~meta["av"].reshape(-1)[from_before] & (meta["ao"].reshape(-1)[from_before] == bo[from_before])
        taken, from_before = from_before[~intact], from_before[intact]
        known = np.zeros(0, int) if saved is None else saved.slots
        hit = np.isin(taken, known)
        gone = bo[taken[~hit]].tolist()
        if hit.any():
            from_saved = _pick(saved, np.searchsorted(known, taken[hit]))
    new_orders = np.arange(first, end)
    new_orders = new_orders[wanted(new_orders)]
    from_written = _along_tokens(from_saved, slice(0))
    if written is not None:  # the step's own record, not slots a later write of the step may have taken
        rec = _along_tokens(jax.device_get(written), row)  # this row's [L, T, G, d], [A, T], [T]
        hit = np.flatnonzero(np.isin(rec["order"], new_orders) & (rec["order"] >= 0))
        from_written = _along_tokens(rec, hit)
        new_orders = new_orders[~np.isin(new_orders, rec["order"][hit])]
    after_order, after_valid = meta["ao"].reshape(-1), meta["av"].reshape(-1)
    mine = (owned | owned_after).reshape(-1) if shared_pool else np.ones(N * P, bool)
    # A slot the step did not write keeps the order it had (a freed page's dirty slots carry another session's
    # orders, which may fall in this step's range): only slots whose order changed hold this step's tokens (one
    # rewritten with the very order it held is counted lost, never read from a stale slot).
    written = after_order != meta["bo"].reshape(-1)
    dead_new = np.flatnonzero(mine & written & ~after_valid & (after_order >= first) & (after_order < end))
    dead_new = dead_new[np.isin(after_order[dead_new], new_orders)]
    lost = tuple(sorted((set(new_orders.tolist()) - set(after_order[dead_new].tolist())) | set(gone)))
    a, b = _take(before, from_before), _take(after, dead_new)
    host = {f: np.concatenate([a[f], from_saved[f], from_written[f], b[f]], axis=1 if f in ("k", "v", "pos") else 0)
            for f in _FIELDS}
    return Evicted(units=tuple(_group(host)) if host["unit"].size else (), lost=lost)


@dataclasses.dataclass(frozen=True)
class TierReport:
    """What one `HostTier.add` did.

    Attributes:
        added: unit ids stored.
        dropped: unit ids dropped (oldest first) to make room.
        dropped_bytes: their host bytes.
    """

    added: tuple[int, ...]
    dropped: tuple[int, ...]
    dropped_bytes: int


@dataclasses.dataclass(frozen=True)
class HostTier:
    """A bounded host store of evicted units, oldest first (see the module docstring).

    Attributes:
        budget_bytes: most host bytes held (> 0).
        units: stored records, oldest first. A unit evicted in pieces (OmniPick keeps sinks, drops them later) is
            stored as one record per piece, each consistent with its own positions.
        dropped_units, dropped_bytes: running totals of what the budget forced out.
        spilled_units, spilled_bytes: running totals of records moved to disk (`omnijax.kv.host_tier_disk`).
    """

    budget_bytes: int
    units: tuple[UnitKV, ...] = ()
    dropped_units: int = 0
    dropped_bytes: int = 0
    spilled_units: int = 0
    spilled_bytes: int = 0

    def __post_init__(self):
        if not isinstance(self.budget_bytes, int) or isinstance(self.budget_bytes, bool) or self.budget_bytes <= 0:
            raise ValueError(f"HostTier: budget_bytes must be a positive int, got {self.budget_bytes!r}")

    @property
    def nbytes(self) -> int:
        """Host bytes held (a spilled record's summary and metadata; its keys and values are on disk)."""
        return sum(u.host_nbytes for u in self.units)

    @property
    def disk_nbytes(self) -> int:
        """Bytes of spilled keys and values on disk."""
        return sum(u.disk_nbytes for u in self.units)

    @property
    def sizes(self) -> np.ndarray:
        """`[U]` int64 cells of each stored unit."""
        return np.asarray([u.size for u in self.units], np.int64)

    def add(self, *new: UnitKV) -> tuple["HostTier", TierReport]:
        """Stores `new` (in the given order, as the newest units), dropping the oldest stored units as the budget
        needs. Returns `(tier, report)`; `self` is unchanged. A unit larger than the budget is refused (ValueError
        naming it) and nothing is stored."""
        for u in new:
            if not isinstance(u, UnitKV):
                raise TypeError(f"HostTier.add takes UnitKV records, got {type(u).__name__}")
            if u.nbytes > self.budget_bytes:
                raise ValueError(f"HostTier: unit {u.unit} needs {u.nbytes} bytes, more than the whole host budget "
                                 f"budget_bytes={self.budget_bytes}")
        units = list(self.units) + list(new)
        sizes = [u.host_nbytes for u in units]
        total, first = sum(sizes), 0
        while total > self.budget_bytes:
            total -= sizes[first]
            first += 1
        gone = units[:first]
        # Units added by this call may be dropped by a later unit of the same call; report only the stored ones.
        added = tuple(u.unit for u in units[max(first, len(self.units)):])
        report = TierReport(added=added, dropped=tuple(u.unit for u in gone),
                            dropped_bytes=sum(sizes[:first]))
        tier = dataclasses.replace(self, units=tuple(units[first:]), dropped_units=self.dropped_units + len(gone),
                                   dropped_bytes=self.dropped_bytes + report.dropped_bytes)
        return tier, report

    def take(self, indices: np.ndarray | list[int]) -> tuple["HostTier", tuple[UnitKV, ...]]:
        """`(tier without them, the records at indices)`: recalled units leave the tier (put them back with `add`
        to keep them)."""
        chosen = sorted({int(i) for i in indices})
        if chosen and not 0 <= chosen[0] <= chosen[-1] < len(self.units):
            raise ValueError(f"HostTier.take: indices must lie in [0, {len(self.units)}), got {chosen}")
        picked = tuple(self.units[i] for i in chosen)
        rest = tuple(u for i, u in enumerate(self.units) if i not in set(chosen))
        return dataclasses.replace(self, units=rest), picked
