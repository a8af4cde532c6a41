"""Decode attention (impl="xla", Qwen2.5-Omni-7B shapes) over 36 active pages, timed alone and right after a
512-page full-context call, to tell a per-call fixed cost from cache state. A helper of the attention_kernel.py
investigation recorded in RESULTS.md (2026-12-02); not part of the smoke suite (leading underscore).

Run: `python -m bench.omnitide._decode_cache_state`
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from omnijax.kv import attention

H, G, D, P = 28, 4, 128, 64  # query heads, KV heads, head dim, page size
rng = np.random.default_rng(0)


def case(active: int, pool: int):
    """Arguments of one decode call over `active` random pages of a `pool`-page cache (every slot live)."""
    k, v = (jnp.asarray(rng.standard_normal((pool, P, G, D), np.float32)) for _ in range(2))
    table = np.full((1, pool), -1, np.int32)
    table[0, :active] = rng.permutation(pool)[:active]
    valid = np.zeros((pool, P), bool)
    valid[table[0, :active]] = True
    order = np.arange(pool * P, dtype=np.int32).reshape(pool, P)
    view = attention.index_pages(attention.CacheView(
        write_slots=jnp.full((1, 1), -1, jnp.int32), page_table=jnp.asarray(table), slot_valid=jnp.asarray(valid),
        slot_order=jnp.asarray(order), q_order=jnp.full((1, 1), pool * P, jnp.int32)))
    return jnp.asarray(rng.standard_normal((1, 1, H, D), np.float32)), k, v, view


def main():
    attend = jax.jit(lambda q, k, v, view: attention.attend(q, k, v, view, impl="xla"))
    small, big = case(36, 48), case(512, 520)
    for args in (small, big):
        attend(*args).block_until_ready()

    def timed(args):
        start = time.perf_counter()
        attend(*args).block_until_ready()
        return 1e3 * (time.perf_counter() - start)

    alone = np.median([timed(small) for _ in range(40)])
    after, big_times = [], []
    for _ in range(40):
        big_times.append(timed(big))
        after.append(timed(small))
    after, big_ms = np.median(after), np.median(big_times)
    print(f"36 pages: {alone:.2f} ms alone, {after:.2f} ms right after a 512-page call; 512 pages: {big_ms:.2f} ms")
    print(f"512 / 36 pages: {big_ms / alone:.1f}x alone, {big_ms / after:.1f}x interleaved (pages: {512 / 36:.1f}x)")


if __name__ == "__main__":
    main()
