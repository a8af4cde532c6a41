"""What `bench/tidekv/prefill_memory.py` and its two measurement modules share: byte units, the narrow executable
model of Method B, the page size of every prefill, and the byte count of an array tree."""

from __future__ import annotations

import jax
import numpy as np

from omnijax.models.config import DecoderConfig

GiB, MiB = 2.0 ** 30, 2.0 ** 20
NARROW = DecoderConfig(vocab_size=1024, hidden_size=512, intermediate_size=1376, num_layers=4, num_heads=8,
                       num_kv_heads=2, head_dim=64, rope_theta=1e6, mrope_section=(8, 12, 12), dtype="float32")
PAGE = 512


def nbytes(tree) -> int:
    """Total bytes of the leaves of `tree` (arrays or `jax.ShapeDtypeStruct`s)."""
    return int(sum(np.prod(s.shape) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(tree)))
