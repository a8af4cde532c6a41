"""What both families' speech pools share (`omnijax.serve.engine.speech.SpeechPool`, Qwen3-Omni;
`omnijax.serve.engine.speech_qwen25.Qwen25SpeechPool`, Qwen2.5-Omni): the talker's paged KV pool, its page
reservations (an utterance reserves its prompt plus `max_new_tokens` cells up front, or with a bounded talker its
prompt or the budget plus one step's row, whichever is more) and the trim of the rows that wrote under the talker's
KV policy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from omnijax.kv import paged as paged_lib
from omnijax.models.talker_kv import bounded_capacity
from omnijax.serve.engine import speech_steps as steps
from omnijax.serve.engine.speech_config import SpeechConfig

__all__ = ["TalkerPages", "given_ids"]


def given_ids(x: Any) -> np.ndarray:
    """Token ids as given; an empty list as an empty int64 array (numpy reads `[]` as float)."""
    arr = np.asarray(x)
    return arr.astype(np.int64) if arr.ndim == 1 and arr.size == 0 else arr



class TalkerPages:
    """What both families' speech pools share: the talker's paged KV pool (`_empty`), its page reservations and the
    utterances in it. A pool sets `config` (`SpeechConfig`), `talker` (its talker config, with `decoder`),
    `max_pages`, `reserved`, `_utterances` (speech id -> utterance, in admission order), `kv` (the pool) and `_slots`
    (speech id -> its row)."""

    config: SpeechConfig
    talker: Any
    max_pages: int
    reserved: int
    _utterances: dict
    kv: paged_lib.PagedKV
    _slots: dict[str, int]

    def _empty(self, batch: int) -> paged_lib.PagedKV:
        d = self.talker.decoder
        return paged_lib.init(num_layers=d.num_layers, num_kv_heads=d.num_kv_heads, head_dim=d.head_dim,
                              num_pages=self.config.num_pages, page_size=self.config.page_size, batch=batch,
                              max_pages=self.max_pages, position_axes=3, dtype=d.jnp_dtype)

    # ------------------------------------------------------------------------------------------------ sessions
    @property
    def sessions(self) -> list[str]:
        """Utterances in the pool (decoding or with PCM still to send), in admission order."""
        return list(self._utterances)

    @property
    def busy(self) -> bool:
        """Whether a tick has work (an utterance in the pool)."""
        return bool(self._utterances)

    @property
    def capacity(self) -> int:
        """The most utterances at once (the largest row bucket)."""
        return self.config.rows[-1]

    @property
    def free_pages(self) -> int:
        """Talker pages not reserved by an admitted utterance."""
        return self.config.num_pages - self.reserved

    def pages_needed(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """Talker pages an utterance reserves: its prompt and `max_new_tokens` decoded tokens; with a bounded
        talker (`SpeechConfig.talker_window`) its prompt or the budget plus one step's row, whichever is more."""
        policy = self.config.talker_kv
        if policy is not None:
            return bounded_capacity(policy, int(prompt_tokens), self.config.page_size) // self.config.page_size
        return -(-(int(prompt_tokens) + int(max_new_tokens)) // self.config.page_size)

    def _trim(self, ids: list[str], next_pos: np.ndarray) -> None:
        """The rows of `ids` trimmed by the talker's KV policy after a write (nothing when unbounded)."""
        policy = self.config.talker_kv
        if policy is None:
            return
        active = np.zeros((self.kv.batch,), np.bool_)
        active[[self._slots[s] for s in ids]] = True
        self.kv = steps.trim(self.talker, policy, self.kv, np.asarray(next_pos, np.int32), active)
