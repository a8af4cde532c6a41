"""OmniTide (seed 000): unit-aware retention and the paged attention that follows it.

What the scripts measure: per-update latency under each retention policy and over an hour of streaming
(`retention`, `endurance`, `stream_latency`), the KV layout a policy leaves and its physical span under each paging
mode and placement rule (`kv_layout`, `placement_sim`), attention time over captured layouts and what migration
costs (`attention_impls`, `attention_kernel`, `migration_cost`, `kernel_configs`, `_decode_cache_state`), kernel
launches on a GPU (`gpu_census`, `layer_loop`, the shared `_device_profile`), and the StreamingBench figures and the
batched evaluation behind them (`omnitide_figures`, `evaluate_scaling`). Results: `bench/omnitide/RESULTS.md`.
"""
