"""The per-row token constraint a response may carry: a host-side object that says, before each decoded token, which
tokens the row may draw next (structured output's grammar matcher implements it).

The engine decodes a constrained row one token at a time (`omnijax.serve.engine.decode_loop`): before each token it
asks `bitmask()`, packs the rows' masks into one `[B, ceil(V / 32)] int32` array, and the one-token step sets every
disallowed token's logit to -inf before the sampling processors (the returned logprobs stay those of the raw
distribution, but a masked token is never drawn). After the token is drawn it calls `accept(token)`; once
`finished()` is True the row ends at once with finish_reason "stop".

`V` is the width of the model's logits (`Engine.vocab_size`, the checkpoint's `vocab_size`, which can exceed the
tokenizer's size: a constraint must leave those padding ids cleared).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class TokenConstraint(Protocol):
    """What `EngineWorker.respond(..., constraint=...)` accepts (all methods run in the engine's thread)."""

    def bitmask(self) -> np.ndarray:
        """The tokens allowed as the NEXT token: int32 `[ceil(V / 32)]`, bit `j % 32` of word `j // 32` set when token
        `j` is allowed (an all-zero mask is an error: the row fails, naming it)."""
        ...

    def accept(self, token: int) -> None:
        """Advances past the drawn `token` (always one `bitmask()` allowed)."""
        ...

    def finished(self) -> bool:
        """Whether the constrained output is complete: the row stops here (finish_reason "stop")."""
        ...


def mask_words(vocab_size: int) -> int:
    """int32 words in one row's bitmask: `ceil(vocab_size / 32)`."""
    return -(-int(vocab_size) // 32)


def pack_allowed(allowed: Iterable[int], vocab_size: int) -> np.ndarray:
    """A bitmask (int32 `[ceil(V / 32)]`) allowing exactly the token ids in `allowed` (a helper for constraints and
    tests). Raises ValueError for an id outside [0, vocab_size)."""
    ids = np.asarray(sorted(set(int(t) for t in allowed)), np.int64)
    if ids.size and (ids[0] < 0 or ids[-1] >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got {ids[0]}..{ids[-1]}")
    bits = np.zeros(mask_words(vocab_size) * 32, np.uint8)
    bits[ids] = 1
    return np.packbits(bits.reshape(-1, 32)[:, ::-1], axis=1).view(">u4").astype(np.uint32).view(np.int32).ravel()


def unpack_allowed(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """The boolean `[..., vocab_size]` allowed-token array of bitmask(s) `[..., ceil(V / 32)]` (numpy reference)."""
    words = np.ascontiguousarray(mask, "<i4")  # each word's bytes least significant first, whatever the machine
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")  # bit j of word w at 32 * w + j
    return bits[..., :vocab_size].view(bool)
