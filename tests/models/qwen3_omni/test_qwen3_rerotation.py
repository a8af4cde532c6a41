"""Re-indexing after a trim is exact under interleaved M-RoPE (Qwen3-Omni): re-rotated cached keys equal keys rotated
fresh at the new positions with the interleaved frequency layout.

`base.apply` re-rotates a survivor's key by its position delta as a 1D rotation (every frequency by the same
-delta); since re-indexing shifts all three position components of a token by the same delta, that is the rotation
between the old and the new position under any frequency layout. These tests prove it for the interleaved one:
directly on a cache (Qwen3-Omni-shaped positions: text runs, an image grid with distinct h/w, an audio run), and end
to end through a streamed Qwen3-MoE decoder trimmed by OmniPick, where layer 0's cached keys (a function of the
token's embedding and its position alone) must equal `layer_qkv` recomputed at the token's position after every trim.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import omnijax
from omnijax.chunks.builders import make_chunk
from omnijax.chunks.chunk import pad_chunk
from omnijax.chunks.spans import SpanKind as K
from omnijax.kv import paged
from omnijax.kv import rope as rope_lib
from omnijax.models.config import TINY_OMNI
from omnijax.models.decoder import Decoder, chunk_rotation, layer_qkv, layer_slice
from omnijax.models.model import Model
from omnijax.retention import OmniPick, base
from tests.retention.test_retention_apply import _python_freed  # the re-indexing rule read plainly

G, D, P = 2, 16, 4  # kv heads, head dim, page size
THETA = 1e4
SECTION = (2, 3, 3)  # head_dim 16: 8 frequencies, interleaved t h w t h w t w


def _interleaved(positions, keys):
    """`keys [..., n, G, D]` rotated at `positions [3, n]` with the interleaved layout."""
    angles = rope_lib.rope_angles(jnp.asarray(positions), D, THETA, SECTION, interleaved=True)  # [n, d/2]
    return rope_lib.apply_rope(jnp.asarray(keys), angles)


def _qwen3_positions(rng, n):
    """3-axis positions as Qwen3-Omni places a session: a text run, an image grid (t, base + r, base + c) with rows
    != cols, an audio run (t, t, t), then text again; each group starts after the previous one's largest id."""
    head = int(rng.integers(1, 4))
    rows, cols = (2, 3) if rng.random() < 0.5 else (3, 2)
    pos = [(i, i, i) for i in range(head)]
    pos += [(head, head + r, head + c) for r in range(rows) for c in range(cols)]
    cursor = head + max(rows, cols)
    audio = int(rng.integers(3, 6))
    pos += [(cursor + i,) * 3 for i in range(audio)]
    cursor += audio
    pos += [(cursor + i,) * 3 for i in range(n - len(pos))]
    assert len(pos) == n
    return np.asarray(pos, np.int32).T  # [3, n]


def _fill(rng, positions, num_pages=8):
    """A one-sequence cache (pages permuted) holding random keys rotated (interleaved) at `positions [3, n]`."""
    n = positions.shape[1]
    kv = paged.init(num_layers=2, num_kv_heads=G, head_dim=D, num_pages=num_pages, page_size=P, batch=1,
                    position_axes=3)
    kv = kv.replace(free_stack=jnp.asarray(rng.permutation(num_pages).astype(np.int32)))
    raw_k = rng.standard_normal((2, 1, n, G, D)).astype(np.float32)
    v = rng.standard_normal((2, 1, n, G, D)).astype(np.float32)
    k = _interleaved(positions, raw_k)
    z = jnp.zeros((1, n), jnp.int32)
    meta = paged.SlotMeta(pos=jnp.asarray(positions)[:, None], unit=z, span=z + int(K.TEXT), offset=z)
    kv, _ = paged.append(kv, k, jnp.asarray(v), jnp.ones((1, n), bool), meta)
    return kv, raw_k


_apply = jax.jit(base.apply, static_argnames=("reindex", "rope"))  # one compiled program for every seed


