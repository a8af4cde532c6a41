"""Metronome engine, telemetry and admission: batched ticks match sessions run alone, SinkWindow bounds the pool,
unbounded serving stalls visibly and on the first-order model's schedule, AIMD, and the row helpers.

Tiny decoder; compiled programs: the SinkWindow step at buckets 2 and 4, the NoSlide step at bucket 4, and one
batch-1 `Session` oracle.
"""

import dataclasses
import json

import numpy as np
import pytest

import omnijax
from omnijax.chunks.chunk import pad_chunk, text_chunk
from omnijax.kv.paged import PageClass
from omnijax.models.config import TINY_OMNI
from omnijax.retention.base import NoSlide, sequence_view
from omnijax.retention.baselines import SinkWindow
from omnijax.serve.engine.admission import AIMD, Overloaded
from omnijax.serve.engine.engine import DuplicateSession, Engine, EngineConfig, pick_bucket, reset_row, take_rows
from omnijax.serve.engine.telemetry import Telemetry, linear_fit

S, W, P, NUM_PAGES, T, TAU = 4, 16, 8, 48, 8, 2
STREAM = omnijax.StreamConfig(policy=SinkWindow(S, W), num_pages=NUM_PAGES, page_size=P, max_answer_tokens=TAU,
                              impl="xla")
CONFIG = EngineConfig(stream=STREAM, chunk_tokens=T, buckets=(2, 4), frame_budget_s=1.0)
UNBOUNDED = dataclasses.replace(CONFIG, stream=STREAM.replace(policy=NoSlide()))


@pytest.fixture(scope="module")
def decoder():
    return omnijax.Decoder(TINY_OMNI)


def _chunk(rng, n, unit):
    return text_chunk(rng.integers(0, TINY_OMNI.vocab_size, n), unit=unit)


def _alone(decoder):
    return omnijax.Session(decoder, STREAM)


# ---------------------------------------------------------------------------------------------- (a) equivalence
def test_batched_ticks_match_each_session_alone_across_join_and_leave(decoder):
    engine, rng = Engine(decoder, CONFIG), np.random.default_rng(0)
    alone = {}
    buckets = []
    for tick in range(9):
        if tick == 0:
            for s in ("a", "b"):
                engine.open(s)
                alone[s] = _alone(decoder)
        if tick == 3:  # c joins mid-way: 3 sessions -> bucket 4
            engine.open("c")
            alone["c"] = _alone(decoder)
        if tick == 5:  # a leaves: b and c are compacted back into bucket 2
            engine.close("a")
        sent = {}
        for s in engine.sessions:
            if s == "b" and tick in (1, 4):  # b skips frames: a different phase
                continue
            chunk, answer = _chunk(rng, int(rng.integers(2, T + 1)), tick), int(rng.integers(0, TAU + 1))
            engine.submit(s, chunk, answer)
            sent[s] = (chunk, answer)
        report = engine.tick()
        buckets.append(report.bucket)
        assert set(report.outputs) == set(sent)
        for s, (chunk, answer) in sent.items():
            ref = alone[s].feed(dataclasses.replace(pad_chunk(chunk, T), answer_tokens=np.asarray([answer], np.int32)))
            out = report.outputs[s]
            np.testing.assert_allclose(out.logits, np.asarray(ref.logits[0]), atol=1e-5, rtol=0)
            assert out.tokens == [int(t) for t in np.asarray(ref.tokens[0]) if t >= 0] and len(out.tokens) == answer
            assert not out.preempted and out.dropped == 0
    assert buckets == [2, 2, 2, 4, 4, 2, 2, 2, 2]
    assert engine.sessions == ["b", "c"] and sorted([engine.slot("b"), engine.slot("c")]) == [0, 1]
    assert engine.telemetry.events == [] and engine.telemetry.counters["tokens"] > 0


# ------------------------------------------------------------------------------------------- (b) sink window
def _steady(engine, sessions, ticks, tokens, answer, unit0=0):
    rng = np.random.default_rng(1)
    reports = []
    for tick in range(ticks):
        for s in sessions:
            engine.submit(s, _chunk(rng, tokens, unit0 + tick), answer)
        reports.append(engine.tick())
    return reports


