"""Metronome serving: a batched multi-session engine over one shared KV pool, telemetry, and AIMD admission.

`omnijax.serve.server` (imported on demand) is the WebSocket front end.
"""

from omnijax.serve.admission import AIMD, Overloaded
from omnijax.serve.engine import DuplicateSession, Engine, EngineConfig, FrameOutput, TickReport, reset_row, take_rows
from omnijax.serve.telemetry import SaturationFit, StallEvent, Telemetry

__all__ = ["AIMD", "DuplicateSession", "Engine", "EngineConfig", "FrameOutput", "Overloaded", "SaturationFit",
           "StallEvent", "Telemetry", "TickReport", "reset_row", "take_rows"]