@pytest.mark.parametrize("seed", range(8))
def test_rerotated_keys_equal_fresh_interleaved_keys(seed):
    rng = np.random.default_rng(seed)
    n = 21
    positions = _qwen3_positions(rng, n)
    kv, raw_k = _fill(rng, positions)
    next_pos = jnp.asarray([int(positions.max()) + 1], jnp.int32)
    view = base.sequence_view(kv)
    keep = view.live & jnp.asarray(rng.random(view.live.shape) < 0.5)
    new_kv, new_next, evicted = _apply(kv, keep, next_pos, reindex=True, rope=(THETA, SECTION))

    order, live = np.asarray(view.order[0]), np.asarray(view.live[0])
    kept = sorted(int(order[s]) for s in np.flatnonzero(np.asarray(keep[0])))
    intervals = [(int(positions[:, i].min()), int(positions[:, i].max())) for i in range(n)]
    deltas, total = _python_freed(intervals, [i in kept for i in range(n)], int(next_pos[0]))
    assert int(new_next[0]) == int(next_pos[0]) - total
    assert int(evicted[0]) == n - len(kept)
    assert any(deltas[t] > 0 for t in kept)  # something was re-rotated

    new_view = base.sequence_view(new_kv)
    flat, _ = paged.table_slots(new_kv)
    slot_of = {int(order[s]): s for s in np.flatnonzero(live)}
    cached = np.asarray(new_kv.k).reshape(2, -1, G, D)[:, np.asarray(flat[0])]  # [L, S, G, D] page-table order
    want_pos = np.stack([positions[:, t] - deltas[t] for t in kept], axis=1)  # [3, k]
    got_pos = np.asarray(new_view.pos[:, 0])[:, [slot_of[t] for t in kept]]
    np.testing.assert_array_equal(got_pos, want_pos)
    fresh = np.asarray(_interleaved(want_pos, raw_k[:, 0, kept]))  # [L, k, G, D]
    got = cached[:, [slot_of[t] for t in kept]]
    err = float(np.abs(got - fresh).max())
    assert err <= 1e-5, err
    # The check tells the layouts apart: the image tokens' keys under the block (non-interleaved) layout differ.
    grid = [i for i, t in enumerate(kept) if len(set(want_pos[:, i])) > 1]
    assert grid, "no surviving token with distinct h/w positions"
    block = np.asarray(rope_lib.apply_rope(jnp.asarray(raw_k[:, 0, kept]), rope_lib.rope_angles(
        jnp.asarray(want_pos), D, THETA, SECTION, interleaved=False)))
    assert float(np.abs(block[:, grid] - fresh[:, grid]).max()) > 1e-2


# ------------------------------------------------------------------------------------ end to end through streaming

CONFIG = TINY_OMNI.replace(num_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                           mlp_only_layers=(1,), qkv_bias=False, qk_norm=True, mrope_interleaved=True)
PAGE, PAGES = 8, 12


def _units(seed):
    """A Qwen3-Omni-like session as `make_chunk` units placed at cursor 0: a system prompt, then image (a 2 x 3 grid
    between markers), audio, text and audiovisual (grid then audio) units in turn."""
    rng = np.random.default_rng(seed)
    ids = lambda n: rng.integers(0, CONFIG.vocab_size, n)  # noqa: E731
    B = int(K.BOUNDARY)

    def image(rows, cols):
        pos = [(0, 0, 0)] + [(1, 1 + r, 1 + c) for r in range(rows) for c in range(cols)]
        pos.append((1 + max(rows, cols),) * 3)
        return pos, [B] + [int(K.IMAGE)] * (rows * cols) + [B]

    def audio(n):
        return [(i, i, i) for i in range(n + 2)], [B] + [int(K.AUDIO)] * n + [B]

    def text(n):
        return [(i, i, i) for i in range(n)], [int(K.TEXT)] * n

    def audiovisual():
        pos, span = image(3, 2)
        top = pos[-1][0]
        pos = pos[:-1] + [(top + i,) * 3 for i in range(4)] + [(top + 4,) * 3]
        return pos, span[:-1] + [int(K.AUDIO)] * 4 + [B]

    layouts = [([(i, i, i) for i in range(5)], [int(K.SYSTEM)] * 5), image(2, 3), audio(5), text(4), audiovisual(),
               image(3, 2), text(3), audio(6), audiovisual(), text(5)]
    chunks = []
    for unit, (pos, span) in enumerate(layouts):
        pos = np.asarray(pos, np.int32).T
        chunks.append(make_chunk(ids(pos.shape[1]), pos, span, unit))
    return chunks


