"""Synthetic session layouts for endurance tests and benchmarks: realistic unit structure and token counts, no media.

Retention and paging read only the layout (span kinds, units, positions), so these sessions carry token ids folded
into a small vocabulary instead of encoder embeddings.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from omnijax.adapters import minicpmo
from omnijax.adapters import qwen2_5_omni as qwen
from omnijax.chunks import Chunk, pad_chunk, stack_chunks

# A 2 s Qwen2.5-Omni unit at 2 fps with 280x392 frames: grid (2, 10, 14) -> 70 video tokens, 50 audio tokens.
QWEN_UNIT_GRID = (2, 10, 14)
QWEN_UNIT_AUDIO = 50


def fold_ids(chunk: Chunk, vocab_size: int) -> Chunk:
    """Maps token ids into `[0, vocab_size)` (layouts keep the real special-token ids)."""
    return dataclasses.replace(chunk, token_ids=np.asarray(chunk.token_ids) % vocab_size)


def qwen_av_session(num_units: int, *, vocab_size: int, system_tokens: int = 24, question_every: int = 0,
                    seed: int = 0) -> Chunk:
    """System prompt, then `num_units` 2 s audiovisual units; every `question_every`-th unit (if > 0) is followed by
    a short user question (a TEXT unit). Stacked, padded to the longest chunk."""
    rng = np.random.default_rng(seed)
    chunks = [qwen.system_unit(rng.integers(0, 1000, system_tokens).tolist(), 0)]
    unit = 1
    for i in range(num_units):
        chunks.append(qwen.audiovisual_unit(QWEN_UNIT_GRID, QWEN_UNIT_AUDIO, 1.0, unit))
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
