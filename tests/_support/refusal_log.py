"""The serving tests' fixture for the server's refusal log (`omnijax.serve.refusal_log.refusals`): its rate limits
are per process, so a test that counts refusal log lines starts from a fresh log and leaves one behind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def fresh_refusal_log() -> Iterator[None]:
    """Resets the process's refusal log before and after each test of a module that imports this fixture."""
    from omnijax.serve.refusal_log import refusals

    refusals.reset()
    yield
    refusals.reset()
