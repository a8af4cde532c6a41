"""`RowSampling`'s per-row processors inside the compiled step (issue 37 item 1): logit bias, presence / frequency /
repetition penalties, temperature, min-p, top-k, top-p and the raw log probabilities, each row with its own values.

Oracles: a plain numpy reference of every processor in vLLM's order (`reference_warp`), transformers' logits
processors where one exists (each alone, on a batch whose rows hold different values), and greedy answers decoded
token by token on the host with the reference against the answer the compiled step decodes. A snapshot taken in the
middle of an answer and resumed in another engine continues it token for token.
"""

import dataclasses

import jax
import numpy as np
import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import omnijax
from omnijax.chunks.chunk import Chunk, text_chunk
from omnijax.decoding import (
    MAX_LOGIT_BIAS,
    MAX_TOP_LOGPROBS,
    RowSampling,
    row_logprobs,
    row_warp,
    sampling_row,
)
from omnijax.models.config import TINY_OMNI
from omnijax.serve.engine import snapshot as snapshot_lib
from omnijax.serve.engine.engine import Engine, EngineConfig, _engine_step

V = 64


def reference_warp(logits, counts, seen, *, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0,
                   frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=None):
    """One row's scores, processor by processor in vLLM's order, in float32 numpy."""
    x = np.asarray(logits, np.float32).copy()
    for token, bias in (logit_bias or {}).items():
        x[token] += np.float32(bias)
    factor = np.where(seen, np.float32(repetition_penalty), np.float32(1.0))
    x = np.where(x > 0, x / factor, x * factor).astype(np.float32)
    x = x - np.float32(frequency_penalty) * counts.astype(np.float32)
    x = x - np.float32(presence_penalty) * (counts > 0).astype(np.float32)
    if temperature > 0 and temperature != 1.0:
        x = x / np.float32(temperature)
    if min_p > 0:
        p = np.exp(x - x.max())
        p /= p.sum()
        x = np.where(p < np.float32(min_p) * p.max(), -np.inf, x)
    if 0 < top_k < x.size:
        x = np.where(x < np.sort(x)[-top_k], -np.inf, x)
    if top_p < 1.0:  # vLLM: sort ascending, drop while the cumulative mass is <= 1 - top_p, keep the top token
        order = np.argsort(x, kind="stable")
        p = np.exp(x[order].astype(np.float64) - x.max())
        drop = np.cumsum(p / p.sum()) <= 1.0 - top_p
        drop[-1] = False
        x = x.copy()
        x[order[drop]] = -np.inf
    return x.astype(np.float32)


def _batch(rng, settings):
    B = len(settings)
    logits = (rng.normal(size=(B, V)) * 3).astype(np.float32)
    counts = np.where(rng.random((B, V)) < 0.2, rng.integers(1, 4, (B, V)), 0).astype(np.int32)
    seen = (counts > 0) | (rng.random((B, V)) < 0.2)
    rows = np.stack([sampling_row(s.get("temperature", 0.0), s.get("top_p", 1.0),
                                  **{k: v for k, v in s.items() if k not in ("temperature", "top_p")})
                     for s in settings])
    return logits, counts, seen, rows


