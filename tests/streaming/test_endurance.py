"""Endurance: one-hour synthetic sessions (Qwen2.5-Omni 2 s audiovisual units; MiniCPM-o 4.5 1 s duplex units)
stream through a tiny model under OmniPick as one compiled program, with retained cells, physical span and the
position cursor flat after the first trim and the pool never exhausted. (Per-chunk latency is measured by
`bench.omnitide.endurance`, not asserted here.)"""


import jax
import numpy as np
import pytest

import omnijax
from omnijax.models.config import TINY_OMNI
from omnijax.retention import OmniPick
from omnijax.streaming.session import _step
from omnijax.testing import synthetic
from tests._support import DATA

GOLDEN_MINICPMO = DATA / "minicpmo45" / "checkpoint"


def minicpmo_llm_config():
    """MiniCPM-o 4.5's LLM config (Qwen3 mode: qk-norm, 1D positions), read from the tiny release checkpoint of the
    golden vectors."""
    import json

    from omnijax.models.minicpmo import convert as minicpmo
    return minicpmo.config_from_hf(json.loads((GOLDEN_MINICPMO / "config.json").read_text()))


HIGH, LOW = 2500, 1800
# The hour-long sessions' decoder: one layer of two 16-wide query heads over one KV head (the families' layouts and
# position schemes kept: M-RoPE's (2, 3, 3) sections fit head_dim 16, MiniCPM-o's qk-norm and 1D positions).
NARROW = dict(num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16)


def _flat_after_first_trim(result, chunk_tokens):
    retained = np.asarray(result.stats.layout.retained_cells[:, 0])
    span = np.asarray(result.stats.layout.physical_span[:, 0])
    next_pos = np.asarray(result.stats.next_pos[:, 0])
    evicted = np.asarray(result.stats.evicted[:, 0])
    first = int(np.argmax(evicted > 0))
    assert evicted[first] > 0, "the session never trimmed"
    steady = slice(first, None)
    assert retained[steady].max() <= HIGH
    # Retained cells oscillate in a band: the last quarter's range equals the band seen early in steady state.
    quarter = len(retained) // 4
    assert retained[-quarter:].max() <= retained[steady].max() and retained[-quarter:].min() >= LOW - chunk_tokens
    # The physical span and the position cursor stop growing (holes are reused; positions are re-indexed).
    assert span[-quarter:].max() <= span[first: first + quarter].max()
    assert next_pos[-quarter:].max() <= next_pos[first: first + quarter].max() + 4 * chunk_tokens
    assert not bool(result.state.kv.exhausted[0]) and int(result.state.kv.dropped[0]) == 0
    return retained


