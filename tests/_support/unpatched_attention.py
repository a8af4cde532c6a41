"""transformers' own sdpa attention for reference models that kvpress's import-time patch breaks.

kvpress, once imported anywhere in the process (the selector tests of the same xdist worker), wraps every function
of transformers' `ALL_ATTENTION_FUNCTIONS` in one that takes `dropout` positionally, which the Qwen2.5-Omni Token2Wav
DiT's and talker's attention calls do not pass: a TypeError that shows only in the full suite, after a kvpress test
ran in the same worker. The kvpress comparisons need the patch, so it is lifted per test, where a reference runs
those models.
"""

from __future__ import annotations

from typing import Any


def transformers_own_sdpa(monkeypatch: Any) -> None:
    """Puts transformers' sdpa attention back for this test (`monkeypatch` restores kvpress's wrapper after it)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", sdpa_attention_forward)
