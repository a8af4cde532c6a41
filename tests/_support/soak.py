"""`OMNIJAX_SOAK=N` runs N times the random cases of the tests that compare vectorised code with a plain-Python
reference (retention planners, OmniPage planners and modes). The default, 1, is what `make test` runs; the first
cases are the same at any N, the extra ones are new draws from the same seeded streams. Example:

    OMNIJAX_SOAK=50 .venv/bin/python -m pytest -q tests/paging/test_omnipage_plans.py \
        tests/retention/test_unit_policies.py
"""

import os


def factor() -> int:
    """The soak factor from the environment (a positive integer)."""
    value = os.environ.get("OMNIJAX_SOAK", "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"OMNIJAX_SOAK must be a positive integer, got {value!r}")
    return int(value)