@pytest.mark.parametrize("layout", ["qwen2_5_omni", "minicpmo_4_5"])
def test_one_hour_session_is_flat_under_omnipick(layout):
    # One narrow decoder layer (NARROW): OmniPick reads slot metadata only, so retained cells, span, cursor and
    # evictions do not depend on the layers, their widths or their weights (identical stats over 600 units of either
    # layout against the two-layer models, at a third to a quarter of the CPU time: attention over the ~2,900-slot
    # pool was the cost); the layers' arithmetic is checked against transformers by the model tests.
    if layout == "qwen2_5_omni":
        model = omnijax.Decoder(TINY_OMNI.replace(**NARROW))
        chunks = synthetic.qwen_av_session(1800, vocab_size=TINY_OMNI.vocab_size, question_every=30)  # 2 s units
        policy = OmniPick(high_watermark=HIGH, low_watermark=LOW)
    else:
        model = omnijax.Decoder(minicpmo_llm_config().replace(**NARROW))
        # 1 s units without slices (slices pad every chunk of the stacked session to their length; their retention is
        # covered by the policy tests).
        chunks = synthetic.minicpm_duplex_session(3600, vocab_size=model.config.vocab_size, slices_every=0)
        policy = OmniPick(high_watermark=HIGH, low_watermark=LOW, source_image_whole=True)
    chunk_tokens = int(np.asarray(chunks.valid).sum(axis=(1, 2)).max())
    pages = -(-(HIGH + chunk_tokens) // 64) + 2  # the budget plus one unit: memory is bounded by construction
    result = omnijax.stream(model, chunks, policy=policy, page_size=64, num_pages=pages)
    retained = _flat_after_first_trim(result, chunk_tokens)
    total = int(np.asarray(chunks.valid).sum())
    assert total > 100_000 and retained[-1] < total // 40  # an hour of input, a bounded cache


def test_session_step_compiles_once():
    model = omnijax.Decoder(TINY_OMNI)
    chunks = synthetic.qwen_av_session(40, vocab_size=TINY_OMNI.vocab_size)
    session = omnijax.Session(model, policy=OmniPick(high_watermark=600, low_watermark=400), num_pages=16,
                              page_size=64)
    before = _step._cache_size()
    for i in range(chunks.token_ids.shape[0]):
        out = session.feed(jax.tree.map(lambda x: x[i], chunks))
    assert _step._cache_size() == before + 1
    assert int(out.stats.layout.retained_cells[0]) <= 600 and int(np.asarray(out.stats.evicted).sum()) >= 0


def test_qwen_unit_kinds():
    """Each unit kind streams units of `qwen_unit_tokens` tokens; the paper's 1 s unit is one 22x40 merged frame
    (h, w offsets from the unit's base), then 25 audio tokens at consecutive positions."""
    for kind in synthetic.QWEN_UNITS:
        chunks = synthetic.qwen_av_session(3, vocab_size=TINY_OMNI.vocab_size, unit_kind=kind)
        counts = np.asarray(chunks.valid).sum(axis=(1, 2))
        np.testing.assert_array_equal(counts, [24] + [synthetic.qwen_unit_tokens(kind)] * 3)
    assert synthetic.qwen_unit_tokens("paper") == 909
    session = synthetic.qwen_av_session(1, vocab_size=300, unit_kind="paper")
    t, h, w = np.asarray(session.positions)[1, :, 0]  # [A, T] of the unit, relative to its cursor
    video = slice(2, 2 + 880)
    np.testing.assert_array_equal(h[video], 1 + np.repeat(np.arange(22), 40))
    np.testing.assert_array_equal(w[video], 1 + np.tile(np.arange(40), 22))
    np.testing.assert_array_equal(t[2 + 880: 2 + 880 + 25], np.arange(1, 26))
    with pytest.raises(ValueError, match="unknown unit_kind"):
        synthetic.qwen_av_session(1, vocab_size=300, unit_kind="4k")


def test_first_fit_refills_every_hole_when_whole_units_go():
    """With the paper's 909-token units, OmniPick drops whole older units (their sinks do not fit the low
    watermark), and the native layout's first fit puts the next units into exactly those holes: each chunk that
    crosses the watermark attends over the packed span of its cells (the page-aligned `tile_skip` placement: at
    most one page more). Between trims the native span can be longer (the newest unit may sit above refilled
    holes)."""
    chunks = synthetic.qwen_av_session(12, vocab_size=TINY_OMNI.vocab_size, unit_kind="paper")
    model = omnijax.Decoder(TINY_OMNI.replace(num_layers=1))
    page = 64
    for paging, slack in (("native", 0), ("tile_skip", page)):
        result = omnijax.stream(model, chunks, policy=OmniPick(), impl="xla", num_pages=48, page_size=page,
                                paging=paging)
        attended = result.stats.attended
        cells = np.asarray(attended.retained_cells[:, 0])
        span = np.asarray(attended.physical_span[:, 0])
        trims = np.flatnonzero(np.asarray(result.stats.evicted[:, 0]) > 0)
        assert len(trims) >= 4
        np.testing.assert_array_equal(cells[trims], 24 + 3 * 909)  # the system prompt and three whole units
        np.testing.assert_array_equal(np.asarray(result.stats.layout.retained_cells[trims, 0]), 24 + 909)
        packed = -(-cells // page) * page
        assert (span >= packed).all(), paging
        assert (span[trims] <= packed[trims] + slack).all(), (paging, span[trims] - packed[trims])
