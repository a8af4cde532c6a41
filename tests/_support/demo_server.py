"""The tiny demo model served in-process (`BackgroundServer`) for the serving tests: one engine, the same in every
module that uses it, so its compiled programs come from the persistent cache after the first. The demo checkpoint is
written and converted once per test process (`demo_checkpoint`, ~7 s) and loaded once (`demo_model`): the modules of
one xdist worker share it."""

from __future__ import annotations

import atexit
import contextlib
import functools
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

FRAME_MS = 250.0  # 4000 samples: 6 audio tokens + 2 markers per frame


@functools.cache
def demo_checkpoint() -> str:
    """The converted demo checkpoint (`omnijax serve --demo-model`'s model), written once per process into a
    temporary folder removed when the process exits. Returns its directory."""
    from omnijax.serve.app import build_demo_model

    folder = tempfile.mkdtemp(prefix="omnijax-demo-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return build_demo_model(folder)


@functools.cache
def demo_model() -> Any:
    """The demo checkpoint loaded once per process (an `omnijax.Model` with its tokenizer); callers must not change
    it."""
    import omnijax

    return omnijax.load(demo_checkpoint())



@functools.cache
def transformers_logprobs() -> Callable[[Sequence[int]], np.ndarray]:
    """transformers' Qwen2.5-Omni thinker with the demo checkpoint's weights (its tied lm_head included), built once
    per process: a function from a token list to its `[n, V]` log-probabilities (the oracle of the prompt and
    continuation log-probabilities the server returns)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, Qwen2_5OmniThinkerForConditionalGeneration

    hf = Path(demo_checkpoint()).parent / "hf"
    model = Qwen2_5OmniThinkerForConditionalGeneration(AutoConfig.from_pretrained(hf).thinker_config).eval()
    weights = {k[len("thinker."):]: v for k, v in load_file(hf / "model.safetensors").items()
               if k.startswith("thinker.")}
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    model.load_state_dict(weights, strict=True)

    def logprobs(ids: Sequence[int]) -> np.ndarray:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([list(ids)])).logits.float()
        return torch.log_softmax(logits, -1)[0].numpy()
    return logprobs

@contextlib.contextmanager
def demo_server(directory: Path | None = None, *, decoding: Any = None, structured_warmup: bool = False,
                buckets: tuple[int, ...] = (4,), **options: Any) -> Iterator[Any]:
    """Serves the demo checkpoint: SinkWindow(4, 48) over a 32 x 16 pool, tau 2, T 8, one batch bucket of 4 (unless
    `buckets` says otherwise), no AIMD, warmed up for the largest bucket's sessions; `options` are `ServeOptions`
    fields (port 0 and a 250 ms frame budget unless given); `decoding` replaces the engine's decoding strategy.
    Yields the `BackgroundServer`.

    Args:
        directory: where to write the demo checkpoint; None (the usual): the one this process shares
            (`demo_model`).
        decoding: the engine's decoding strategy (default: the stream's greedy one).
        structured_warmup: also make structured output ready at start (what `omnijax serve` does; off here: it
            costs every server a tokenizer build and a tick, and the first `response_format` request of a test
            then compiles its program as before; tests/serve/test_warmup_structured.py tests the warm-up itself).
        buckets: the engine's batch buckets ((1,) for a client that sends one request at a time: every tick then
            decodes one row of the 152K-wide lm_head, not four).
        **options: `ServeOptions` fields.
    """
    import omnijax
    from omnijax.retention import SinkWindow
    from omnijax.serve.app import BackgroundServer, build_context, build_demo_model, warm_up
    from omnijax.serve.context import ServeOptions

    model = demo_model() if directory is None else omnijax.load(build_demo_model(directory))
    stream = omnijax.StreamConfig(policy=SinkWindow(4, 48), num_pages=32, page_size=16, max_answer_tokens=2)
    if decoding is not None:
        stream = stream.replace(decoding=decoding)
    context = build_context(model, options=ServeOptions(**{"port": 0, "frame_ms": FRAME_MS, **options}),
                            stream=stream, chunk_tokens=8, buckets=buckets, aimd_target=0)
    warm_up(context, max(buckets), structured=structured_warmup)
    with BackgroundServer(context) as server:
        yield server