@pytest.fixture(scope="module")
def model():
    return Model(Decoder(CONFIG, rngs=nnx.Rngs(0)), model_type="qwen3_omni")


@pytest.fixture(scope="module")
def layer0_keys(model):
    decoder = model.decoder
    p0 = layer_slice(CONFIG, decoder.layers.stacked(), 0)

    @jax.jit
    def padded(token_ids, positions):  # [S], [3, S] -> [S, G, d] layer-0 keys, rotated
        h = decoder.embed_tokens(token_ids[None])
        _, k, _ = layer_qkv(CONFIG, p0, h, chunk_rotation(CONFIG, positions[:, None]))
        return k[0]

    def keys(token_ids, positions):  # padded to the pool's slots: one compiled program
        n, size = len(token_ids), PAGES * PAGE
        ids = np.zeros(size, np.int32)
        ids[:n] = token_ids
        pos = np.zeros((3, size), np.int32)
        pos[:, :n] = positions
        return np.asarray(padded(ids, pos))[:n]

    return keys


POLICIES = [OmniPick(high_watermark=28, low_watermark=18, recent_units=1, image_sink=2, audio_sink=2, text_budget=3),
            OmniPick(high_watermark=32, low_watermark=22, recent_units=2, image_sink=1, audio_sink=3, text_budget=5)]


@pytest.mark.parametrize("seed,policy", list(enumerate(POLICIES)))
def test_streamed_trims_keep_layer0_keys_equal_fresh_keys(model, layer0_keys, seed, policy):
    """After every chunk of an OmniPick-trimmed (re-indexing) stream, the cache's positions follow the re-indexing
    rule and layer 0's key of every live slot equals the key computed fresh for its token at its new position."""
    assert policy.reindex
    session = omnijax.Session(model, policy=policy, page_size=PAGE, num_pages=PAGES)
    units = _units(seed)
    length = max(c.length for c in units)
    tokens, pos_of, cursor = [], {}, 0  # token ids by write order; python model of each token's position
    trims, max_err, shifted = 0, 0.0, 0
    for c, chunk in enumerate(units):
        n = chunk.token_ids.shape[1]
        offsets = np.asarray(chunk.positions)[:, 0]
        for i in range(n):
            pos_of[len(tokens)] = offsets[:, i] + cursor
            tokens.append(int(chunk.token_ids[0, i]))
        cursor += int(chunk.advance[0])
        out = session.feed(pad_chunk(chunk, length))  # one chunk shape: one compiled step
        kv = session.state.kv
        view = base.sequence_view(kv)
        live = np.flatnonzero(np.asarray(view.live[0]))
        order = np.asarray(view.order[0])[live]
        if int(out.stats.evicted[0]):  # the rule read plainly over the python positions
            trims += 1
            survivors = set(order.tolist())
            olds = sorted(pos_of)
            deltas, total = _python_freed([(int(pos_of[o].min()), int(pos_of[o].max())) for o in olds],
                                          [o in survivors for o in olds], cursor)
            pos_of = {o: pos_of[o] - d for o, d in zip(olds, deltas) if o in survivors}
            shifted += sum(d > 0 for d in deltas)
            cursor -= total
        assert sorted(order.tolist()) == sorted(pos_of), f"chunk {c}"
        assert int(session.state.next_pos[0]) == cursor, f"chunk {c}"
        got_pos = np.asarray(view.pos[:, 0])[:, live]  # [3, live]
        want_pos = np.stack([pos_of[int(o)] for o in order], axis=1)
        np.testing.assert_array_equal(got_pos, want_pos, err_msg=f"chunk {c}")
        flat = np.asarray(paged.table_slots(kv)[0][0])[live]
        cached = np.asarray(kv.k[0]).reshape(-1, CONFIG.num_kv_heads, CONFIG.head_dim)[flat]
        fresh = layer0_keys([tokens[int(o)] for o in order], got_pos)
        err = float(np.abs(cached - fresh).max())
        assert err <= 1e-5, f"chunk {c}: {err}"
        max_err = max(max_err, err)
    # The session really trimmed several times, re-indexed survivors, and kept multi-axis (image) tokens.
    print(f"seed {seed}: {trims} trims, {shifted} re-indexed survivors, max layer-0 key error {max_err:.2e}")
    assert trims >= 3 and shifted > 0
    assert any(len(set(p)) > 1 for p in pos_of.values())
