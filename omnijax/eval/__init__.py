"""Evaluation: `evaluate` (many streamed sessions x configurations as jitted, sharded programs; `runner`), meshes
(`mesh`), and the benchmark harnesses, each also its command line (`python -m omnijax.eval.X --help`):

- `streamingbench`: every StreamingBench video a streaming session, every question asked at its timestamp;
- `ovobench`: OVO-Bench (the user's copy of its annotations, `--data`);
- `omnimmi`: OmniMMI (annotations shipped);
- `quality_probe`: Metronome's free-running quality probe on the engine's ticks.

Their shared pieces: `annotations` (files -> videos, questions, timeline), `media` (text encoders, decoded or
synthetic video units), `sessions` (a video -> its chunks) and `probes` (timed user turns).
"""

from omnijax.eval.runner import EvalConfig, evaluate

__all__ = ["EvalConfig", "evaluate"]
