"""The independent oracle of a bounded talker KV (`omnijax.models.talker_kv`): transformers' own talker, its decoder
run with an attention mask that hides exactly the cells a `SinkWindow(sink, window)` trim has dropped.

omnijax trims the talker's cache after its prefill and after every step, so the step that writes sequence index `i`
attends to `[0, sink) ∪ [i - window, i]` (all cells while `i <= sink + window`); the prefill reads its whole prompt.
transformers keeps every cell in its cache; `hidden_cells` replaces the 2-D attention mask its talker hands the
decoder on every one-token step with that set (the prefill untouched), so its greedy tokens are what the bounded
talker must decode."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def kept_cells(index: int, sink: int, window: int) -> list[int]:
    """The cells (sequence indices) the step writing `index` attends to under `SinkWindow(sink, window)`."""
    return sorted(set(range(min(sink, index + 1))) | set(range(max(0, index - window), index + 1)))


@contextlib.contextmanager
def hidden_cells(decoder: Any, sink: int, window: int) -> Iterator[list[int]]:
    """Within the block, every one-token call of `decoder` (a transformers talker's `model`) attends only to
    `kept_cells`; yields a list that gets, per step, how many cells its mask hid."""
    import torch

    hid: list[int] = []
    original = decoder.forward

    def forward(*args, **kwargs):
        embeds = kwargs.get("inputs_embeds")
        cache = kwargs.get("past_key_values")
        if embeds is not None and embeds.shape[1] == 1 and cache is not None:
            index = cache.get_seq_length()
            mask = torch.zeros((embeds.shape[0], index + 1), dtype=torch.long)
            mask[:, kept_cells(index, sink, window)] = 1
            given = kwargs.get("attention_mask")
            if given is not None:
                assert given.shape == mask.shape and bool(given.all()), "a talker mask with padding: not modelled"
            kwargs["attention_mask"] = mask
            hid.append(index + 1 - int(mask[0].sum()))
        return original(*args, **kwargs)

    decoder.forward = forward
    try:
        yield hid
    finally:
        del decoder.forward
