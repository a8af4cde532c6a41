"""Fixtures every Qwen2.5-Omni test shares."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _unpatched_sdpa(monkeypatch):
    """transformers' own sdpa attention for the reference models of this folder. kvpress, once imported anywhere in
    the process (the selector tests of the same xdist worker), wraps every function of `ALL_ATTENTION_FUNCTIONS` in
    one that takes `dropout` positionally, which the Token2Wav DiT's and the talker's attention calls do not pass (a
    TypeError that only shows in the full suite)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", sdpa_attention_forward)
