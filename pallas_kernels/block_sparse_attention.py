"""Deprecated: `pallas_kernels.block_sparse_attention` moved to `omnijax.kernels.block_sparse_attention`
(this path keeps working for one release)."""

import sys

from omnijax._deprecation import moved

sys.modules[__name__] = moved(__name__, "omnijax.kernels.block_sparse_attention")
