"""Deprecated: `omnijax.evaluation` moved to `omnijax.eval.runner` (this path keeps working for one release)."""

import sys

from omnijax._deprecation import moved

sys.modules[__name__] = moved(__name__, "omnijax.eval.runner")
