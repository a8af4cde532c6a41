"""Deprecated: `convert.streaming` moved to `omnijax.checkpoint.loop`
(this path keeps working for one release)."""

import sys

from omnijax._deprecation import moved

sys.modules[__name__] = moved(__name__, "omnijax.checkpoint.loop")
