"""Deprecated: `convert.qwen2_5_omni` moved to `omnijax.models.qwen2_5_omni.convert`
(this path keeps working for one release)."""

import sys

from omnijax._deprecation import moved

sys.modules[__name__] = moved(__name__, "omnijax.models.qwen2_5_omni.convert")
