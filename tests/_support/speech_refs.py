"""What the speech-output tests of both families share around transformers' `generate(return_audio=True)`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np


@contextlib.contextmanager
def captured_talker(full: Any) -> Iterator[list]:
    """Records what transformers' talker `generate` returns inside the full model's `generate`."""
    seen: list = []
    original = full.talker.generate

    def generate(*args, **kwargs):
        seen.append(original(*args, **kwargs))
        return seen[-1]

    full.talker.generate = generate
    try:
        yield seen
    finally:
        del full.talker.generate


def greedy_answer(model: Any, prompt: Any, steps: int, stop_id: int) -> np.ndarray:
    """omnijax's greedy thinker answer (one-shot forwards), stopping after `stop_id` (the template's `<|im_end|>`)."""
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(np.argmax(np.asarray(model(input_ids=np.asarray([seq]))[0, -1]))))
        if seq[-1] == stop_id:
            break
    return np.asarray(seq[len(prompt):])


@contextlib.contextmanager
def captured_talker_calls(full: Any) -> Iterator[list]:
    """Records each call of transformers' talker `generate` inside the full model's `generate`: `(kwargs, result)`
    (the kwargs hold its `inputs_embeds`, `talker_input_ids`, `trailing_text_hidden`, `image_grid_thw`, ...)."""
    seen: list = []
    original = full.talker.generate

    def generate(*args, **kwargs):
        seen.append((kwargs, original(*args, **kwargs)))
        return seen[-1][1]

    full.talker.generate = generate
    try:
        yield seen
    finally:
        del full.talker.generate


def perturb_thinker_and_talker(full: Any) -> None:
    """Widens a freshly initialised transformers full model's talker, thinker decoder and thinker head (normal(0, 0.3)
    matrices, vectors nudged by 0.2 noise) so greedy answers and talker codes depend on every weight; call it after
    `torch.manual_seed`."""
    import torch

    with torch.no_grad():
        for p in full.talker.parameters():
            p.normal_(0.0, 0.3) if p.ndim > 1 else p.add_(torch.randn_like(p) * 0.2)
        for p in full.thinker.model.parameters():
            p.normal_(0.0, 0.3) if p.ndim > 1 else p.add_(torch.randn_like(p) * 0.2)
        full.thinker.lm_head.weight.normal_(0.0, 0.3)


def assert_speaks_as_transformers(spoken: Any, want_tokens: np.ndarray, wav: np.ndarray) -> None:
    """`spoken` (a `speak` result) drew transformers' talker tokens `want_tokens` (enough of them, not all one id)
    and its PCM equals transformers' waveform `wav` within 1e-4 of its peak."""
    np.testing.assert_array_equal(spoken.talker_tokens, want_tokens)
    assert len(want_tokens) >= 6 and len(set(want_tokens.tolist())) > 2, want_tokens
    peak = np.abs(wav).max()
    assert peak > 0.05 and spoken.pcm.shape == wav.shape
    err = np.abs(spoken.pcm - wav).max()
    assert err <= 1e-4 * peak, f"max error {err:.3g} > 1e-4 x peak {peak:.3g}"
