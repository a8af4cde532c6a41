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

# The public names: the table's and the version. The TYPE_CHECKING imports below bind the same names for type checkers,
# which cannot read an `__all__` built at run time: each by a redundant `as` alias, which marks it re-exported
# (tests/test_imports.py checks that they bind what the table names).
__all__ = ["__version__", *_PUBLIC]


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
    from omnijax.chat import Chat as Chat
    from omnijax.chunks.chunk import Chunk as Chunk
    from omnijax.chunks.chunk import split_text as split_text
    from omnijax.chunks.chunk import stack_chunks as stack_chunks
    from omnijax.chunks.chunk import text_chunk as text_chunk
    from omnijax.chunks.spans import SpanKind as SpanKind
    from omnijax.compilation_cache import enable as enable_compilation_cache  # noqa: F401 - in __all__, by _PUBLIC
    from omnijax.decoding import Greedy as Greedy
    from omnijax.eval.runner import EvalConfig as EvalConfig
    from omnijax.eval.runner import evaluate as evaluate
    from omnijax.models.config import PRESETS as PRESETS
    from omnijax.models.config import DecoderConfig as DecoderConfig
    from omnijax.models.decoder import Decoder as Decoder
    from omnijax.models.model import Model as Model
    from omnijax.models.registry import load as load
    from omnijax.paging import PAGING_MODES as PAGING_MODES
    from omnijax.paging import Paging as Paging
    from omnijax.retention import REGISTRY as RETENTION_POLICIES  # noqa: F401 - in __all__, by _PUBLIC
    from omnijax.retention import NoSlide as NoSlide
    from omnijax.retention import get_policy as get_policy
    from omnijax.streaming.config import StreamConfig as StreamConfig
    from omnijax.streaming.session import Session as Session
    from omnijax.streaming.session import stream as stream
    from omnijax.streaming.step import ChunkOutput as ChunkOutput
    from omnijax.streaming.step import StreamResult as StreamResult
    from omnijax.streaming.step import StreamState as StreamState
    from omnijax.streaming.step import init_state as init_state
