"""Deprecated: `convert.qwen3_omni` moved to `omnijax.models.qwen3_omni.convert`
(this path keeps working for one release)."""

import sys

from omnijax._deprecation import moved

sys.modules[__name__] = moved(__name__, "omnijax.models.qwen3_omni.convert")
