"""`DuplexDecodeRule` as a decoding strategy: the vectorised, jitted `select`/`warp` decide exactly as the host
reference `choose` on random batches (padded histories around the window, chunk_eos as the raw argmax, forbidden ids,
a positive or negative turn_eos logit), and a streamed answer decoded with the rule is the host loop of `choose`."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omnijax.decoding import check_decoding, stop_ids_of
from omnijax.models.minicpmo.duplex import DuplexDecodeRule
from omnijax.streaming.config import StreamConfig

V = 48
# Strong penalties and a short window, so that the penalties often change the decision.
RULE = DuplexDecodeRule(chunk_eos=5, turn_eos=7, listen=9, tts_bos=11, forbidden=(0, 3, 20, 21, 47),
                        repetition_penalty=1.6, turn_eos_penalty=2.5, history_window=4)


def _batch(rng, B=16):
    """Random logits `[B, V]` and histories `[B, N]` (-1 padding left, right or in between; N below and above the
    window), with rows whose raw argmax is chunk_eos and rows whose turn_eos logit is large and positive or
    negative."""
    logits = (rng.standard_normal((B, V)) * 2).astype(np.float32)
    logits -= rng.uniform(0, 3, (B, 1)).astype(np.float32)  # many negative logits, some rows all negative
    N = int(rng.integers(0, 10))
    history = rng.integers(0, 16, (B, N))  # few distinct ids, so the window often holds the top tokens
    history[rng.random((B, N)) < 0.3] = -1
    for b in range(B):
        kind = b % 4
        top = logits[b].max()
        if kind == 0:
            logits[b, RULE.chunk_eos] = top + rng.uniform(0.01, 1)  # step 1: the unit ends
        elif kind == 1:
            logits[b, RULE.turn_eos] = top + rng.uniform(0.01, 1)  # a positive top turn_eos (if top > 0)
        elif kind == 2:
            logits[b, RULE.turn_eos] = -abs(top) - rng.uniform(0, 1)  # a negative turn_eos
        if N and kind != 0 and rng.random() < 0.7:
            history[b, -1] = int(np.argmax(np.where(np.isin(np.arange(V), RULE.forbidden), -np.inf, logits[b])))
    return logits, history


def test_select_and_warp_decide_as_choose_on_random_batches():
    rng = np.random.default_rng(0)
    select = jax.jit(RULE.select)
    warp = jax.jit(RULE.warp)
    changed = 0
    for _ in range(60):
        logits, history = _batch(rng)
        want = [RULE.choose(logits[b], history[b]) for b in range(len(logits))]
        got = np.asarray(select(jnp.asarray(logits), jnp.asarray(history, jnp.int32)))
        np.testing.assert_array_equal(got, want)
        scores = np.asarray(warp(jnp.asarray(logits), jnp.asarray(history, jnp.int32)))
        np.testing.assert_array_equal(scores.argmax(-1), want)
        for b in range(len(logits)):
            finite = np.flatnonzero(np.isfinite(scores[b]))
            if logits[b].argmax() == RULE.chunk_eos:
                assert finite.tolist() == [RULE.chunk_eos]  # every other id is masked
                continue
            assert not np.isin([*RULE.forbidden, RULE.chunk_eos], finite).any()
            valid = history[b][history[b] >= 0]
            window = set(valid[max(0, len(valid) - RULE.history_window):].tolist())
            plain = np.setdiff1d(finite, [*window, RULE.turn_eos])
            np.testing.assert_array_equal(scores[b, plain], logits[b, plain])  # untouched ids keep their logit
            for i in window - set(RULE.forbidden) - {RULE.chunk_eos, RULE.turn_eos}:
                assert scores[b, i] == np.float32(logits[b, i]) / np.float32(RULE.repetition_penalty)
            masked_argmax = int(np.argmax(np.where(np.isin(np.arange(V), [*RULE.forbidden, RULE.chunk_eos]),
                                                   -np.inf, logits[b])))
            changed += want[b] != masked_argmax
    assert changed > 50  # the penalties decided often enough for the comparison to mean something
    # No history (None or all padding) is no penalty; and the rule is plain Python on one row.
    logits, _ = _batch(rng)
    none = np.asarray(RULE.select(jnp.asarray(logits)))
    np.testing.assert_array_equal(none, [RULE.choose(row, []) for row in logits])
    np.testing.assert_array_equal(np.asarray(RULE.select(jnp.asarray(logits), -jnp.ones((16, 5), jnp.int32))), none)


def test_window_edges_and_the_open_turn_substitution():
    logits = np.linspace(-1, 1, V).astype(np.float32)[None]  # the top id is V - 1, forbidden: 46 wins
    for history in ([46], [46, -1, 30, 31, 32], [46, 30, 31, 32, 33], [-1, 46, -1, 30, -1, 31, 32, -1, -1]):
        got = int(RULE.select(jnp.asarray(logits), jnp.asarray([history], jnp.int32))[0])
        assert got == RULE.choose(logits[0], history)
        inside = 46 in [t for t in history if t >= 0][-RULE.history_window:]
        assert (got == 46) != inside  # penalised only while among the last 4 valid ids
    for window in (0, 1):  # an empty window penalises nothing
        rule = dataclasses.replace(RULE, history_window=window)
        assert rule.choose(logits[0], [46, 45]) == int(rule.select(jnp.asarray(logits), jnp.asarray([[46, 45]]))[0])
    z = np.full(V, -1.0, np.float32)
    z[RULE.listen] = 1.0
    assert RULE.choose(z, []) == RULE.listen == int(RULE.select(jnp.asarray(z[None]))[0])
    assert RULE.choose(z, [], turn_open=True) == RULE.tts_bos  # the caller's substitution, on host only


def test_the_rule_is_a_static_strategy_and_refuses_bad_settings():
    rule = DuplexDecodeRule(chunk_eos=5, turn_eos=7, listen=9, tts_bos=11, forbidden=[3, 4])
    assert rule.forbidden == (3, 4) and hash(rule) == hash(dataclasses.replace(rule))
    assert check_decoding(rule) is rule and StreamConfig(decoding=rule).decoding is rule
    assert stop_ids_of(rule) == (5, 9)
    for bad, match in [(dict(chunk_eos=-1), "chunk_eos"), (dict(forbidden="ab"), "forbidden"),
                       (dict(forbidden=(1.5,)), "forbidden"), (dict(repetition_penalty=0.0), "repetition_penalty"),
                       (dict(turn_eos_penalty=-1.0), "turn_eos_penalty"), (dict(history_window=-1), "history_window"),
                       (dict(history_window=2.5), "history_window")]:
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(rule, **bad)


def test_a_streamed_answer_with_the_rule_is_the_host_loop_of_choose():
    import omnijax
    from omnijax.chunks.chunk import text_chunk
    from omnijax.decoding import Greedy
    from omnijax.models.config import TINY_OMNI
    from omnijax.models.decoder import Decoder

    model = Decoder(TINY_OMNI.replace(num_layers=1, eos_token_ids=()))
    vocab, n = model.config.vocab_size, 10
    prompts = [[17, 42, 99, 5, 250], [8, 8, 120, 64]]

    def streamed(decoding):
        session = omnijax.Session(model, StreamConfig(decoding=decoding, max_answer_tokens=n, num_pages=8,
                                                      page_size=8))
        return [np.asarray(session.feed(text_chunk(p, unit=u, answer_tokens=n)).tokens)[0]
                for u, p in enumerate(prompts)]

    def host_loop(rule):
        """The same session fed token by token, deciding with `choose` on the answer's own tokens."""
        replay = omnijax.Session(model, StreamConfig(decoding=Greedy(), max_answer_tokens=0, num_pages=8,
                                                     page_size=8))
        answers = []
        for u, prompt in enumerate(prompts):
            logits, decided = np.asarray(replay.feed(text_chunk(prompt, unit=u)).logits)[0], []
            while len(decided) < n and (not decided or decided[-1] not in rule.stop):
                decided.append(rule.choose(logits, decided))
                logits = np.asarray(replay.feed(text_chunk([decided[-1]], unit=u)).logits)[0]
            answers.append(np.asarray(decided + [-1] * (n - len(decided))))
        return answers

    plain = streamed(Greedy())[0]
    ids = dict(turn_eos=vocab - 2, listen=vocab - 3, tts_bos=vocab - 4, repetition_penalty=1.5, history_window=3)
    steered = DuplexDecodeRule(chunk_eos=vocab - 1, forbidden=(0, 1, int(plain[1])), **ids)  # greedy's 2nd id
    ending = DuplexDecodeRule(chunk_eos=int(plain[3]), forbidden=(0, 1, 2), **ids)  # raw argmax at the 4th step
    for rule in (steered, ending):
        got, want = streamed(rule), host_loop(rule)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
        if rule is steered:
            assert got[0][0] == plain[0] and (got[0] != plain).any()
        else:
            np.testing.assert_array_equal(got[0], list(plain[:4]) + [-1] * (n - 4))  # chunk_eos ended the answer
