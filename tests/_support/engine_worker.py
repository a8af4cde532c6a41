"""Runs an async test body against a fresh `EngineWorker` over an engine, closing what it opened."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from omnijax.serve.engine.worker import EngineWorker


def on_worker(engine: Any, body: Callable[[EngineWorker], Awaitable[Any]]) -> Any:
    """`body(worker)`'s result, run on a fresh worker over `engine`; every session it opened is closed after."""
    async def main():
        worker = EngineWorker(engine)
        await worker.start()
        try:
            return await body(worker)
        finally:
            for sid in list(worker.lanes):
                await worker.close(sid)
            await worker.stop()
    return asyncio.run(main())
