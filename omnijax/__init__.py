"""omnijax: streaming omni-modal LLMs in JAX with a bounded, paged KV cache.

Public surface: `load`, `Model`, `StreamConfig`, `stream`, `Session`, `Chat`, `StreamResult`, `evaluate`,
`EvalConfig`, chunk builders, retention policies (`omnijax.retention`), paging modes, decoding strategies
(`omnijax.decoding`).

Importing omnijax turns on a persistent compilation cache (`omnijax.compilation_cache`; `OMNIJAX_COMPILATION_CACHE`
names its directory, `OMNIJAX_COMPILATION_CACHE=off` turns it off).
"""

from omnijax import compilation_cache as _compilation_cache

_compilation_cache.enable()

from omnijax.chat import Chat  # noqa: E402
from omnijax.chunks.chunk import Chunk, split_text, stack_chunks, text_chunk  # noqa: E402
from omnijax.models.config import PRESETS, DecoderConfig  # noqa: E402
from omnijax.streaming.config import StreamConfig  # noqa: E402
from omnijax.decoding import Greedy  # noqa: E402
from omnijax.eval.runner import EvalConfig, evaluate  # noqa: E402
from omnijax.models.model import Model, load  # noqa: E402
from omnijax.models.decoder import Decoder  # noqa: E402
from omnijax.paging import PAGING_MODES, Paging  # noqa: E402
from omnijax.retention import REGISTRY as RETENTION_POLICIES  # noqa: E402
from omnijax.retention import NoSlide, get_policy  # noqa: E402
from omnijax.streaming.step import ChunkOutput, StreamResult, StreamState, init_state  # noqa: E402
from omnijax.streaming.session import Session, stream  # noqa: E402
from omnijax.chunks.spans import SpanKind  # noqa: E402

__all__ = [
    "Chat", "Chunk", "ChunkOutput", "Decoder", "DecoderConfig", "EvalConfig", "Greedy", "Model", "NoSlide",
    "PAGING_MODES", "PRESETS", "Paging", "RETENTION_POLICIES", "Session", "SpanKind", "StreamConfig", "StreamResult",
    "StreamState", "evaluate", "get_policy", "init_state", "load", "split_text", "stack_chunks", "stream", "text_chunk",
]
