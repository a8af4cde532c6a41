"""Synthetic session layouts for endurance tests and benchmarks: realistic unit structure and token counts, no media.

Retention and paging read only the layout (span kinds, units, positions), so these sessions carry token ids folded
into a small vocabulary instead of encoder embeddings.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from omnijax.chunks.chunk import Chunk, pad_chunk, stack_chunks
from omnijax.models.minicpmo import layout as minicpmo
from omnijax.models.qwen2_5_omni import layout as qwen

# A 2 s Qwen2.5-Omni unit at 2 fps with 280x392 frames: grid (2, 10, 14) -> 70 video tokens, 50 audio tokens.
QWEN_UNIT_GRID = (2, 10, 14)
QWEN_UNIT_AUDIO = 50
# Qwen2.5-Omni units by name: (video grid t/h/w in patches, audio tokens, seconds per temporal patch).
#   "2s":    the default above, 124 tokens per unit (62 per second).
#   "paper": OmniTide's streaming setup, video at 1 fps with aligned 1 s audio (§7.1), one 616x1120 frame per
#            unit (the processor repeats it to fill the temporal patch of 2): 880 video + 25 audio + 4 markers =
#            909 tokens per second, the rate of the paper's 7B run (220K tokens in 241 s, about 913 per second).
QWEN_UNITS = {"2s": (QWEN_UNIT_GRID, QWEN_UNIT_AUDIO, 1.0), "paper": ((1, 44, 80), 25, 2.0)}


def _qwen_unit(unit_kind: str):
    """`QWEN_UNITS[unit_kind]`, or a ValueError naming the kinds there are."""
    if unit_kind not in QWEN_UNITS:
        raise ValueError(f"unknown unit_kind {unit_kind!r}; available: {sorted(QWEN_UNITS)}")
    return QWEN_UNITS[unit_kind]


def qwen_unit_tokens(unit_kind: str = "2s") -> int:
    """Tokens in one Qwen2.5-Omni unit of `QWEN_UNITS[unit_kind]`: 2x2-merged video, audio and 4 markers."""
    (t, h, w), audio, _ = _qwen_unit(unit_kind)
    return t * h * w // 4 + audio + 4


def fold_ids(chunk: Chunk, vocab_size: int) -> Chunk:
    """Maps token ids into `[0, vocab_size)` (layouts keep the real special-token ids)."""
    return dataclasses.replace(chunk, token_ids=np.asarray(chunk.token_ids) % vocab_size)


def eval_sessions(vocab_size: int, count: int = 8) -> list[list[Chunk]]:
    """`count` unstacked Qwen2.5-Omni sessions of different lengths for evaluation tests: session `s` (seeded with
    `s`) is a 6-token system unit, then `3 + s % 4` audiovisual units (grid (2, 2, 4), 10 audio tokens, 1 s per
    grid), each second one followed by a 5-token question answered with 2 tokens; ids folded into `vocab_size`."""
    def session(units: int, seed: int) -> list[Chunk]:
        rng = np.random.default_rng(seed)
        chunks, unit = [qwen.system_unit(rng.integers(0, 200, 6).tolist(), 0)], 1
        for i in range(units):
            chunks.append(qwen.audiovisual_unit((2, 2, 4), 10, 1.0, unit))
            unit += 1
            if i % 2 == 1:
                chunks.append(qwen.text_unit(rng.integers(0, 200, 5).tolist(), unit, answer_tokens=2))
                unit += 2
        return [fold_ids(c, vocab_size) for c in chunks]

    return [session(3 + s % 4, s) for s in range(count)]


def qwen_av_session(num_units: int, *, vocab_size: int, system_tokens: int = 24, question_every: int = 0,
                    seed: int = 0, unit_kind: str = "2s") -> Chunk:
    """System prompt, then `num_units` audiovisual units of kind `unit_kind` (a key of `QWEN_UNITS`); every
    `question_every`-th unit (if > 0) is followed by a short user question (a TEXT unit). Stacked, padded to the
    longest chunk."""
    grid, audio, second_per_grid = _qwen_unit(unit_kind)
    rng = np.random.default_rng(seed)
    chunks = [qwen.system_unit(rng.integers(0, 1000, system_tokens).tolist(), 0)]
    unit = 1
    for i in range(num_units):
        chunks.append(qwen.audiovisual_unit(grid, audio, second_per_grid, unit))
        unit += 1
        if question_every and (i + 1) % question_every == 0:
            chunks.append(qwen.text_unit(rng.integers(0, 1000, 12).tolist(), unit))
            unit += 1
    return stack_chunks([fold_ids(c, vocab_size) for c in chunks])


def minicpm_duplex_session(num_units: int, *, vocab_size: int, system_tokens: int = 24, slices_every: int = 10,
                           seed: int = 0) -> Chunk:
    """MiniCPM-o 4.5 duplex: system prompt, then 1 s units `<unit> <image>E64</image> A10 <|listen|> </unit>`; every
    `slices_every`-th unit carries a 2x2 grid of slices as a high-resolution frame would. Stacked and padded."""
    rng = np.random.default_rng(seed)
    chunks = [minicpmo.system_unit(rng.integers(0, 1000, system_tokens).tolist(), 0)]
    for i in range(num_units):
        slices = (2, 2) if slices_every and (i + 1) % slices_every == 0 else None
        chunks.append(minicpmo.duplex_unit(i + 1, slices=slices, tail="listen"))
    length = max(c.length for c in chunks)
    return stack_chunks([pad_chunk(fold_ids(c, vocab_size), length) for c in chunks])
