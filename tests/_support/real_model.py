"""The real model in tests: SmolLM2-135M-Instruct's GGUF, which `make test` installs (`make smollm2`), converted once
into a cache outside the clone and shared by the test modules and their reruns.

    $OMNIJAX_SMOLLM2_GGUF, else <sys.prefix>/share/omnijax/SmolLM2-135M-Instruct.Q4_1.gguf   the file
    $OMNIJAX_TEST_MODEL_CACHE, else ~/.cache/omnijax-tests/models                         the conversion

The conversion is keyed by the file (name, size, modification time) and the converter's source
(`omnijax.demo.smollm2.converted`), so a changed converter converts again. `make test` sets $OMNIJAX_SMOLLM2_GGUF,
so a missing file fails the tests that need it; run elsewhere without the file, they skip, naming `make smollm2`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from omnijax.demo import smollm2

CACHE_ENV = "OMNIJAX_TEST_MODEL_CACHE"


def cache_dir() -> Path:
    """Where converted test models are kept."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "omnijax-tests", "models")
    return Path(os.environ.get(CACHE_ENV) or default)


def gguf_file() -> Path:
    """The installed GGUF file; skips (fails when $OMNIJAX_SMOLLM2_GGUF named it) when it is missing."""
    try:
        return smollm2.find_gguf()
    except smollm2.ModelFileMissing as e:
        if os.environ.get(smollm2.ENV):
            pytest.fail(str(e))
        pytest.skip(str(e))


def checkpoint() -> Path:
    """The omnijax checkpoint of the GGUF file, converted on first use (about 20 s) and then reused."""
    path, _ = smollm2.converted(gguf_file(), cache_dir() / "smollm2", log=lambda line: None)
    return path
