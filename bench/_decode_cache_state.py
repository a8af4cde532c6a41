"""Decode attention (impl="xla", Qwen2.5-Omni-7B shapes) over 36 active pages, timed alone and right after a
512-page full-context call, to tell per-call fixed cost from cache state. A helper of the attention_kernel.py
investigation recorded in RESULTS.md (2026-12-02); not part of the smoke suite (leading underscore).

Run: `python bench/_decode_cache_state.py`
"""
import time

import jax
import jax.numpy as jnp
import numpy as np

from omnijax import attention

H, G, d, P = 28, 4, 128, 64
rng = np.random.default_rng(0)
def make(active, pool):
    k = jnp.asarray(rng.standard_normal((pool, P, G, d), np.float32)); v = jnp.asarray(rng.standard_normal((pool, P, G, d), np.float32))
    table = np.full((1, pool), -1, np.int32); table[0, :active] = rng.permutation(pool)[:active]
    valid = np.zeros((pool, P), bool); valid[table[0, :active]] = True
    order = np.arange(pool * P, dtype=np.int32).reshape(pool, P)
    view = attention.index_pages(attention.CacheView(write_slots=jnp.full((1, 1), -1, jnp.int32), page_table=jnp.asarray(table),
        slot_valid=jnp.asarray(valid), slot_order=jnp.asarray(order), q_order=jnp.full((1, 1), pool * P, jnp.int32)))
    q = jnp.asarray(rng.standard_normal((1, 1, H, d), np.float32))
    return q, k, v, view
f = jax.jit(lambda q, k, v, view: attention.attend(q, k, v, view, impl="xla"))
small, big = make(36, 48), make(512, 520)
f(*small).block_until_ready(); f(*big).block_until_ready()
def t(a):
    s = time.perf_counter(); f(*a).block_until_ready(); return time.perf_counter() - s
alone = [t(small) for _ in range(40)]
inter_s, inter_b = [], []
for _ in range(40):
    inter_b.append(t(big)); inter_s.append(t(small))
bigs = [t(big) for _ in range(20)]
print(f"36 pages alone {1e3*np.median(alone):.2f} ms; interleaved after 512 pages {1e3*np.median(inter_s):.2f} ms; 512 pages {1e3*np.median(inter_b):.2f} / alone {1e3*np.median(bigs):.2f} ms")
print(f"ratio alone {np.median(bigs)/np.median(alone):.1f}x, interleaved {np.median(inter_b)/np.median(inter_s):.1f}x; pages 14.2x")
