"""Stop strings on streamed text (`omnijax.stop_strings`) against a plain whole-text reading, over random splits."""

from __future__ import annotations

import random

import pytest

from omnijax.stop_strings import MAX_STOPS, StopMatcher, check_stops


def first_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """The plain reading: grow the text one character at a time; at the first length where it ends with a stop string
    (the longest such, i.e. the one starting first), cut before it."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return text[:end - len(stop)], stop
    return text, None


def streamed(pieces: list[str], stops: list[str]) -> tuple[str, str | None, bool]:
    matcher = StopMatcher(stops)
    out = []
    for piece in pieces:
        out.append(matcher.push(piece))
        if matcher.stopped:
            break
    out.append(matcher.flush())
    return "".join(out), matcher.matched, matcher.stopped


def split(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(0, len(text) - 1))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_streamed_cut_equals_the_whole_text_reading_over_random_texts_stops_and_splits():
    rng = random.Random(0)
    stopped = 0
    for _ in range(3000):
        text = "".join(rng.choice("ab\nc") for _ in range(rng.randint(1, 24)))
        stops = ["".join(rng.choice("ab\nc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 4))]
        want_text, want_stop = first_stop(text, stops)
        got_text, got_stop, got_stopped = streamed(split(rng, text), stops)
        assert (got_text, got_stop) == (want_text, want_stop), (text, stops)
        assert got_stopped == (want_stop is not None)
        stopped += got_stopped
    assert 500 < stopped < 2900  # both outcomes exercised


def test_a_stop_spanning_pieces_is_never_sent_and_a_false_start_is_released():
    matcher = StopMatcher(["</answer>"])
    assert matcher.push("42 </ans") == "42 "  # "</ans" might begin the stop: held
    assert matcher.push("wer") == ""
    assert matcher.push("> more") == ""
    assert matcher.stopped and matcher.matched == "</answer>"
    matcher = StopMatcher(["</answer>"])
    assert matcher.push("a </an") == "a "
    assert matcher.push("d b") == "</and b"  # not the stop after all: released at once
    assert matcher.flush() == "" and not matcher.stopped


def test_the_first_stop_to_complete_wins_over_one_that_starts_earlier():
    # "bc" completes at character 4, before "xabcd" could: the answer is cut before "bc", as a server must decide
    # when the text first holds a stop string.
    assert streamed(["xab", "cd"], ["xabcd", "bc"])[:2] == ("xa", "bc")
    assert first_stop("xabcd", ["xabcd", "bc"]) == ("xa", "bc")


def test_without_stops_every_piece_passes_through():
    matcher = StopMatcher([])
    assert [matcher.push(p) for p in ("a", "", "bc")] == ["a", "", "bc"] and matcher.flush() == ""


@pytest.mark.parametrize(("value", "want"), [(None, ()), ("\n", ("\n",)), ([], ()), (["a", "b", "a"], ("a", "b"))])
def test_check_stops_reads_a_string_or_a_list(value, want):
    assert check_stops(value) == want


@pytest.mark.parametrize(("value", "message"), [
    (["a"] * (MAX_STOPS + 1), "at most 4"), ([""], r"'stop\[0\]' is an empty string"), (3, "string or a list"),
    (["a", 1], "string or a list"), (["x" * 1001], "over the 1000"),
])
def test_check_stops_refuses_by_name(value, message):
    with pytest.raises(ValueError, match=message):
        check_stops(value)
