"""Evaluation harnesses: benchmark questions asked at their timestamps in streaming sessions, scored per task type
and per retention / paging configuration with `omnijax.evaluate`.

Modules: `annotations` (files -> videos, questions, timeline), `media` (text encoders, decoded or synthetic
video units), `sessions` (a video -> its chunks), `probes` (any timed user turn: the session building the other
benchmarks share), and one module per benchmark, each also its command line (`python -m omnijax.evalharness.X
--help`): `streamingbench`, `ovobench` (the user's copy of OVO-Bench's annotations, `--data`), `omnimmi` (annotations
shipped), `quality_probe` (Metronome's free-running quality probe).
"""

from omnijax.evalharness.annotations import (AnnotationError, Question, Video, load_all, load_file, parse_timestamp,
                                             place_questions, unit_of)
from omnijax.evalharness.media import ByteTextEncoder, CheckpointTextEncoder, TextEncoder, open_media, text_encoder
from omnijax.evalharness.sessions import BenchSession, ChunkBuilder, build_session

# `streamingbench` is also the CLI (`python -m omnijax.evalharness.streamingbench`); importing it here would load it
# before runpy executes it as __main__ (a RuntimeWarning on every run), so its names resolve on first use.
_FROM_STREAMINGBENCH = ("BenchReport", "parse_config", "run", "select_videos")


def __getattr__(name: str):
    if name in _FROM_STREAMINGBENCH:
        from omnijax.evalharness import streamingbench
        return getattr(streamingbench, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AnnotationError", "BenchReport", "BenchSession", "ByteTextEncoder", "ChunkBuilder", "CheckpointTextEncoder",
           "Question", "TextEncoder", "Video", "build_session", "load_all", "load_file", "open_media", "parse_config",
           "parse_timestamp", "place_questions", "run", "select_videos", "text_encoder", "unit_of"]
