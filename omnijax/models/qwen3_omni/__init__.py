"""Qwen3-Omni (Qwen3-Omni-30B-A3B thinker) in Flax NNX.

- `audio.py`: the AuT audio encoder (100-frame chunks, windowed attention over `n_window_infer` frames).
- `vision.py`: the Qwen3-VL vision encoder and its DeepStack mergers.
- `config.py`: the thinker's modality ids and position rate (`Qwen3OmniConfig`).
- `positions.py`: `get_rope_index`, one-shot and unit by unit (`StreamPositions`).
- `thinker.py`: Hugging Face-style inputs -> placeholder embeddings, DeepStack levels, positions (`Model(...)`).
- `frontend.py`: raw frames / PCM / images -> ready chunks, as the release's processor prepares them.

The LLM is the shared decoder (`omnijax.models.decoder`) with Qwen3-MoE layers (`omnijax.models.moe`) and
interleaved M-RoPE; its units are built by `omnijax.models.qwen3_omni.layout`.
"""
