"""Old import paths that keep working for one release: each old module is the new module itself, imported with a
DeprecationWarning that names the new path."""

from __future__ import annotations

import importlib
import sys
import types
import warnings


def moved(old: str, new: str) -> types.ModuleType:
    """Makes `old` (a module being imported) the module `new`, warning once that `old` is deprecated.

    Call as `sys.modules[__name__] = moved(__name__, "omnijax.x.y")` at the top of the old module's file: the
    import statement then binds the new module, so `old.name` is `new.name` (one object, not a copy).
    """
    warnings.warn(f"{old} is deprecated and will be removed in the next release; import {new} instead",
                  DeprecationWarning, stacklevel=3)
    module = importlib.import_module(new)
    sys.modules[old] = module
    return module
