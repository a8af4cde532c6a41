"""Deprecated: `python -m convert` is now `omnijax convert` (or `python -m omnijax.convert`)."""

import sys
import warnings

from omnijax.convert.__main__ import main

if __name__ == "__main__":
    warnings.warn("python -m convert is deprecated and will be removed in the next release; use `omnijax convert` "
                  "or `python -m omnijax.convert`", DeprecationWarning, stacklevel=1)
    sys.exit(main())
