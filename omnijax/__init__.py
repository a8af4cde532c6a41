"""omnijax: streaming omni-modal LLMs in JAX with a bounded, paged KV cache.

Public surface: `load`, `Model`, `stream`, `Session`, `StreamResult`, chunk builders, retention policies,
paging modes.
"""

from omnijax.chunks import Chunk, split_text, stack_chunks, text_chunk
from omnijax.config import PRESETS, DecoderConfig
from omnijax.model import Model, load
from omnijax.models.decoder import Decoder
from omnijax.paging import PAGING_MODES, Paging
from omnijax.retention import REGISTRY as RETENTION_POLICIES
from omnijax.retention import NoSlide
from omnijax.streaming import ChunkOutput, Session, StreamResult, StreamState, init_state, stream
from omnijax.units import SpanKind
from omnijax.evaluation import EvalConfig, evaluate

__all__ = [
    "Chunk", "ChunkOutput", "Decoder", "DecoderConfig", "Model", "NoSlide", "PAGING_MODES", "PRESETS", "Paging", "RETENTION_POLICIES",
    "Session", "SpanKind", "StreamResult", "StreamState", "init_state", "load", "split_text", "stack_chunks",
    "stream", "text_chunk", "EvalConfig", "evaluate",
]
