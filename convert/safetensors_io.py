"""Deprecated: `convert.safetensors_io` moved to `omnijax.checkpoint.safetensors`
(this path keeps working for one release)."""

import sys

from omnijax._deprecation import moved

sys.modules[__name__] = moved(__name__, "omnijax.checkpoint.safetensors")
