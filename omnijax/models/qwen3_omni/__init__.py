"""Qwen3-Omni (Qwen3-Omni-30B-A3B thinker) in Flax NNX."""
