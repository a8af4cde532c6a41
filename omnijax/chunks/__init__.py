"""Chunks: one streaming event's tokens, positions and span metadata (`Chunk`), the span kinds every cached token
carries (`SpanKind`), and the builders model layouts use to make them."""

from omnijax.chunks.chunk import Chunk, pad_chunk, split_chunk, split_text, stack_chunks, text_chunk, validate
from omnijax.chunks.spans import SpanKind

__all__ = ["Chunk", "SpanKind", "pad_chunk", "split_chunk", "split_text", "stack_chunks", "text_chunk", "validate"]
