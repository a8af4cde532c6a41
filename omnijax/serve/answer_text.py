"""An answer's text as its tokens arrive, cut at the request's stop strings (chat completions' `stop`)."""

from __future__ import annotations

from typing import Any

from omnijax.stop_strings import StopMatcher

# an engine answer's status -> the OpenAI finish_reason (a stop string also gives "stop")
FINISH = {"completed": "stop", "incomplete": "length", "cancelled": "stop"}


class AnswerText:
    """An answer's text as its tokens arrive: detokenised token by token and cut before the first stop string to
    complete (`omnijax.stop_strings.StopMatcher`; no stop strings: the text passes through whole).

    Attributes:
        tokens: the answer's tokens read so far (after a stop, those up to the one that completed it).
    """

    def __init__(self, decoder: Any, stops: tuple[str, ...]):
        self.decoder, self.matcher, self.tokens = decoder, StopMatcher(stops), 0

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    def push(self, tokens: list[int]) -> str:
        """The text that can be sent after `tokens` (tokens after a stop are not read)."""
        out = []
        for token in tokens:
            if self.matcher.stopped:
                break
            self.tokens += 1
            out.append(self.matcher.push(self.decoder.push([token])))
        return "".join(out)

    def flush(self) -> str:
        """What is left when the answer ended without a stop string (empty after one)."""
        return "" if self.matcher.stopped else self.matcher.push(self.decoder.flush()) + self.matcher.flush()

    def finish_reason(self, answer: Any) -> str:
        return "stop" if self.matcher.stopped else FINISH[answer.status]

    def completion_tokens(self, answer: Any) -> int:
        """The tokens the answer used: up to the stop string's last token, or all that were decoded."""
        return self.tokens if self.matcher.stopped else len(answer.tokens)
