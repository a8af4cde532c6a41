"""Deprecated: `pallas_kernels.streaming_topk` moved to `omnijax.kernels.streaming_topk` (kept for one release)."""

import sys

from omnijax._deprecation import moved

sys.modules[__name__] = moved(__name__, "omnijax.kernels.streaming_topk")
