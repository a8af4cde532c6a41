"""MiniCPM-o 4.5 full-duplex decoding decisions: the release's greedy rule for each generated token of a unit.

Per decision, on the last-position logits `[V]` of what was fed so far:
    1. the raw argmax is `<|chunk_eos|>`: take it (the unit ends);
    2. otherwise forbidden ids (the TTS pad, the tokenizer's bad tokens, `<|chunk_eos|>` itself) get -inf;
    3. repetition penalty: the logit of every distinct id in the recent decode history (a window of the last
       `history_window` decoded tokens) is divided by `repetition_penalty` — divided even when negative, which
       raises it (the release does this; it is not the usual sign-aware penalty);
    4. the `<|turn_eos|>` logit is divided by `turn_eos_penalty` when positive, multiplied when negative;
    5. argmax; a decoded `<|listen|>` while the turn is open becomes `<|tts_bos|>`.
All in numpy on host: decisions are taken between jitted forward steps.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class DuplexDecodeRule:
    """The release's greedy duplex decision (token ids of the model's vocabulary)."""

    chunk_eos: int
    turn_eos: int
    listen: int
    tts_bos: int
    forbidden: tuple[int, ...] = ()
    repetition_penalty: float = 1.05
    turn_eos_penalty: float = 1.1
    history_window: int = 512

    def choose(self, logits: np.ndarray, history: Sequence[int], *, turn_open: bool = False) -> int:
        """One decision from last-position logits `[V]` and the ids decoded so far (oldest first)."""
        logits = np.asarray(logits, np.float64)
        if logits.ndim != 1:
            raise ValueError(f"logits must be [vocab], got shape {logits.shape}")
        if int(np.argmax(logits)) == self.chunk_eos:
            return self.chunk_eos
        z = logits.copy()
        z[[i for i in self.forbidden if i < z.shape[0]] + [self.chunk_eos]] = -np.inf
        recent = sorted({int(t) for t in list(history)[-self.history_window:] if 0 <= t < z.shape[0]})
        z[recent] = z[recent] / self.repetition_penalty
        t = self.turn_eos
        z[t] = z[t] / self.turn_eos_penalty if z[t] > 0 else z[t] * self.turn_eos_penalty
        token = int(np.argmax(z))
        return self.tts_bos if token == self.listen and turn_open else token