def test_sink_window_keeps_first_s_and_last_w_and_frees_pages_behind_the_window(decoder):
    sessions = ["s0", "s1", "s2", "s3"]
    bounded, unbounded = Engine(decoder, CONFIG), Engine(decoder, UNBOUNDED)
    for engine in (bounded, unbounded):
        for s in sessions:
            engine.open(s)
    ticks = 10
    rb = _steady(bounded, sessions, ticks, T, 0)
    ru = _steady(unbounded, sessions, ticks, T, 0)

    kv = bounded.state.kv
    view = sequence_view(kv)
    written = ticks * T
    for s in sessions:
        r = bounded.slot(s)
        live = np.asarray(view.live[r])
        order = np.sort(np.asarray(view.order[r])[live])
        assert order.tolist() == list(range(S)) + list(range(written - W, written))
        pos = np.asarray(view.pos[:, r])[:, live]  # [A, live]: positions not re-indexed, all three axes
        assert np.array_equal(np.sort(pos, axis=1), np.broadcast_to(order, pos.shape))
        assert int(bounded.state.next_pos[r]) == written
    # Pages behind the window went back to the pool: every page in a table holds a live slot, none leaked.
    table = np.asarray(kv.page_table)
    held = table[table >= 0]
    assert len(set(held.tolist())) == len(held) and np.asarray(kv.valid)[held].any(axis=1).all()
    assert len(held) + int(kv.num_free) == NUM_PAGES
    assert (np.asarray(kv.page_class)[held] != PageClass.FREE).all()

    occ_b = [r.occupancy for r in rb]
    occ_u = [r.occupancy for r in ru]
    # plateau: at most 4 pages per session (20 live tokens over 3-4 pages), no growth after the window filled
    assert max(occ_b) == max(occ_b[:6]) <= 4 * 4 / NUM_PAGES
    assert all(b > a for a, b in zip(occ_u, occ_u[1:]))  # unbounded keeps rising (one page per session per tick)
    assert occ_u[-1] == 4 * ticks / NUM_PAGES
    frees = [r.free_pages for r in rb]
    assert any(b > a for a, b in zip(frees, frees[1:]))  # emptied pages came back to the pool mid-stream
    fit = bounded.telemetry.saturation_fit(fit_ticks=ticks)
    assert fit is not None and fit.slope < unbounded.telemetry.saturation_fit(fit_ticks=ticks).slope
    assert bounded.telemetry.events == [] and unbounded.telemetry.events == []


# ---------------------------------------------------------------------------------- (c) exhaustion and stall
def test_unbounded_pool_exhausts_visibly_and_on_the_predicted_tick(decoder):
    engine = Engine(decoder, UNBOUNDED)
    sessions = ["u0", "u1", "u2", "u3"]
    for s in sessions:
        engine.open(s)
    reports = _steady(engine, sessions, 18, 5, TAU)  # 7 tokens per session per tick: 28 of 384 slots
    kinds = [e.kind for r in reports for e in r.events]
    assert "pool_exhausted" in kinds and "session_preempted" in kinds and "empty_frames" in kinds
    first = next(i for i, r in enumerate(reports) if any(e.kind == "pool_exhausted" for e in r.events))
    assert all(r.events == [] and len(o.tokens) == TAU for r in reports[:first] for o in r.outputs.values())
    assert sum(r.outputs[s].dropped for r in reports for s in sessions) > 0
    preempted_at = {}
    for i, r in enumerate(reports):
        for e in r.events:
            if e.kind == "session_preempted":
                preempted_at.update({s: i for s in e.sessions})
    assert sorted(preempted_at) == sessions and engine.preempted == sessions
    for s, i in preempted_at.items():  # from preemption on, the session's frames come back empty
        assert all(r.outputs[s].preempted and r.outputs[s].tokens == [] and r.outputs[s].logits is None
                   for r in reports[i:])
    last = reports[-1]
    assert last.running == 0 and last.waiting == 4 and last.tokens == 0 and last.occupancy > 0.95
    counters = engine.telemetry.counters
    assert counters["sessions_preempted"] == 4 and counters["empty_frames"] > 0 and counters["dropped_tokens"] > 0

    fit = engine.telemetry.saturation_fit(fit_ticks=4)
    assert fit.measured_tick == first and fit.sessions == 4
    assert abs(fit.rho0) < 0.05 and fit.slope == pytest.approx(4 / NUM_PAGES)  # one page per session per tick
    assert fit.relative_error <= 0.1 and abs(fit.t_sat_ticks - first) / first <= 0.1, fit
    json.dumps({"rows": engine.telemetry.rows(), "events": engine.telemetry.event_rows(),
                "summary": engine.telemetry.summary()})

    # (e, integrated) closing a preempted session returns its pages; closing all empties the pool
    before = engine.free_pages
    engine.close("u0")
    assert engine.free_pages > before and "u0" not in engine.preempted
    for s in sessions[1:]:
        engine.close(s)
    assert engine.free_pages == NUM_PAGES and engine.sessions == []


