"""Deprecated: `convert.llama` moved to `omnijax.models.llama.convert`
(this path keeps working for one release)."""

import sys

from omnijax._deprecation import moved

sys.modules[__name__] = moved(__name__, "omnijax.models.llama.convert")
