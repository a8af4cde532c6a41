"""omnijax: streaming omni-modal LLMs in JAX with a bounded, paged KV cache.

Public surface: `load`, `Model`, `StreamConfig`, `stream`, `Session`, `Chat`, `StreamResult`, `evaluate`,
`EvalConfig`, chunk builders, retention policies (`omnijax.retention`), paging modes, decoding strategies
(`omnijax.decoding`).

Importing omnijax changes nothing process-wide. The command lines (`omnijax ...`, `make demo`) turn on a persistent
compilation cache; a library user does so with `omnijax.enable_compilation_cache()` (`OMNIJAX_COMPILATION_CACHE`
names its directory, `OMNIJAX_COMPILATION_CACHE=off` turns it off).

The public names are imported when first used (`omnijax.Chat` imports the chat layer, and jax with it), so
`import omnijax` itself is quick and a command line's `--help` answers at once. Submodules (`omnijax.plot`,
`omnijax.retention`, ...) are reachable as attributes in the same way.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from omnijax._version import __version__

# public name -> (module, attribute there)
_PUBLIC: dict[str, tuple[str, str]] = {
    "Chat": ("omnijax.chat", "Chat"),
    "Chunk": ("omnijax.chunks.chunk", "Chunk"),
    "ChunkOutput": ("omnijax.streaming.step", "ChunkOutput"),
    "Decoder": ("omnijax.models.decoder", "Decoder"),
    "DecoderConfig": ("omnijax.models.config", "DecoderConfig"),
    "EvalConfig": ("omnijax.eval.runner", "EvalConfig"),
    "Greedy": ("omnijax.decoding", "Greedy"),
    "Model": ("omnijax.models.model", "Model"),
    "NoSlide": ("omnijax.retention", "NoSlide"),
    "PAGING_MODES": ("omnijax.paging", "PAGING_MODES"),
    "PRESETS": ("omnijax.models.config", "PRESETS"),
    "Paging": ("omnijax.paging", "Paging"),
    "RETENTION_POLICIES": ("omnijax.retention", "REGISTRY"),
    "Session": ("omnijax.streaming.session", "Session"),
    "SpanKind": ("omnijax.chunks.spans", "SpanKind"),
    "StreamConfig": ("omnijax.streaming.config", "StreamConfig"),
    "StreamResult": ("omnijax.streaming.step", "StreamResult"),
    "StreamState": ("omnijax.streaming.step", "StreamState"),
    "enable_compilation_cache": ("omnijax.compilation_cache", "enable"),
    "evaluate": ("omnijax.eval.runner", "evaluate"),
    "get_policy": ("omnijax.retention", "get_policy"),
    "init_state": ("omnijax.streaming.step", "init_state"),
    "load": ("omnijax.models.registry", "load"),
    "split_text": ("omnijax.chunks.chunk", "split_text"),
    "stack_chunks": ("omnijax.chunks.chunk", "stack_chunks"),
    "stream": ("omnijax.streaming.session", "stream"),
    "text_chunk": ("omnijax.chunks.chunk", "text_chunk"),
}

__all__ = [
    "Chat", "Chunk", "ChunkOutput", "Decoder", "DecoderConfig", "EvalConfig", "Greedy", "Model", "NoSlide",
    "PAGING_MODES", "PRESETS", "Paging", "RETENTION_POLICIES", "Session", "SpanKind", "StreamConfig", "StreamResult",
    "StreamState", "__version__", "enable_compilation_cache", "evaluate", "get_policy", "init_state", "load",
    "split_text", "stack_chunks", "stream", "text_chunk",
]


def __getattr__(name: str) -> Any:
    """Imports a public name, or a submodule (`omnijax.plot`), on first use."""
    if name in _PUBLIC:
        module, attribute = _PUBLIC[name]
        value = getattr(importlib.import_module(module), attribute)
    elif importlib.util.find_spec(f"omnijax.{name}") is not None:
        value = importlib.import_module(f"omnijax.{name}")
    else:
        raise AttributeError(f"module 'omnijax' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


if TYPE_CHECKING:  # what type checkers and editors see; at run time `__getattr__` imports each name when used
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