# ---------------------------------------------------------------------------------------------- (d) admission
def test_aimd_increase_decrease_floor_and_rejection():
    aimd = AIMD(target_fraction=0.6, frame_budget_s=1.0, alpha=1, beta=0.7, min_cap=2, initial_cap=10, window=2)
    assert aimd.target_s == pytest.approx(0.6)
    assert aimd.observe(0.1, current=10) == 10  # first sample of the window: no step yet
    assert aimd.observe(0.2, current=10) == 11  # headroom and the cap binds: +alpha
    assert aimd.step(0.1, current=3) == 11  # headroom but the cap does not bind: hold
    assert aimd.step(0.6, current=11) == 7  # at the target: floor(11 * 0.7)
    assert aimd.step(0.9) == 4 and aimd.step(0.9) == 2 and aimd.step(5.0) == 2  # the floor holds
    assert [h["action"] for h in aimd.history] == ["increase", "hold", "decrease", "decrease", "decrease",
                                                   "decrease"]
    assert aimd.admit(1) and not aimd.admit(2)
    aimd.check(1)
    with pytest.raises(Overloaded, match=r"2 sessions open, AIMD admission cap 2") as err:
        aimd.check(2)
    assert err.value.cap == 2 and err.value.current == 2 and err.value.latency_s == 5.0
    # a spike in a window causes one decrease, then the window starts afresh
    aimd = AIMD(frame_budget_s=0.1, initial_cap=10, window=3, statistic="max")
    caps = [aimd.observe(x, current=10) for x in (0.01, 0.2, 0.01, 0.01, 0.01, 0.01)]
    assert caps == [10, 10, 7, 7, 7, 8] and aimd.steps == 2  # then a clean window probes upward
    assert AIMD(max_cap=5, initial_cap=5).step(0.0) == 5
    # p95 interpolates linearly between order statistics (numpy's default): 4.8 of 1..5, not the nearest 5
    for statistic, want in (("p95", 4.8), ("mean", 3.0), ("max", 5.0)):
        aimd = AIMD(frame_budget_s=100.0, window=5, statistic=statistic)
        for x in (5.0, 1.0, 4.0, 2.0, 3.0):
            aimd.observe(x)
        assert aimd.steps == 1 and aimd.last_latency_s == pytest.approx(want, abs=1e-12), statistic
    with pytest.raises(ValueError):
        AIMD(beta=1.5)


def test_aimd_recovers_on_an_idle_server():
    """A burst cuts the cap; idle intervals (no ticks, so no measurements) step it back to `initial_cap` by alpha,
    never past it, and drop the stale pending samples (issue: after a load burst the cap stayed at 1-2 for good)."""
    aimd = AIMD(frame_budget_s=1.0, initial_cap=4, alpha=1, window=2)
    aimd.observe(0.1, current=4)  # a pending sample of the old load
    for _ in range(4):
        aimd.step(5.0, current=4)
    assert aimd.cap == 1
    assert [aimd.recover() for _ in range(5)] == [2, 3, 4, 4, 4]
    assert [h["action"] for h in aimd.history[-3:]] == ["recover"] * 3 and aimd.steps == 7
    assert aimd.observe(0.1, current=4) == 4  # the old sample is gone: a window needs two fresh ones
    probing = AIMD(initial_cap=4, window=1)
    assert probing.observe(0.0, current=4) == 5 and probing.recover() == 5  # above the start: recover leaves it


