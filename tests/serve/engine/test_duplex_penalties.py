"""A duplex stream's presence / frequency penalties cover its answer so far across units (issue 37 leftovers): the
counts are kept from one unit to the next and reset only by a unit that listens.

The tiny golden MiniCPM-o 4.5 checkpoint and conversation of `test_serve_duplex` (its fixtures), served through an
`EngineWorker`. Oracle: a plain-Python walk over the logits the stream returns (each decision's), which counts the
answer's tokens in a dict, subtracts OpenAI's penalties from each logit in Python floats and then applies the
release's rule (`DuplexDecodeRule.choose`, the rule's own reference): every decision must be the walk's, and the walk
with counts reset every unit, or with no penalties, must decide otherwise somewhere (so the check can fail).
"""

import dataclasses

import numpy as np
import pytest

from omnijax.serve.engine.duplex import AnswerPenalties, DuplexStream
from tests._support.engine_worker import on_worker
from tests.serve.engine.test_serve_duplex import _inputs, engine, golden, model  # noqa: F401 - fixtures

PRESENCE, FREQUENCY = 1.5, 1.0  # exact in float32, so Python's arithmetic rounds to the stream's
UNITS = 6


def _walk(results, rule, tokens, *, max_speak_tokens, force_listen, carry=True, penalise=True, listen_ends=True):
    """The reference decisions: `[(unit, index, decided, answer counted so far)]` for every decision the stream
    made, each one decided by the penalties of the plain-Python counts, then the rule."""
    ends = {tokens.listen, tokens.chunk_eos, tokens.chunk_tts_eos}
    answer, decoded, out = [], [], []
    for u, result in enumerate(results):
        if not carry:
            answer = []
        if u >= force_listen:
            ended_by_decision = len(result.tokens) < max_speak_tokens - 1
            for i in range(len(result.tokens) + (1 if ended_by_decision else 0)):
                z = [float(x) for x in result.logits[i]]
                counts = {}
                for t in answer:
                    counts[t] = counts.get(t, 0) + 1
                if penalise:
                    for t, c in counts.items():
                        z[t] -= FREQUENCY * c + PRESENCE
                history = decoded[max(0, len(decoded) - rule.history_window):]
                token = rule.choose(np.asarray(z, np.float32), history)
                out.append((u, i, token, len(answer)))
                if token in ends:
                    break
                answer.append(token)
                decoded.append(token)
        if result.listened and listen_ends:
            answer = []
    return out


def _actual(results, tokens, *, max_speak_tokens, force_listen):
    """What the stream decided, in `_walk`'s order (the ending decision: its kind, listen or another end)."""
    out = []
    for u, result in enumerate(results):
        if u < force_listen:
            continue
        out += [(u, i, t) for i, t in enumerate(result.tokens)]
        if len(result.tokens) < max_speak_tokens - 1:
            out.append((u, len(result.tokens), "listen" if result.listened else "end"))
    return out


def _kind(token, tokens):
    return token if token not in (tokens.listen, tokens.chunk_eos, tokens.chunk_tts_eos) else (
        "listen" if token == tokens.listen else "end")


@pytest.mark.parametrize("listen", [None, 606])  # 606: the second token unit 2 decides without a listen
def test_penalties_count_the_answer_across_units(model, golden, engine, listen):  # noqa: F811 - fixtures
    conv = _inputs(golden, seed=3, units=UNITS, frame_units=())
    speak, force = 4, 1
    rule, tokens = golden["rule"], golden["tokens"]
    if listen is not None:
        rule, tokens = dataclasses.replace(rule, listen=listen), dataclasses.replace(tokens, listen=listen)

    async def body(worker):
        stream = await DuplexStream.open(model, worker, "p", rule=rule, tokens=tokens,
                                         force_listen=force, max_speak_tokens=speak,
                                         penalties=AnswerPenalties(presence=PRESENCE, frequency=FREQUENCY))
        await stream.prepare(conv["prefix"], conv["suffix"], conv["ref"])
        return stream, [await stream.step(p, f) for p, f in zip(conv["pcm"], conv["frames"])]

    stream, results = on_worker(engine, body)
    kw = dict(max_speak_tokens=speak, force_listen=force)
    want = _walk(results, rule, tokens, **kw)
    got = _actual(results, tokens, **kw)
    assert [(u, i, _kind(t, tokens)) for u, i, t, _ in want] == got
    # the answer ran across units: some unit's first decision was penalised by an earlier unit's tokens
    assert any(i == 0 and counted for _, i, _, counted in want), want
    reset = _walk(results, rule, tokens, carry=False, **kw)
    plain = _walk(results, rule, tokens, penalise=False, **kw)
    kept = _walk(results, rule, tokens, listen_ends=False, **kw)

    def decided(walk):
        return [d[2] for d in walk]

    assert decided(reset) != decided(want), "the counts carried across units decided nothing"
    assert decided(plain) != decided(want), "the penalties decided nothing"
    # with `listen` an id the model decides in unit 2, that unit ends by listening and the answer starts again
    listened = [u for u, r in enumerate(results) if r.listened and u >= force]
    assert listened == ([] if listen is None else [2]), [r.listened for r in results]
    if listened:
        assert decided(kept) != decided(want), "ending the answer at a listening unit decided nothing"
    last = max(u for u, r in enumerate(results) if r.listened)
    assert stream.loop.answer == [t for u, _, t, _ in want if u > last] and len(stream.loop.answer) == 3 * (
        UNITS - 1 - last)


def test_answer_penalties_are_checked_and_applied_as_openai_defines_them():
    with pytest.raises(ValueError, match="presence"):
        AnswerPenalties(presence=2.5)
    with pytest.raises(ValueError, match="frequency"):
        AnswerPenalties(frequency=True)
    logits = np.asarray([1.0, 2.0, 3.0, 4.0], np.float32)
    out = AnswerPenalties(presence=0.5, frequency=0.25).apply(logits, [3, 1, 3, 3, 9])  # 9: outside, ignored
    np.testing.assert_array_equal(out, [1.0, 2.0 - 0.25 - 0.5, 3.0, 4.0 - 0.75 - 0.5])
    assert logits[3] == 4.0  # a copy
