"""Deprecated: `pallas_kernels.lowering` moved to `omnijax.kernels.lowering`
(this path keeps working for one release)."""

import sys

from omnijax._deprecation import moved

sys.modules[__name__] = moved(__name__, "omnijax.kernels.lowering")