@pytest.mark.parametrize("change, message", [
    (dict(buckets=(4, 2)), "ascending order"),
    (dict(max_pages=0), "max_pages must be >= 1"),
    (dict(chunk_tokens=0), "chunk_tokens must be >= 1"),
    (dict(frame_budget_s=0.0), "frame_budget_s must be positive"),
    (dict(fit_fraction=1.5), r"fit_fraction must lie in \(0, 1\]"),
    (dict(stream=STREAM.replace(num_pages=None)), r"shared pool needs a size: give StreamConfig\(num_pages=...\)"),
])
def test_engine_config_refuses_bad_settings(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(CONFIG, **change)


@pytest.mark.parametrize("change, error, message", [
    (dict(policy="sink_window"), TypeError, r"not the name 'sink_window': use omnijax.retention.get_policy"),
    (dict(page_size=48), ValueError, "page_size must be a power of two, got 48"),
    (dict(num_pages=0), ValueError, "num_pages must be a positive int"),
    (dict(impl="cuda"), ValueError, "unknown attention impl 'cuda'"),
    (dict(paging="compact"), ValueError, "unknown paging mode 'compact'"),
])
def test_the_engine_stream_settings_are_refused_where_they_are_built(change, error, message):
    with pytest.raises(error, match=message):
        STREAM.replace(**change)
    with pytest.raises(TypeError, match="EngineConfig.stream must be an omnijax.StreamConfig"):
        EngineConfig(stream=dict(STREAM.__dict__, **change))


def test_telemetry_fit_on_a_synthetic_linear_ramp():
    tel = Telemetry(100, frame_budget_s=0.5)
    for t in range(22):  # 5 pages per tick from 5 pages: full at the end of tick 18, first drop in tick 19
        used = min(100, 5 * (t + 1) + 5)
        tel.record(start_s=0.5 * t, latency_s=0.01, used_pages=used, running=4, waiting=0, served=4, tokens=8,
                   bucket=4, dropped={"x": 3} if t >= 19 else {}, pool_empty=used == 100)
    fit = tel.saturation_fit()  # first 25%: 6 ticks
    assert fit.fit_ticks == 6 and fit.rho0 == pytest.approx(0.05) and fit.slope == pytest.approx(0.05)
    assert fit.t_sat_ticks == pytest.approx(19.0) and fit.t_sat_s == pytest.approx(9.5)
    assert fit.t_sat_wall_s == pytest.approx(9.01) and fit.rate == pytest.approx(0.0125)  # fills at the end of tick 18
    assert fit.measured_tick == 19 and fit.measured_full_tick == 18 and fit.relative_error == pytest.approx(0.0)
    assert fit.measured_s == pytest.approx(9.5)
    assert tel.counters["pool_exhausted_ticks"] == 3 and tel.summary()["stalled"]
    assert linear_fit([0, 1, 2], [1, 3, 5]) == pytest.approx((1.0, 2.0))
    flat = Telemetry(10)
    for t in range(4):
        flat.record(start_s=t, latency_s=0.0, used_pages=3, running=1, waiting=0, served=1, tokens=0, bucket=1)
    assert flat.saturation_fit().t_sat_ticks == float("inf") and flat.saturation_fit().to_dict()["t_sat_ticks"] is None


# -------------------------------------------------------------------------------------------- (e) row helpers
def test_reset_row_frees_exactly_that_rows_pages_and_session_errors(decoder):
    engine = Engine(decoder, CONFIG)
    for s in ("a", "b", "c"):
        engine.open(s)
    _steady(engine, ["a", "b", "c"], 3, T, 1)
    state = engine.state
    kv = state.kv
    table = np.asarray(kv.page_table)
    row = engine.slot("b")
    mine = table[row][table[row] >= 0]
    assert len(mine) > 0
    new = reset_row(state, row)
    nk = new.kv
    assert int(nk.num_free) == int(kv.num_free) + len(mine)
    assert sorted(np.asarray(nk.free_stack)[int(kv.num_free):int(nk.num_free)].tolist()) == sorted(mine.tolist())
    others = np.arange(table.shape[0]) != row
    assert np.array_equal(np.asarray(nk.page_table)[others], table[others])
    assert (np.asarray(nk.page_table)[row] == -1).all()
    cls, ncls = np.asarray(kv.page_class), np.asarray(nk.page_class)
    rest = np.setdiff1d(np.arange(NUM_PAGES), mine)
    assert (ncls[mine] == PageClass.FREE).all() and np.array_equal(ncls[rest], cls[rest])
    assert not np.asarray(nk.valid)[mine].any() and np.array_equal(np.asarray(nk.valid)[rest],
                                                                    np.asarray(kv.valid)[rest])
    for name in ("seq_slots", "next_order", "dropped"):
        got, was = np.asarray(getattr(nk, name)), np.asarray(getattr(kv, name))
        assert got[row] == 0 and np.array_equal(got[others], was[others])
    assert not bool(nk.exhausted[row]) and int(new.next_pos[row]) == 0 and int(state.next_pos[row]) == 3 * (T + 1)

    grown = take_rows(state, [0, 1, 2, -1, -1])  # grow: two fresh rows
    assert grown.kv.batch == 5 and (np.asarray(grown.kv.page_table)[3:] == -1).all()
    assert np.array_equal(np.asarray(grown.kv.page_table)[:3], table[:3]) and int(grown.next_pos[4]) == 0
    moved = take_rows(state, [2, 0])
    assert np.array_equal(np.asarray(moved.kv.page_table), table[[2, 0]])
    assert np.array_equal(np.asarray(moved.next_pos), np.asarray(state.next_pos)[[2, 0]])
    assert pick_bucket(3, (2, 4)) == 4 and pick_bucket(5, (2, 4)) is None

    with pytest.raises(DuplicateSession) as err:
        engine.open("a")
    assert isinstance(err.value, KeyError) and isinstance(err.value, ValueError)
    with pytest.raises(KeyError):
        engine.close("nope")
    with pytest.raises(KeyError):
        engine.submit("nope", text_chunk([1]), 0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        engine.submit("a", text_chunk(list(range(T + 1))), 0)
    with pytest.raises(ValueError, match="answer_tokens"):
        engine.submit("a", text_chunk([1]), TAU + 1)
    engine.open("d")
    with pytest.raises(Overloaded, match="at most 4 sessions"):
        engine.open("e")
    engine.close("d")  # never ticked: it has no row yet
    free = engine.free_pages
    engine.close("b")
    assert engine.free_pages == free + len(mine) and engine.sessions == ["a", "c"]


def test_telemetry_numerics_keep_their_definitions():
    # linear_fit (np.polyfit) is the closed-form least-squares line it replaced; equal x give (mean y, 0).
    rng = np.random.default_rng(5)
    for n in (2, 3, 17):
        xs, ys = rng.uniform(0, 30, n).tolist(), rng.uniform(0, 1, n).tolist()
        mx, my = sum(xs) / n, sum(ys) / n
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        assert linear_fit(xs, ys) == pytest.approx((my - b * mx, b), rel=1e-9, abs=1e-12)
    assert linear_fit([2.0, 2.0, 2.0], [1.0, 2.0, 6.0]) == (3.0, 0.0)
    assert linear_fit([0.0, 1.0, 2.0], [0.3, 0.3, 0.3]) == (0.3, 0.0)  # flat: slope exactly 0
    with pytest.raises(ValueError, match="no points"):
        linear_fit([], [])
    # summary() latency percentiles are nearest-rank: the order statistic at round(q / 100 * (n - 1)), half to even.
    for n in (1, 2, 5, 10, 21, 41):
        tel = Telemetry(100)
        lat = rng.uniform(0.0, 1.0, n).tolist()
        for t, x in enumerate(lat):
            tel.record(start_s=float(t), latency_s=x, used_pages=1, running=1, waiting=0, served=1, tokens=1,
                       bucket=1, dropped={}, pool_empty=False)
        srt = sorted(lat)
        summary = tel.summary()
        for q in (50, 95):
            assert summary[f"latency_p{q}_s"] == srt[int(round(q / 100 * (n - 1)))], (n, q)
        assert summary["latency_max_s"] == srt[-1]
