"""Page sharing (`omnijax.kv.page_sharing`, `PagedKV.shares`, `release_pages`) against a plain-Python pool.

The model keeps page tables as lists, a reference count per page, the free stack as a list (top last) and each
page's slots as a list of token marks (None = empty). A random schedule of appends (first-fit: a row's open slots in
table order, then fresh pages from the stack top), forks (full pages shared, the others copied to fresh pages),
copy-on-write writes and evictions (`unshare`: a touched shared page copied, a wholly evicted one replaced by an
empty page)
and row releases runs on both; after every operation the tables, the counts, the free stack and every row's tokens
are equal, and no shared page ever changes.
"""

import jax
import jax.numpy as jnp
import numpy as np

from omnijax.kv import page_sharing
from omnijax.kv import paged as paged_lib

N, P, B, M = 40, 4, 4, 8


class Model:
    """The pool in plain Python."""

    def __init__(self):
        self.table = [[-1] * M for _ in range(B)]
        self.refs = [0] * N
        self.stack = list(range(N - 1, -1, -1))  # top last: page 0 first
        self.pages = [[None] * P for _ in range(N)]
        self.mark = [0] * B  # seq_slots
        self.copies = self.dereferences = 0  # copy-on-write copies and wholly evicted shared pages

    def pop(self):
        page = self.stack.pop()
        assert self.refs[page] == 0
        self.refs[page] = 1
        return page

    def release(self, pages):
        drops = {}
        for p in pages:
            drops[p] = drops.get(p, 0) + 1
        freed = []
        for p in pages:
            if p in drops:
                self.refs[p] -= drops.pop(p)
                if self.refs[p] <= 0:
                    self.refs[p] = 0
                    self.pages[p] = [None] * P
                    freed.append(p)
        self.stack += freed

    def opened(self, row):
        held = -(-self.mark[row] // P)
        return held, [(e, o) for e in range(held) if self.table[row][e] >= 0 for o in range(P)
                      if self.pages[self.table[row][e]][o] is None]

    def fits(self, row, n):
        held, opened = self.opened(row)
        pages = -(-max(n - len(opened), 0) // P)
        return held + pages <= M and pages <= len(self.stack)

    def append(self, row, marks):
        held, opened = self.opened(row)
        slots = opened[:len(marks)]
        rest = len(marks) - len(slots)
        for i in range(-(-rest // P)):
            self.table[row][held + i] = self.pop()
            slots += [(held + i, o) for o in range(P)]
        for (e, o), m in zip(slots, marks):
            page = self.table[row][e]
            assert self.refs[page] == 1, "a write into a shared page"
            self.pages[page][o] = m
            self.mark[row] = max(self.mark[row], e * P + o + 1)

    def fork(self, src, dsts, share):
        full = [share and p >= 0 and all(x is not None for x in self.pages[p]) for p in self.table[src]]
        for d in dsts:
            for e, p in enumerate(self.table[src]):
                if p < 0:
                    continue
                if full[e]:
                    self.refs[p] += 1
                    self.table[d][e] = p
                else:
                    q = self.pop()
                    self.pages[q] = list(self.pages[p])
                    self.table[d][e] = q
            self.mark[d] = self.mark[src]

    def write(self, touched, evicts):
        """`unshare` then the eviction of `evicts` (both {row: set of table slots})."""
        dropped_refs = []
        for b in range(B):
            for e, p in enumerate(self.table[b]):
                hit = {e * P + o for o in range(P)} & touched.get(b, set())
                if p < 0 or not hit or self.refs[p] <= 1:
                    continue
                live = {e * P + o for o in range(P) if self.pages[p][o] is not None}
                q = self.pop()
                if live <= evicts.get(b, set()):  # the whole page evicted: an empty page takes its place
                    self.dereferences += 1
                else:
                    self.copies += 1
                    self.pages[q] = list(self.pages[p])
                self.table[b][e] = q
                dropped_refs.append(p)
        self.release(dropped_refs)
        for b, slots in evicts.items():
            for j in slots:
                p = self.table[b][j // P]
                if p >= 0:
                    assert self.refs[p] == 1, "an eviction in a shared page"
                    self.pages[p][j % P] = None

    def free(self, row):
        self.release([p for p in self.table[row] if p >= 0])
        self.table[row] = [-1] * M
        self.mark[row] = 0

    def rows(self):
        return [[None if p < 0 else self.pages[p][o] for p in t for o in range(P)] for t in self.table]


def _rows(kv):
    flat, exists = (np.asarray(x) for x in paged_lib.table_slots(kv))
    unit, valid = np.asarray(kv.unit).reshape(-1), np.asarray(kv.valid).reshape(-1)
    return [[int(unit[f]) if (x and valid[f]) else None for f, x in zip(fr, er)] for fr, er in zip(flat, exists)]


def _check(kv, model):
    np.testing.assert_array_equal(np.asarray(kv.page_table), np.asarray(model.table))
    refs = np.asarray(model.refs)
    np.testing.assert_array_equal(np.asarray(kv.shares), np.maximum(refs - 1, 0))
    assert int(kv.num_free) == len(model.stack)
    np.testing.assert_array_equal(np.asarray(kv.free_stack)[:len(model.stack)], model.stack)
    assert _rows(kv) == model.rows()
    np.testing.assert_array_equal(np.asarray(kv.seq_slots), model.mark)


@jax.jit
def _append_jit(kv, valid, unit):
    T = valid.shape[1]
    meta = paged_lib.SlotMeta(pos=jnp.zeros((1, B, T), jnp.int32), unit=unit, span=jnp.zeros((B, T), jnp.int32),
                              offset=jnp.zeros((B, T), jnp.int32))
    values = jnp.broadcast_to(unit.astype(jnp.float32)[None, :, :, None, None], (1, B, T, 1, 2))
    return paged_lib.append(kv, values, values, valid, meta)[0]


def _append(kv, row, marks, T=8):
    valid = np.zeros((B, T), bool)
    valid[row, :len(marks)] = True
    unit = np.zeros((B, T), np.int32)
    unit[row, :len(marks)] = marks
    return _append_jit(kv, jnp.asarray(valid), jnp.asarray(unit))


@jax.jit
def _write_jit(kv, touched, drop):
    kv, writable = page_sharing.unshare(kv, touched, evicts=drop)
    flat, exists = paged_lib.table_slots(kv)
    target = jnp.where(drop & writable & exists, flat, N * P).reshape(-1)
    return kv.replace(valid=kv.valid.reshape(-1).at[target].set(False, mode="drop").reshape(N, P))


def _write(kv, touched, evicts):
    mask = lambda d: jnp.asarray(np.array([[j in d.get(b, set()) for j in range(M * P)] for b in range(B)]))  # noqa
    return _write_jit(kv, mask(touched), mask(evicts))


_fork = jax.jit(page_sharing.fork_rows, static_argnames="share")
_free = jax.jit(lambda kv, row: _free_row(kv, row))


def _free_row(kv, row):
    kv = paged_lib.release_pages(kv, kv.page_table[row])
    return kv.replace(page_table=kv.page_table.at[row].set(-1), seq_slots=kv.seq_slots.at[row].set(0))


def test_random_schedules_equal_the_plain_model():
    copies = dereferences = forks = 0
    for seed in range(100, 106):
        model, n = _schedule(np.random.default_rng(seed))
        copies, dereferences, forks = copies + model.copies, dereferences + model.dereferences, forks + n
    assert forks and copies and dereferences  # the schedules forked, copied and dropped references


def _schedule(rng):
    kv = paged_lib.init(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=N, page_size=P, batch=B, max_pages=M,
                        position_axes=1)
    model, mark = Model(), 1
    forks = 0
    for _ in range(80):
        held = [b for b in range(B) if any(p >= 0 for p in model.table[b])]
        empty = [b for b in range(B) if b not in held]
        op = rng.choice(["append", "fork", "write", "free"], p=[0.3, 0.3, 0.3, 0.1])
        if op == "append" or not held:
            row = int(rng.integers(B))
            if not held:
                row = 0
            n = int(rng.integers(1, 8))
            if not model.fits(row, n):
                continue
            marks = list(range(mark, mark + n))
            mark += n
            model.append(row, marks)
            kv = _append(kv, row, marks)
        elif op == "fork":
            if not empty:
                continue
            src = int(rng.choice(held))
            dsts = [int(d) for d in rng.permutation(empty)[:int(rng.integers(1, len(empty) + 1))]]
            share = bool(rng.random() < 0.8)
            if sum(p >= 0 for p in model.table[src]) * len(dsts) > len(model.stack):
                continue
            forks += 1
            model.fork(src, dsts, share)
            kv = _fork(kv, src, jnp.asarray(dsts), share=share)
        elif op == "write":
            touched, evicts = {}, {}
            for b in held:
                live = [j for j, x in enumerate(model.rows()[b]) if x is not None]
                if not live or rng.random() < 0.4:
                    continue
                if rng.random() < 0.4:  # every live slot of one entry: a whole-page eviction
                    e = int(rng.choice(live)) // P
                    touched[b] = evicts[b] = {j for j in live if j // P == e}
                else:
                    pick = {int(j) for j in rng.choice(live, size=int(rng.integers(1, min(len(live), 3) + 1)),
                                                       replace=False)}
                    touched[b], evicts[b] = pick, {j for j in pick if rng.random() < 0.5}
            if sum(len(t) for t in touched.values()) > len(model.stack):
                continue
            model.write(touched, evicts)
            kv = _write(kv, touched, evicts)
        else:
            row = int(rng.choice(held))
            model.free(row)
            kv = _free(kv, row)
        _check(kv, model)
    return model, forks


def test_int8_pages_fork_and_copy_bit_for_bit():
    kv = paged_lib.init(num_layers=2, num_kv_heads=1, head_dim=4, num_pages=8, page_size=P, batch=2,
                        position_axes=1, kv_dtype="int8")
    T = 6
    rng = np.random.default_rng(0)
    values = jnp.asarray(rng.normal(size=(2, 2, T, 1, 4)), jnp.float32)
    meta = paged_lib.SlotMeta(pos=jnp.zeros((1, 2, T), jnp.int32), unit=jnp.zeros((2, T), jnp.int32),
                              span=jnp.zeros((2, T), jnp.int32), offset=jnp.zeros((2, T), jnp.int32))
    kv, _ = paged_lib.append(kv, values, values, jnp.asarray([[True] * T, [False] * T]), meta)
    kv = page_sharing.fork_rows(kv, 0, jnp.asarray([1]), share=True)
    table = np.asarray(kv.page_table)
    assert table[1, 0] == table[0, 0] and table[1, 1] != table[0, 1]  # full page shared, partial one copied
    for x in (kv.k.values, kv.k.scale, kv.v.values):
        np.testing.assert_array_equal(np.asarray(x[:, table[1, 1]]), np.asarray(x[:, table[0, 1]]))
    touched = jnp.zeros((2, kv.max_pages * P), bool).at[1, 0].set(True)
    kv, writable = page_sharing.unshare(kv, touched)
    new = np.asarray(kv.page_table)[1, 0]
    assert new != table[0, 0] and bool(writable[1, 0]) and int(kv.shares[table[0, 0]]) == 0
    for x in (kv.k.values, kv.k.scale, kv.v.scale):
        np.testing.assert_array_equal(np.asarray(x[:, new]), np.asarray(x[:, table[0, 0]]))


def test_unshare_without_free_pages_flags_the_row_and_writes_nothing_shared():
    kv = paged_lib.init(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=2, page_size=P, batch=2, position_axes=1)
    values = jnp.ones((1, 2, P, 1, 2), jnp.float32)
    meta = paged_lib.SlotMeta(pos=jnp.zeros((1, 2, P), jnp.int32), unit=jnp.zeros((2, P), jnp.int32),
                              span=jnp.zeros((2, P), jnp.int32), offset=jnp.zeros((2, P), jnp.int32))
    kv, _ = paged_lib.append(kv, values, values, jnp.asarray([[True] * P, [False] * P]), meta)
    kv = page_sharing.fork_rows(kv, 0, jnp.asarray([1]))
    kv = kv.replace(num_free=jnp.asarray(0, jnp.int32))  # no page left for a copy
    touched = jnp.zeros((2, kv.max_pages * P), bool).at[1, 1].set(True)
    kv, writable = page_sharing.unshare(kv, touched)
    assert bool(kv.exhausted[1]) and not bool(kv.exhausted[0])
    assert not bool(writable[1, 1]) and int(kv.shares[0]) == 1
