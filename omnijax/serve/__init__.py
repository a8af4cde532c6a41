"""Metronome serving: a batched multi-session engine over one shared KV pool, telemetry, and AIMD admission.

`omnijax.serve.app` (imported on demand) is `omnijax serve`: the OpenAI-compatible routes (`realtime`, `openai_http`)
and the native per-frame protocol (`native`) on one port, over the `worker` that drives the engine's ticks.
"""

from omnijax.serve.engine.admission import AIMD, Overloaded
from omnijax.serve.engine.engine import (
           DuplicateSession,
           Engine,
           EngineConfig,
           FrameOutput,
           TickReport,
           reset_row,
           take_rows,
)
from omnijax.serve.engine.telemetry import SaturationFit, StallEvent, Telemetry

__all__ = ["AIMD", "DuplicateSession", "Engine", "EngineConfig", "FrameOutput", "Overloaded", "SaturationFit",
           "StallEvent", "Telemetry", "TickReport", "reset_row", "take_rows"]
