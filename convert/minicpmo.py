"""Deprecated: `convert.minicpmo` moved to `omnijax.models.minicpmo.convert`
(this path keeps working for one release)."""

import sys

from omnijax._deprecation import moved

sys.modules[__name__] = moved(__name__, "omnijax.models.minicpmo.convert")
