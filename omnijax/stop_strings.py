"""Stop strings matched on streamed text: the OpenAI `stop` parameter.

An answer arrives as text pieces (an incremental detokeniser's deltas); a stop string may span pieces and tokens. The
answer ends as soon as its text holds a stop string (the first to be complete; of several complete at the same
character, the one that starts first) and is cut just before it: the stop string itself is never returned (as the
OpenAI API does). `StopMatcher` sees each piece once and holds back only the tail of the text that
could still begin a stop string, so a streamed answer never sends text that a later piece turns into a stop.

    matcher = StopMatcher(check_stops(["\\n\\n", "User:"]))
    for piece in pieces:
        out = matcher.push(piece)   # send `out`; `matcher.stopped` says the answer ended
        if matcher.stopped:
            break
    out = matcher.flush()           # what was held back, when the answer ended without a stop
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_STOPS = 4  # as the OpenAI API
MAX_STOP_CHARS = 1_000  # one stop string, in characters


def check_stops(value: object, *, field: str = "stop") -> tuple[str, ...]:
    """The stop strings of a request's `stop` value (None, a string, or a list of strings).

    Args:
        value: what the request holds.
        field: the parameter's name, for the error message.

    Returns:
        The stop strings, in the order given, without repeats (empty when `value` is None or []).

    Raises:
        ValueError: not a string or list of strings; more than `MAX_STOPS`; an empty string; one longer than
            `MAX_STOP_CHARS` characters (each named).
    """
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError(f"'{field}' must be a string or a list of strings, got {value!r}")
    if len(stops) > MAX_STOPS:
        raise ValueError(f"'{field}' holds {len(stops)} strings; at most {MAX_STOPS} are accepted")
    for i, s in enumerate(stops):
        if not s:
            raise ValueError(f"'{field}[{i}]' is an empty string; a stop string needs at least one character")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"'{field}[{i}]' is {len(s)} characters, over the {MAX_STOP_CHARS} accepted")
    return tuple(dict.fromkeys(stops))


class StopMatcher:
    """Cuts a streamed text before the first stop string to complete in it.

    Attributes:
        stops: the stop strings (none: every piece passes through whole).
        stopped: a stop string was found; later pieces are dropped.
        matched: the stop string found (None until then).
    """

    def __init__(self, stops: Sequence[str]):
        if any(not s for s in stops):
            raise ValueError("a stop string needs at least one character")
        self.stops = tuple(stops)
        self.stopped = False
        self.matched: str | None = None
        self._held = ""  # the tail of the text so far that is a proper prefix of some stop string

    def push(self, piece: str) -> str:
        """Adds the next piece of the answer.

        Returns:
            The text that can be sent now: everything before a stop string, less the tail that may still start one.
        """
        if self.stopped:
            return ""
        text = self._held + piece
        found = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if found:
            at, self.matched = _first_complete(found)
            self.stopped, self._held = True, ""
            return text[:at]
        hold = max((_overlap(text, s) for s in self.stops), default=0)
        self._held = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold]

    def flush(self) -> str:
        """The held-back tail, for an answer that ended without a stop string (empty once stopped)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


def _overlap(text: str, stop: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0


def _first_complete(found: list[tuple[int, str]]) -> tuple[int, str]:
    """Of `(start, stop)` occurrences, the one that ends first (of those ending together, the one starting first)."""
    return min(found, key=lambda f: (f[0] + len(f[1]), f[0]))
