"""The token constraint's bitmask codec (`omnijax.serve.engine.constraint`): `pack_allowed` and `unpack_allowed`
against a plain-Python twin of the layout (bit `j % 32` of int32 word `j // 32` set when token `j` is allowed)."""

from __future__ import annotations

import numpy as np
import pytest

from omnijax.serve.engine.constraint import mask_words, pack_allowed, unpack_allowed


def _twin_unpack(words: list[int], vocab_size: int) -> list[bool]:
    """The layout read bit by bit in plain Python (the oracle)."""
    return [bool((words[j // 32] & 0xFFFFFFFF) >> (j % 32) & 1) for j in range(vocab_size)]


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 95, 1000])
def test_unpack_reads_every_bit_of_the_layout(vocab_size):
    rng = np.random.default_rng(vocab_size)
    words = rng.integers(-2**31, 2**31, mask_words(vocab_size), dtype=np.int64).astype(np.int32)
    got = unpack_allowed(words, vocab_size)
    assert got.dtype == bool and got.shape == (vocab_size,)
    assert got.tolist() == _twin_unpack(words.tolist(), vocab_size)
    # a batch of masks unpacks row by row; a big-endian copy reads the same
    batch = np.stack([words, ~words])
    assert unpack_allowed(batch, vocab_size).tolist() == [_twin_unpack(w, vocab_size) for w in batch.tolist()]
    assert unpack_allowed(words.astype(">i4"), vocab_size).tolist() == got.tolist()


def test_pack_then_unpack_gives_the_allowed_ids_back():
    rng = np.random.default_rng(0)
    for vocab_size in (7, 64, 49153):
        ids = set(rng.choice(vocab_size, size=min(vocab_size, 50), replace=False).tolist()) | {vocab_size - 1}
        mask = pack_allowed(ids, vocab_size)
        assert mask.dtype == np.int32 and mask.shape == (mask_words(vocab_size),)
        assert set(np.flatnonzero(_twin_unpack(mask.tolist(), vocab_size)).tolist()) == ids
        assert set(np.flatnonzero(unpack_allowed(mask, vocab_size)).tolist()) == ids
