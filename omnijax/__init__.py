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
from omnijax.chunks import Chunk, split_text, stack_chunks, text_chunk  # noqa: E402
from omnijax.config import PRESETS, DecoderConfig, StreamConfig  # noqa: E402
from omnijax.decoding import Greedy  # noqa: E402
from omnijax.evaluation import EvalConfig, evaluate  # noqa: E402
from omnijax.model import Model, load  # noqa: E402
from omnijax.models.decoder import Decoder  # noqa: E402
from omnijax.paging import PAGING_MODES, Paging  # noqa: E402
from omnijax.retention import REGISTRY as RETENTION_POLICIES  # noqa: E402
from omnijax.retention import NoSlide, get_policy  # noqa: E402
from omnijax.streaming import ChunkOutput, Session, StreamResult, StreamState, init_state, stream  # noqa: E402
from omnijax.units import SpanKind  # noqa: E402

__all__ = [
    "Chat", "Chunk", "ChunkOutput", "Decoder", "DecoderConfig", "EvalConfig", "Greedy", "Model", "NoSlide",
    "PAGING_MODES", "PRESETS", "Paging", "RETENTION_POLICIES", "Session", "SpanKind", "StreamConfig", "StreamResult",
    "StreamState", "evaluate", "get_policy", "init_state", "load", "split_text", "stack_chunks", "stream", "text_chunk",
]
