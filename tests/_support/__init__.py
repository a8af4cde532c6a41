"""What the tests share: tiny checkpoints and models, plain-Python references of the vectorised policies, random
unit streams, multi-device runners, and the golden data (`data/`)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
DATA = Path(__file__).resolve().parent / "data"  # golden files (see data/README.md)
