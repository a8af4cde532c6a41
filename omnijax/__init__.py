"""omnijax: streaming omni-modal LLMs in JAX with a bounded, paged KV cache.

Public surface: `load`, `Model`, `StreamConfig`, `stream`, `Session`, `Chat`, `StreamResult`, `evaluate`,
`EvalConfig`, chunk builders, retention policies (`omnijax.retention`), paging modes, decoding strategies
(`omnijax.decoding`).

Importing omnijax changes nothing process-wide. The command lines (`omnijax ...`, `make demo`) turn on a persistent
compilation cache; a library user does so with `omnijax.enable_compilation_cache()` (`OMNIJAX_COMPILATION_CACHE`
names its directory, `OMNIJAX_COMPILATION_CACHE=off` turns it off).
"""

from omnijax.chat import Chat
from omnijax.chunks.chunk import Chunk, split_text, stack_chunks, text_chunk
from omnijax.chunks.spans import SpanKind
from omnijax.compilation_cache import enable as enable_compilation_cache
from omnijax.decoding import Greedy
from omnijax.eval.runner import EvalConfig, evaluate
from omnijax.models.config import PRESETS, DecoderConfig
from omnijax.models.decoder import Decoder
from omnijax.models.model import Model
from omnijax.models.registry import load
from omnijax.paging import PAGING_MODES, Paging
from omnijax.retention import REGISTRY as RETENTION_POLICIES
from omnijax.retention import NoSlide, get_policy
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.session import Session, stream
from omnijax.streaming.step import ChunkOutput, StreamResult, StreamState, init_state

__all__ = [
    "Chat", "Chunk", "ChunkOutput", "Decoder", "DecoderConfig", "EvalConfig", "Greedy", "Model", "NoSlide",
    "PAGING_MODES", "PRESETS", "Paging", "RETENTION_POLICIES", "Session", "SpanKind", "StreamConfig", "StreamResult",
    "StreamState", "enable_compilation_cache", "evaluate", "get_policy", "init_state", "load", "split_text",
    "stack_chunks", "stream", "text_chunk",
]
