"""TideKV (seed 001): layer-major prefill with delayed (per-layer) eviction against post-prefill compression.

What the scripts measure: transient construction memory and time to first token against post-prefill SnapKV
(`prefill_memory`, with its methods in `_prefill_memory_compiled`, `_prefill_memory_rss` and
`_prefill_memory_common`), the prompt-encoding fidelity of the schedules (`prefill_fidelity`), and TideKV against
kvpress on the real model (`vs_kvpress`: time and memory). Results: `bench/tidekv/RESULTS.md`.
"""
