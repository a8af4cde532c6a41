"""Deprecated: `convert.special_tokens` moved to `omnijax.checkpoint.special_tokens`
(this path keeps working for one release)."""

import sys

from omnijax._deprecation import moved

sys.modules[__name__] = moved(__name__, "omnijax.checkpoint.special_tokens")
