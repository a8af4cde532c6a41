"""Prompt prefill with KV compression: TideKV's layer-major delayed eviction, its baselines, selectors, and the
compressed decode cache (docs/architecture.md, "TideKV")."""

from omnijax.prefill.baselines import immediate_eviction_prefill, token_major_prefill
from omnijax.prefill.cache import (
                                   CompressedCache,
                                   LayerCache,
                                   Selection,
                                   check_room,
                                   decode,
                                   decode_step,
                                   force,
                                   greedy,
                                   with_room,
)
from omnijax.prefill.layer_major import PrefillResult, tidekv_prefill
from omnijax.prefill.selectors import (
                                   REGISTRY,
                                   AdaKV,
                                   ChunkKV,
                                   KeyDiff,
                                   RecentTokens,
                                   SnapKV,
                                   kvpress_budget,
                                   pyramid_budgets,
                                   uniform_budgets,
)
from omnijax.prefill.selectors_extra import IMMEDIATE_EVICTION, immediate_eviction, recent_eviction_prefill

__all__ = ["AdaKV", "ChunkKV", "CompressedCache", "IMMEDIATE_EVICTION", "KeyDiff", "LayerCache", "PrefillResult",
           "REGISTRY", "RecentTokens", "Selection", "SnapKV", "check_room", "decode", "decode_step", "force", "greedy",
           "immediate_eviction", "immediate_eviction_prefill", "kvpress_budget", "pyramid_budgets",
           "recent_eviction_prefill", "tidekv_prefill", "token_major_prefill", "uniform_budgets", "with_room"]
