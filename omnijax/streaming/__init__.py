"""Streaming: `StreamConfig`, the compiled `chunk_step` every path shares, and `stream` / `Session` over it."""

from omnijax.streaming.config import DEFAULT_SESSION_PAGES, StreamConfig
from omnijax.streaming.session import Session, bind_config, graphdef_config, model_parts, stream
from omnijax.streaming.step import (
                                    ChunkOutput,
                                    ChunkStats,
                                    StreamResult,
                                    StreamState,
                                    check_state,
                                    chunk_step,
                                    init_state,
                                    pages_needed,
)

__all__ = ["ChunkOutput", "ChunkStats", "DEFAULT_SESSION_PAGES", "Session", "StreamConfig", "StreamResult",
           "StreamState", "bind_config", "check_state", "chunk_step", "graphdef_config", "init_state", "model_parts",
           "pages_needed", "stream"]
