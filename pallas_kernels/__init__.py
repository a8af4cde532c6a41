"""Deprecated: `pallas_kernels` moved to `omnijax.kernels`
(this path keeps working for one release)."""

import sys

from omnijax._deprecation import moved

sys.modules[__name__] = moved(__name__, "omnijax.kernels")
