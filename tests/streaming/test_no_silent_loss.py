"""Loops built on the streaming step say when the KV pool could not hold their tokens, rather than go on without
them (the prefill decode room has its own tests in test_prefill_room.py)."""

from __future__ import annotations

import numpy as np
import pytest

from omnijax.chunks.spans import SpanKind
from omnijax.models.config import TINY_OMNI
from omnijax.models.decoder import Decoder
from omnijax.models.minicpmo.duplex import DuplexDecodeRule, DuplexTokens
from omnijax.models.minicpmo.duplex_loop import DuplexFeed
from omnijax.streaming.duplex import DuplexSession


def ids(*values: int) -> DuplexFeed:
    return DuplexFeed(tuple((v, SpanKind.TEXT) for v in values), unit=0)


def test_duplex_session_refuses_to_go_on_once_the_pool_ran_out():
    model = Decoder(TINY_OMNI.replace(num_layers=1))
    model.audio = object()  # a stand-in encoder: feeding never runs it
    tokens = DuplexTokens(unit_start=1, unit_end=2, image_start=3, image_end=4, listen=5, chunk_eos=6,
                          chunk_tts_eos=7)
    rule = DuplexDecodeRule(chunk_eos=6, turn_eos=8, listen=5, tts_bos=9)
    duplex = DuplexSession(model, rule=rule, tokens=tokens, num_pages=1, page_size=16, chunk_width=16)
    logits = duplex.feed(ids(*[10] * 12))  # 12 of the pool's 16 slots
    assert logits.shape == (model.config.vocab_size,) and np.isfinite(logits).all()
    with pytest.raises(RuntimeError, match=r"KV pool ran out: 8 token\(s\) were not cached; give a larger "
                                           r"num_pages \(now 1\)"):
        duplex.feed(ids(*[11] * 12))  # 4 fit, 8 do not
    with pytest.raises(RuntimeError, match="KV pool ran out"):  # sticky: every later decision would lack them
        duplex.feed(ids(12))
