"""Metronome (seed 002): serving many live sessions on one bounded KV pool.

What the scripts measure: the latency cliff of unbounded session KV, its first-order prediction and AIMD admission,
in-process and through the server's protocols (`serve_cliff`, `realtime_load`), and the per-step costs of serving:
step latency against the pool's size (`pool_scaling`), answer tokens with sampling (`decoding`), text in and out
through `Chat` (`text_io`), and how many sessions of Qwen3-Omni-30B-A3B fit one GPU with its MoE layer's time
(`qwen3_omni_moe`). Results: `bench/metronome/RESULTS.md`.
"""
