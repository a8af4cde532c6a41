"""The tiny demo model served in-process (`BackgroundServer`) for the serving tests: one engine, the same in every
module that uses it, so its compiled programs come from the persistent cache after the first."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FRAME_MS = 250.0  # 4000 samples: 6 audio tokens + 2 markers per frame


@contextlib.contextmanager
def demo_server(directory: Path, *, decoding: Any = None, **options: Any) -> Iterator[Any]:
    """Serves the demo checkpoint written to `directory`: SinkWindow(4, 48) over a 32 x 16 pool, tau 2, T 8, one batch
    bucket of 4, no AIMD, warmed up for 4 sessions; `options` are `ServeOptions` fields (port 0 and a 250 ms frame
    budget unless given); `decoding` replaces the engine's decoding strategy. Yields the `BackgroundServer`."""
    import omnijax
    from omnijax.retention import SinkWindow
    from omnijax.serve.app import BackgroundServer, build_context, build_demo_model, warm_up
    from omnijax.serve.context import ServeOptions

    model = omnijax.load(build_demo_model(directory))
    stream = omnijax.StreamConfig(policy=SinkWindow(4, 48), num_pages=32, page_size=16, max_answer_tokens=2)
    if decoding is not None:
        stream = stream.replace(decoding=decoding)
    context = build_context(model, options=ServeOptions(**{"port": 0, "frame_ms": FRAME_MS, **options}),
                            stream=stream, chunk_tokens=8, buckets=(4,), aimd_target=0)
    warm_up(context, 4)
    with BackgroundServer(context) as server:
        yield server
