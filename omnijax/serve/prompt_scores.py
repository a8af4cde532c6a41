"""Log-probabilities of every token of a text under the served model: what `POST /v1/completions` returns for
`echo` + `logprobs`.

The engine's streamed step returns the logits of a chunk's last token only (what an answer starts from), so scoring
a prompt takes the model's one-shot forward (`omnijax.models.forward.forward`, the forward `Model()` runs) over the
whole text, with full context: each token's log-probability given every token before it. One jitted program per
length bucket (powers of two from `MIN_BUCKET`): the text is right-padded to its bucket, padding masked out, so a
server compiles a handful of programs whatever the lengths it is sent. Log-softmax, the chosen tokens' values and
the top `TOP_K` are taken on the device; only `[L]` and `[L, TOP_K]` arrays come back to the host.

The values are the raw distribution (before temperature or top-p, as vLLM returns by default).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from omnijax.kept_executables import cached_jit
from omnijax.models.forward import forward
from omnijax.streaming.session import model_parts

TOP_K = 5  # the most alternatives a request may ask for (the legacy completions API's `logprobs` cap)
MIN_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class TokenScores:
    """Scores of a text of `n` tokens.

    Attributes:
        logprobs: `[n]` float32: token i's log-probability given tokens 0..i-1 (entry 0 is NaN: nothing precedes
            it).
        top_ids: `[n, TOP_K]` int32: the most likely tokens at position i (given tokens 0..i-1), most likely first
            (row 0 is -1).
        top_logprobs: `[n, TOP_K]` float32: their log-probabilities (row 0 is NaN).
    """

    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


def bucket_length(n: int) -> int:
    """The padded length a text of `n` tokens is scored at: the next power of two, at least `MIN_BUCKET`."""
    return max(MIN_BUCKET, 1 << max(0, int(n) - 1).bit_length())


@cached_jit(static_argnames=("graphdef", "page_size"))
def _score(graphdef: Any, params: Any, ids: jax.Array, valid: jax.Array, positions: jax.Array, *,
           page_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`[1, L]` ids -> (log p(ids[i+1] | ids[:i+1]) `[L]`, top ids `[L, TOP_K]`, top log p `[L, TOP_K]`), the
    predictions made at each position i."""
    logits = forward(graphdef, params, ids, valid, positions, None, None, None, page_size=page_size)
    logp = jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)  # [L, V]
    following = jnp.concatenate([ids[0, 1:], ids[0, :1]])  # the token after each position (the last: unused)
    chosen = jnp.take_along_axis(logp, following[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logp, TOP_K)
    return chosen, top_ids, top_lp


class PromptScorer:
    """Scores texts with a model's one-shot forward (see the module docstring).

    Args:
        model: a loaded omnijax model (`omnijax.Model` or another family with a text decoder).
        max_tokens: the longest text scored; longer ones are refused (`ValueError` naming the cap).
        page_size: page size of the forward's temporary cache.
    """

    def __init__(self, model: Any, *, max_tokens: int, page_size: int = 64):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.graphdef, self.params = model_parts(model)
        config = model.config
        self.vocab_size = int(config.vocab_size)
        self.position_axes = int(config.position_axes)
        self.max_tokens, self.page_size = int(max_tokens), int(page_size)
        self._compiled: set[int] = set()  # the length buckets scored once (their program compiled)

    def compiled(self, n: int) -> bool:
        """Whether a text of `n` tokens is scored by a program already compiled (its bucket was scored before). A
        server runs a first scoring of a bucket off the engine's thread, so its compilation does not hold the
        engine's ticks."""
        return bucket_length(n) in self._compiled

    def score(self, ids: Sequence[int]) -> TokenScores:
        """The scores of `ids` (`[n]` token ids, 1 <= n <= `max_tokens`, each in the vocabulary). Blocking: a server
        runs it on the engine's thread (`EngineWorker.in_engine`), between ticks, once `compiled(n)`."""
        n = len(ids)
        if not 1 <= n <= self.max_tokens:
            raise ValueError(f"a scored text holds 1 to {self.max_tokens} tokens (--max-scored-tokens), got {n}")
        array = np.asarray(ids, np.int64)
        if array.min() < 0 or array.max() >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got range [{array.min()}, "
                             f"{array.max()}]")
        length = bucket_length(n)
        padded = np.zeros((1, length), np.int32)
        padded[0, :n] = array
        valid = np.zeros((1, length), bool)
        valid[0, :n] = True
        positions = np.broadcast_to(np.arange(length, dtype=np.int32), (self.position_axes, 1, length))
        chosen, top_ids, top_lp = _score(self.graphdef, self.params, jnp.asarray(padded), jnp.asarray(valid),
                                         jnp.asarray(positions), page_size=self.page_size)
        self._compiled.add(length)
        # position i predicts token i + 1: shift so entry i belongs to token i
        logprobs = np.full(n, np.nan, np.float32)
        logprobs[1:] = np.asarray(chosen)[:n - 1]
        ids_out = np.full((n, TOP_K), -1, np.int32)
        ids_out[1:] = np.asarray(top_ids)[:n - 1]
        lps_out = np.full((n, TOP_K), np.nan, np.float32)
        lps_out[1:] = np.asarray(top_lp)[:n - 1]
        return TokenScores(logprobs, ids_out, lps_out)
