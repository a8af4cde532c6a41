"""MiniCPM-o 4.5 in Flax NNX: vision (SigLIP/NaViT + resampler), audio (Whisper encoder + projector) and helpers."""
