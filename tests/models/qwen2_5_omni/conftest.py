"""Fixtures every Qwen2.5-Omni test shares."""

from __future__ import annotations

import pytest

from tests._support.unpatched_attention import transformers_own_sdpa


@pytest.fixture(autouse=True)
def _unpatched_sdpa(monkeypatch):
    """transformers' own sdpa attention for the reference models of this folder (kvpress's import-time wrapper breaks
    the Token2Wav DiT's and the talker's calls: `tests/_support/unpatched_attention.py`)."""
    transformers_own_sdpa(monkeypatch)
