"""MiniCPM-o 4.5's full-duplex loop driven synchronously over `omnijax.Session`: a system prompt with a reference
voice clip, then one unit per second of input, each answered (or listened to) by the release's decision rule.

The loop itself (what to feed, the decisions) is `omnijax.models.minicpmo.duplex_loop.DuplexLoop`, the sans-IO core
the serving path (`omnijax.serve.engine.duplex.DuplexStream`) drives too; this module only feeds it to a `Session`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Generator, Sequence

import numpy as np

from omnijax.chunks.chunk import pad_chunk
from omnijax.models.minicpmo.duplex import DuplexDecodeRule, DuplexTokens, UnitResult
from omnijax.models.minicpmo.duplex_loop import DuplexDriver, DuplexFeed, DuplexLoop, rows_chunks
from omnijax.retention.base import NoSlide, RetentionPolicy
from omnijax.streaming.session import Session

if TYPE_CHECKING:
    from omnijax.models.minicpmo.model import MiniCPMOModel

__all__ = ["DuplexSession"]


class DuplexSession(DuplexDriver):
    """The 4.5 full-duplex loop on one `MiniCPMOModel` and its own `omnijax.Session`.

    The LLM runs through `omnijax.Session` (the streaming scan's jitted step; every chunk is padded to `chunk_width`
    rows with embeddings, so it compiles once; a longer feed takes several chunks); the audio runs through the
    streaming Whisper encoder with its own cache; decisions are the loop's (`DuplexLoop.decide`, the rule's `choose`).
    Positions are session indices (1D RoPE).

    Args:
        model: a `MiniCPMOModel` with its audio encoder.
        rule, tokens, max_speak_tokens, force_listen, max_slice_nums: the loop's (`DuplexLoop`).
        num_pages, page_size, policy: the session's KV pool and retention policy (default `NoSlide`).
        chunk_width: rows per compiled chunk.

    Attributes:
        loop: the `DuplexLoop` (its `decoded` history, `units`, `markers`).
        session: the `omnijax.Session` fed.
    """

    def __init__(self, model: MiniCPMOModel, *, rule: DuplexDecodeRule, tokens: DuplexTokens | None = None,
                 max_speak_tokens: int = 4, force_listen: int = 1, num_pages: int = 64, page_size: int = 64,
                 chunk_width: int = 128, max_slice_nums: int = 1, policy: RetentionPolicy | None = None):
        self.loop = DuplexLoop(model, rule=rule, tokens=tokens, max_speak_tokens=max_speak_tokens,
                               force_listen=force_listen, max_slice_nums=max_slice_nums)
        self.model, self.width = model, int(chunk_width)
        self.session = Session(model, policy=policy or NoSlide(), num_pages=num_pages, page_size=page_size)

    def prepare(self, prefix_ids: Sequence[int], suffix_ids: Sequence[int], ref_audio: np.ndarray | None = None
                ) -> None:
        """The system part: `prefix_ids`, the reference clip's offline audio embeddings, `suffix_ids`."""
        reference = None if ref_audio is None else self.loop.encode_reference(ref_audio)
        self._run(self.loop.prepare(prefix_ids, suffix_ids, reference))

    def step(self, pcm: np.ndarray, frame: np.ndarray | None = None) -> UnitResult:
        """One unit: `<unit>` [`<image>` frame `</image>`] audio, then the listen/speak decision and its tokens."""
        return self._run(self.loop.unit(self.loop.encode(pcm, frame)))

    def feed(self, feed: DuplexFeed) -> np.ndarray:
        """Feeds one `DuplexFeed` (as chunks of `chunk_width` rows); returns its last-position logits `[V]`.

        Raises RuntimeError once the pool has run out (some row was not cached), rather than decide on without it.
        """
        D = self.model.config.hidden_size
        logits = None
        for chunk in rows_chunks(feed.items, feed.unit, D, self.width):
            if chunk.embeds is None:  # one compiled shape: every chunk carries (zero) embedding rows
                chunk = dataclasses.replace(chunk, embeds=np.zeros((1, chunk.length, D), np.float32),
                                            embed_mask=np.zeros((1, chunk.length), bool))
            out = self.session.feed(pad_chunk(chunk, self.width))
            logits = np.asarray(out.logits[0])  # waits for the step
            if bool(out.stats.layout.exhausted[0]):
                # A decision made without the rows the pool could not hold would be silently wrong from here on.
                raise RuntimeError(f"the duplex session's KV pool ran out: {int(out.stats.layout.dropped[0])} "
                                   f"token(s) were not cached; give a larger num_pages (now "
                                   f"{self.session.state.kv.num_pages}) or a policy that bounds the cache")
        return logits

    def _run(self, program: Generator[DuplexFeed, np.ndarray, Any]) -> Any:
        """Runs a loop program to its end, feeding each request; returns its result."""
        try:
            request = next(program)
            while True:
                request = program.send(self.feed(request))
        except StopIteration as done:
            return done.value
