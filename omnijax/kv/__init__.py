"""The paged KV cache: `PagedKV` pytree, allocator, layout statistics and RoPE helpers."""

from omnijax.kv.layout import LayoutStats, layout_stats
from omnijax.kv.paged import PageClass, PagedKV, SlotMeta, append, init, release_pages, reserve, write_layer

__all__ = ["LayoutStats", "PageClass", "PagedKV", "SlotMeta", "append", "init", "layout_stats", "release_pages",
           "reserve", "write_layer"]
