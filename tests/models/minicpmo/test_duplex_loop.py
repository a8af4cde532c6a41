"""`DuplexLoop`, the sans-IO core of MiniCPM-o's duplex loop, on rigged logits (no model): what it asks to feed,
in order, and what it decides, against the loop written out by hand; and what it refuses before feeding anything."""

import types

import numpy as np
import pytest

from omnijax.chunks.spans import SpanKind
from omnijax.models.minicpmo.duplex import DuplexDecodeRule, DuplexTokens
from omnijax.models.minicpmo.duplex_loop import DuplexLoop, EncodedUnit, rows_chunks

V, D = 64, 8
TOKENS = DuplexTokens(unit_start=50, unit_end=51, image_start=52, image_end=53, listen=54, chunk_eos=55,
                      chunk_tts_eos=56)
RULE = DuplexDecodeRule(chunk_eos=55, turn_eos=57, listen=54, tts_bos=58, repetition_penalty=1.0)
MODEL = types.SimpleNamespace(audio=object(), vision=None, config=types.SimpleNamespace(vocab_size=V, hidden_size=D))


def one_hot(token: int) -> np.ndarray:
    logits = np.zeros(V, np.float32)
    logits[token] = 10.0
    return logits


def drive(program, answers):
    """Runs a program, answering each feed with the next logits of `answers`; returns (feeds, result)."""
    feeds, answers = [], iter(answers)
    try:
        request = next(program)
        while True:
            feeds.append(request)
            request = program.send(next(answers))
    except StopIteration as done:
        return feeds, done.value


def flat(feed):
    """A feed's rows as (token id or 'E<n>', kind) pairs."""
    return [(v if isinstance(v, int) else f"E{len(v)}", SpanKind(k)) for v, k in feed.items]


def unit(image=False):
    return EncodedUnit(audio=np.ones((10, D), np.float32), image=np.ones((1, 4, D), np.float32) if image else None,
                       mel_state="mel", audio_cache="cache")


def test_the_loop_feeds_and_decides_as_written_out():
    loop = DuplexLoop(MODEL, rule=RULE, tokens=TOKENS, max_speak_tokens=4, force_listen=1)
    feeds, _ = drive(loop.prepare([1, 2], [3], np.zeros((2, D), np.float32)), [one_hot(0)])
    assert [flat(f) for f in feeds] == [[(1, SpanKind.SYSTEM), (2, SpanKind.SYSTEM), ("E2", SpanKind.AUDIO),
                                         (3, SpanKind.SYSTEM)]]
    assert loop.prepared and feeds[0].unit == 0

    # Unit 1 is forced to listen: its inputs, then <|listen|> </unit>, whatever the logits say.
    feeds, result = drive(loop.unit(unit(image=True)), [one_hot(7), one_hot(0)])
    assert [flat(f) for f in feeds] == [
        [(50, SpanKind.BOUNDARY), (52, SpanKind.BOUNDARY), ("E4", SpanKind.IMAGE), (53, SpanKind.BOUNDARY),
         ("E10", SpanKind.AUDIO)],
        [(54, SpanKind.BOUNDARY), (51, SpanKind.BOUNDARY)]]
    assert result.listened and result.tokens == [] and {f.unit for f in feeds} == {1}
    assert loop._mel_state == "mel" and loop._audio_cache == "cache"  # committed once the unit feeds

    # Unit 2 speaks 7, 8, 9 (max_speak_tokens - 1 = 3 decisions), then <|chunk_eos|> </unit> close it.
    feeds, result = drive(loop.unit(unit()), [one_hot(7), one_hot(8), one_hot(9), one_hot(11), one_hot(0)])
    assert [flat(f) for f in feeds][1:] == [[(7, SpanKind.RESPONSE)], [(8, SpanKind.RESPONSE)],
                                            [(9, SpanKind.RESPONSE)], [(55, SpanKind.BOUNDARY),
                                                                       (51, SpanKind.BOUNDARY)]]
    assert result.tokens == [7, 8, 9] and not result.listened and len(result.logits) == 4
    # Unit 3 decides <|listen|> first: the unit ends with it, nothing spoken.
    feeds, result = drive(loop.unit(unit()), [one_hot(54), one_hot(0)])
    assert [flat(f) for f in feeds][1:] == [[(54, SpanKind.BOUNDARY), (51, SpanKind.BOUNDARY)]]
    assert result.listened and result.tokens == []
    assert loop.decoded == [7, 8, 9] and loop.units == 3 and {f.unit for f in feeds} == {3}


def test_decisions_use_the_history_window():
    rule = DuplexDecodeRule(chunk_eos=55, turn_eos=57, listen=54, tts_bos=58, repetition_penalty=2.0,
                            history_window=1)
    loop = DuplexLoop(MODEL, rule=rule, tokens=TOKENS, force_listen=0)
    logits = np.zeros(V, np.float32)
    logits[[7, 8]] = [3.0, 2.0]
    assert loop.decide(logits) == 7
    loop.decoded += [7]
    assert loop.decide(logits) == 8  # 7 is penalised (3 / 2 < 2)
    loop.decoded += [8]
    assert loop.decide(logits) == 7  # only the last id is in the window


def test_refusals_feed_nothing():
    with pytest.raises(TypeError, match="DuplexDecodeRule"):
        DuplexLoop(MODEL, rule="greedy", tokens=TOKENS)
    with pytest.raises(ValueError, match="max_speak_tokens"):
        DuplexLoop(MODEL, rule=RULE, tokens=TOKENS, max_speak_tokens=0)
    with pytest.raises(ValueError, match="audio encoder"):
        DuplexLoop(types.SimpleNamespace(audio=None), rule=RULE, tokens=TOKENS)
    loop = DuplexLoop(MODEL, rule=RULE, tokens=TOKENS)
    with pytest.raises(RuntimeError, match="prepare"):
        loop.unit(unit())
    with pytest.raises(ValueError, match=r"\[0, 64\)"):
        loop.prepare([V], [])
    with pytest.raises(ValueError, match="vision encoder"):
        loop.encode(np.zeros(16000, np.float32), frame=np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(ValueError, match="16000"):
        loop.encode(np.zeros(100, np.float32))
    assert not loop.prepared and loop.units == 0 and loop._unit_id == 0
    drive(loop.prepare([], []), [])  # an empty system part feeds nothing and prepares
    assert loop.prepared
    with pytest.raises(RuntimeError, match="already prepared"):
        loop.prepare([1], [])


def test_rows_chunks_split_a_feed_at_the_width():
    items = [(1, SpanKind.SYSTEM), (np.ones((5, D)), SpanKind.AUDIO), (2, SpanKind.BOUNDARY)]
    chunks = rows_chunks(items, 4, D, width=3)
    assert [c.length for c in chunks] == [3, 3, 1]
    assert np.concatenate([c.span[0] for c in chunks]).tolist() == [SpanKind.SYSTEM] + [SpanKind.AUDIO] * 5 + [
        SpanKind.BOUNDARY]
    assert np.concatenate([c.offset[0] for c in chunks]).tolist() == [0, 0, 1, 2, 3, 4, 0]
    assert chunks[-1].embeds is None and all(int(c.unit[0, 0]) == 4 for c in chunks)
