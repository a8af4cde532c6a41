"""Runs a server speech pool (`omnijax.serve.engine.speech.SpeechPool` or the Qwen2.5-Omni pool) through a schedule
of utterances opened on given ticks, as the bounded-talker tests of both families do."""

from __future__ import annotations

from typing import Any

import numpy as np

from omnijax.kv import layout


def run_pool(pool: Any, plan: list[dict]) -> tuple[dict[str, list], int]:
    """Opens each utterance of `plan` at its tick (`at`; its `speech_id`, `prompt_ids`, `answer_ids`, `voice`,
    `max_new_tokens`) and ticks until the pool empties; checks that the pool gave back every page and reservation.

    Returns `{speech_id: chunks}` and the most live cells any talker row held after a tick."""
    got, tick, most = {u["speech_id"]: [] for u in plan}, 0, 0
    waiting = list(plan)
    while waiting or pool.busy:
        for u in [u for u in waiting if u["at"] <= tick]:
            pool.open(u["speech_id"], u["prompt_ids"], u["answer_ids"], voice=u["voice"],
                      max_new_tokens=u["max_new_tokens"])
            waiting.remove(u)
        for c in pool.tick():
            got[c.speech_id].append(c)
        most = max(most, int(np.max(np.asarray(layout.layout_stats(pool.kv).retained_cells))))
        tick += 1
        assert tick < 60, "the schedule did not finish"
    assert pool.reserved == 0 and int(pool.kv.num_free) == pool.config.num_pages
    return got, most