MIXED = [dict(), dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_k=5, presence_penalty=1.5),
         dict(temperature=1.0, min_p=0.2, frequency_penalty=-0.7), dict(repetition_penalty=1.4),
         dict(temperature=0.5, repetition_penalty=0.8, presence_penalty=-2.0, frequency_penalty=2.0, top_k=7,
              top_p=0.8, min_p=0.05, logit_bias={3: 100.0, 9: -100.0, 11: 2.5}),
         dict(temperature=2.0, logit_bias={i: float(i % 7) - 3 for i in range(MAX_LOGIT_BIAS // 4)})]


def test_mixed_rows_in_one_batch_equal_the_reference_row_by_row():
    rng = np.random.default_rng(0)
    for trial in range(5):
        logits, counts, seen, rows = _batch(rng, MIXED)
        got = np.asarray(jax.jit(row_warp)(logits, rows, counts, seen))
        for b, settings in enumerate(MIXED):
            want = reference_warp(logits[b], counts[b], seen[b], **settings)
            assert np.array_equal(np.isinf(got[b]), np.isinf(want)), (trial, b, settings)
            finite = np.isfinite(want)
            np.testing.assert_allclose(got[b][finite], want[finite], rtol=1e-6, atol=1e-6, err_msg=str(settings))


def test_rows_that_use_nothing_are_unchanged_and_one_processor_does_not_touch_other_rows():
    rng = np.random.default_rng(1)
    logits, counts, seen, rows = _batch(rng, [dict(), dict(temperature=1.0), dict(repetition_penalty=2.0,
                                                                                  top_k=3, logit_bias={1: 50.0})])
    got = np.asarray(row_warp(logits, rows, counts, seen))
    assert np.array_equal(got[0], logits[0]) and np.array_equal(got[1], logits[1])
    assert not np.array_equal(got[2], logits[2])


@pytest.mark.parametrize("name", ["repetition", "top_k", "min_p", "top_p", "temperature", "bias"])
def test_each_processor_equals_transformers(name):
    """Each processor alone, one value per row (rows with different values in one batch), against transformers'."""
    rng = np.random.default_rng(2)
    values = {"repetition": [0.5, 1.0, 1.3, 2.0], "top_k": [1, 4, 0, 20], "min_p": [0.0, 0.05, 0.3, 0.9],
              "top_p": [1.0, 0.9, 0.5, 0.1], "temperature": [1.0, 0.3, 1.7, 0.9],
              "bias": [{}, {2: 5.0}, {2: -100.0, 5: 100.0}, {7: 0.25, 8: -0.5, 60: 3.0}]}[name]
    key = {"repetition": "repetition_penalty", "bias": "logit_bias"}.get(name, name)
    settings = [{key: v} for v in values]
    logits, counts, seen, rows = _batch(rng, settings)
    got = np.asarray(row_warp(logits, rows, counts, seen))
    for b, value in enumerate(values):
        scores = torch.from_numpy(logits[b:b + 1].copy())
        history = torch.from_numpy(np.flatnonzero(seen[b])[None].astype(np.int64))
        if name == "repetition":
            want = RepetitionPenaltyLogitsProcessor(value)(history, scores)
        elif name == "top_k":
            want = TopKLogitsWarper(value)(history, scores) if value else scores
        elif name == "min_p":
            want = MinPLogitsWarper(value)(history, scores) if value else scores
        elif name == "top_p":
            want = TopPLogitsWarper(value)(history, scores) if value < 1 else scores
        elif name == "temperature":
            want = TemperatureLogitsWarper(value)(history, scores)
        else:
            want = SequenceBiasLogitsProcessor([[[t], v] for t, v in value.items()])(history, scores) if value \
                else scores
        want = want.numpy()[0]
        assert np.array_equal(np.isinf(got[b]), np.isinf(want)), (name, value)
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[b][finite], want[finite], rtol=1e-6, err_msg=f"{name}={value}")


def test_frequency_and_presence_penalties_follow_openai():
    """OpenAI's formula: mu[j] - c[j] * frequency - (c[j] > 0) * presence, over the answer's counts only."""
    rng = np.random.default_rng(3)
    settings = [dict(frequency_penalty=f, presence_penalty=p) for f, p in ((0.5, 0.0), (0.0, 1.0), (-1.0, 2.0))]
    logits, counts, seen, rows = _batch(rng, settings)
    got = np.asarray(row_warp(logits, rows, counts, seen))
    for b, s in enumerate(settings):
        want = logits[b] - counts[b] * s["frequency_penalty"] - (counts[b] > 0) * s["presence_penalty"]
        np.testing.assert_allclose(got[b], want, rtol=1e-6, atol=1e-6)


def test_logprobs_are_the_raw_distribution_and_its_top_tokens():
    rng = np.random.default_rng(4)
    logits, _, _, rows = _batch(rng, [dict(top_logprobs=0), dict(temperature=0.5, top_logprobs=5),
                                      dict(top_logprobs=MAX_TOP_LOGPROBS, repetition_penalty=3.0), dict()])
    token = np.asarray([3, 7, 11, 13], np.int32)
    chosen, ids, values = (np.asarray(x) for x in row_logprobs(logits, token, rows))
    logp = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    for b in range(3):  # raw: temperature and penalties do not change them (vLLM's default)
        assert abs(chosen[b] - logp[b, token[b]]) < 1e-5
        if b == 0:  # top_logprobs 0: the chosen token's only
            assert not ids[b].any() and not values[b].any()
            continue
        np.testing.assert_array_equal(ids[b], np.argsort(-logp[b], kind="stable")[:MAX_TOP_LOGPROBS])
        np.testing.assert_allclose(values[b], np.sort(logp[b])[::-1][:MAX_TOP_LOGPROBS], atol=1e-5)
    assert chosen[3] == 0 and not ids[3].any()  # a row that does not ask gets nothing


def test_bad_settings_are_refused_by_name():
    for bad, match in ((dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency"),
                       (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"), (dict(top_logprobs=21), "top_logprobs"),
                       (dict(logit_bias={5: 101.0}), r"logit_bias\[5\]"), (dict(logit_bias={-1: 1.0}), "token id"),
                       (dict(logit_bias={V: 1.0}, vocab_size=V), "token id"), (dict(repetition_penalty=0.0), "repet"),
                       (dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}), "entries")):
        with pytest.raises(ValueError, match=match):
            sampling_row(1.0, **bad)


# --------------------------------------------------------------------------------------------------- in the step
def _continuation(unit: int, n: int, T: int = 1) -> Chunk:
    """An empty chunk asking for `n` more tokens of the answer `unit` (as a server's continuation)."""
    z = np.zeros((1, T), np.int32)
    return Chunk(token_ids=z, valid=np.zeros((1, T), bool), positions=np.zeros((1, 1, T), np.int32), unit=z,
                 span=z, offset=z, answer_tokens=np.asarray([n], np.int32), answer_unit=np.asarray([unit], np.int32),
                 advance=np.zeros((1,), np.int32))


SETTINGS = dict(repetition_penalty=1.8, frequency_penalty=1.2, presence_penalty=0.6, logit_bias={5: 4.0, 17: -3.0})


def test_greedy_answers_with_penalties_equal_a_host_loop_with_the_reference():
    """The compiled step's greedy answer over several blocks (counts carried across continuation chunks) equals
    choosing each token on the host from the model's logits with `reference_warp`."""
    model = omnijax.Decoder(TINY_OMNI)
    prompt = [7, 5, 5, 9, 17, 23, 42]
    config = omnijax.StreamConfig(num_pages=16, page_size=8, max_answer_tokens=3, decoding=RowSampling())
    session = omnijax.Session(model, config)
    row = sampling_row(0.0, **SETTINGS)[None]
    tokens = []
    out = session.feed(dataclasses.replace(text_chunk(prompt, answer_tokens=3), sampling=row))
    tokens += [int(t) for t in np.asarray(out.tokens)[0]]
    for _ in range(2):
        out = session.feed(dataclasses.replace(_continuation(1, 3), sampling=row))
        tokens += [int(t) for t in np.asarray(out.tokens)[0]]

    probe = omnijax.Session(model, omnijax.StreamConfig(num_pages=16, page_size=8, max_answer_tokens=0))
    logits = np.asarray(probe.feed(text_chunk(prompt)).logits)[0]
    counts, seen, want = np.zeros(TINY_OMNI.vocab_size, np.int32), np.zeros(TINY_OMNI.vocab_size, bool), []
    seen[prompt] = True
    for _ in range(9):
        token = int(np.argmax(reference_warp(logits, counts, seen, **SETTINGS)))
        want.append(token)
        counts[token] += 1
        seen[token] = True
        logits = np.asarray(probe.feed(text_chunk([token], unit=1)).logits)[0]
    assert tokens == want
    assert len(set(tokens)) > 3  # the penalties did change the answer: plain greedy repeats on the random model


def _engine(decoding=None):
    stream = omnijax.StreamConfig(num_pages=32, page_size=8, max_answer_tokens=4,
                                  decoding=decoding or RowSampling(seed=3))
    return Engine(omnijax.Decoder(TINY_OMNI), EngineConfig(stream, chunk_tokens=8, buckets=(4,),
                                                           return_logits=False))


ROWS = {"plain": sampling_row(0.0), "hot": sampling_row(1.1, 0.95, top_k=40, min_p=0.02, top_logprobs=3, **SETTINGS),
        "greedy": sampling_row(0.0, presence_penalty=2.0, top_logprobs=0), "temp": sampling_row(0.9)}


def _answers(engine, ticks, sessions=ROWS, start=0, snapshot_at=None):
    out = {s: [] for s in sessions}
    lps = {s: [] for s in sessions}
    for tick in range(start, ticks):
        for s, row in sessions.items():
            chunk = text_chunk([11 + tick, 12, 13, 12], unit=0) if tick == 0 else _continuation(1, 4)
            engine.submit(s, dataclasses.replace(chunk, sampling=row[None]), 4)
        for s, frame in engine.tick().outputs.items():
            out[s] += frame.tokens
            lps[s] += frame.logprobs or []
        if snapshot_at == tick:
            return out, lps, {s: engine.export_session(s) for s in sessions}
    return out, lps, None


def test_engine_rows_mixed_one_program_and_snapshot_resume_mid_answer(tmp_path):
    """Four sessions with different settings in one engine: one compiled step for every value; logprobs come back
    for the rows that ask, as many alternatives as asked; snapshots taken after the second block, written to disk,
    read back and imported into a new engine, continue every answer exactly as the uninterrupted engine."""
    engine = _engine()
    for s in ROWS:
        engine.open(s)
    before = _engine_step._cache_size()
    whole, lps, _ = _answers(engine, 4)
    assert _engine_step._cache_size() - before <= 1  # one program for every row's values
    assert all(len(whole[s]) == 16 for s in ROWS)
    assert not lps["plain"] and not lps["temp"]
    assert len(lps["hot"]) == 16 and all(len(top) == 3 for _, top in lps["hot"])
    assert len(lps["greedy"]) == 16 and all(top == [] and lp <= 0 for lp, top in lps["greedy"])
    assert whole["greedy"] != whole["plain"]  # the presence penalty changed the greedy answer

    first = _engine()
    for s in ROWS:
        first.open(s)
    part, part_lps, snaps = _answers(first, 4, snapshot_at=1)
    resumed = _engine()
    for s, snap in snaps.items():
        path = snapshot_lib.save_snapshot(tmp_path / s, snap)
        loaded = snapshot_lib.load_snapshot(path)
        np.testing.assert_array_equal(loaded.counts, snap.counts)
        np.testing.assert_array_equal(loaded.seen, snap.seen)
        resumed.import_session(s, loaded)
    assert int(snaps["hot"].counts.sum()) == 8 and snaps["hot"].seen.sum() >= 3  # mid-answer history kept
    rest, rest_lps, _ = _answers(resumed, 4, start=2)
    for s in ROWS:
        assert part[s] + rest[s] == whole[s], s
        assert part_lps[s] + rest_lps[s] == lps[s], s


def test_new_input_starts_a_new_answer_and_session_history_is_kept():
    """A chunk that feeds tokens zeroes the answer counts; `seen` keeps the session's prompt and answer tokens."""
    engine = _engine()
    engine.open("a")
    engine.submit("a", dataclasses.replace(text_chunk([1, 2, 3], answer_tokens=4),
                                           sampling=ROWS["hot"][None]), 4)
    answer = engine.tick().outputs["a"].tokens
    row = engine.slot("a")
    assert int(np.asarray(engine.state.counts)[row].sum()) == len(answer)
    engine.submit("a", dataclasses.replace(text_chunk([4, 5], unit=2), sampling=ROWS["hot"][None]), 0)
    engine.tick()
    state = jax.device_get(engine.state)
    assert int(state.counts[row].sum()) == 0
    assert set(np.flatnonzero(state.seen[row])) == {1, 2, 3, 4, 5} | set(answer)


def test_a_version_1_snapshot_loads_with_an_empty_history(tmp_path):
    """Snapshots written before the penalty history (format version 1: no `counts`, `seen`) still load."""
    import json

    engine = _engine()
    engine.open("a")
    engine.submit("a", dataclasses.replace(text_chunk([1, 2, 3], answer_tokens=4), sampling=ROWS["hot"][None]), 4)
    engine.tick()
    snap = engine.export_session("a")
    assert snap.counts.sum() == 4 and snap.seen.sum() >= 3
    path = snapshot_lib.save_snapshot(tmp_path / "v1", snap)
    manifest = json.loads((path / snapshot_lib.MANIFEST).read_text())
    manifest["format_version"] = 1
    del manifest["arrays"]["counts"], manifest["arrays"]["seen"]
    (path / snapshot_lib.MANIFEST).write_text(json.dumps(manifest))
    old = snapshot_lib.load_snapshot(path)
    assert not old.counts.any() and not old.seen.any() and old.counts.shape == (TINY_OMNI.vocab_size,)
    np.testing.assert_array_equal(old.k, snap.k)
    manifest["format_version"] = 4
    (path / snapshot_lib.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(snapshot_lib.SnapshotFormatError, match="format_version 4"):
        snapshot_lib.load_snapshot(path)
