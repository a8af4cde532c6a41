"""The tiny Qwen2.5-Omni speech release (`tests._support.qwen25_speech.spoken_release25`) with its transformers half
kept on disk between test processes: building it imports torch and transformers and runs transformers' seeded
model (about 12 CPU s of a test module's setup); the kept copy is converted afresh each time, so what omnijax reads
is always its current converter's output.

`kept_release25` copies it to the caller's folder (so a test may read `root / "hf"` as transformers would), the
tiny tokenizer left out unless asked. The kept release (`config.json`, the safetensors, `spk_dict.pt`, the
tokenizer) lives under the suite's cache directory (`OMNIJAX_TEST_JAX_CACHE`'s parent, as tests/conftest.py places
it: ~/.cache/omnijax-tests/) in a folder named by a hash of what decides its bytes: the sources that build it (the
seeded model, its perturbations, the voices, the tiny configs, the tokenizer's trainer) and the torch,
transformers and tokenizers versions installed. Anything else rebuilds it. A copy is written to a temporary folder
and renamed into place, so a reader never sees half of one.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path

from omnijax.convert import convert_checkpoint

_ROOT = Path(__file__).resolve().parents[2]
# what the transformers release's bytes depend on (besides the versions)
SOURCES = ("tests/_support/qwen25_speech.py", "tests/_support/hf_models.py", "tests/_support/speech_refs.py",
           "tests/models/qwen2_5_omni/test_talker.py", "tests/models/qwen2_5_omni/test_speech.py",
           "tests/models/qwen2_5_omni/test_token2wav.py", "omnijax/models/tokenizer.py",
           "omnijax/models/chat_templates.py")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # what `write_tiny_tokenizer` writes


def release_key() -> str:
    """A hash of `SOURCES` and the torch / transformers / tokenizers versions (read from their metadata, nothing
    imported)."""
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode() + b"\0" + (_ROOT / name).read_bytes())
    for package in ("torch", "transformers", "tokenizers"):
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            version = "absent"
        digest.update(f"{package}={version}".encode())
    return digest.hexdigest()[:20]


def _cache_root() -> Path:
    jax_cache = os.environ.get("OMNIJAX_TEST_JAX_CACHE",
                               os.path.join(os.path.expanduser("~"), ".cache", "omnijax-tests", "jax"))
    return Path(jax_cache).resolve().parent / "releases"


def kept_release25(root: Path, *, tokenizer: bool = False) -> Path:
    """`spoken_release25(root, tokenizer=tokenizer)`'s release: its transformers half under `root / "hf"`, converted
    to `root / "out"` (returned). The transformers half is a copy of the kept one when one matches `release_key()`
    (else built, which needs torch and transformers, and kept); with `tokenizer` the copy holds the tiny ChatML
    tokenizer (kept with the release), else its files are left out."""
    kept = _cache_root() / f"qwen25-speech-{release_key()}"
    if not (kept / "config.json").is_file():
        import pytest

        pytest.importorskip("torch", reason="torch (the test extra) builds the transformers release")
        pytest.importorskip("transformers", reason="transformers (the test extra) builds the release")
        from tests._support.qwen25_speech import spoken_release25

        spoken_release25(root / "build", tokenizer=True)
        kept.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=kept.parent, prefix=".staging-"))
        shutil.copytree(root / "build" / "hf", staging, dirs_exist_ok=True)
        try:
            staging.rename(kept)
        except OSError:  # another process kept it first: theirs has the same bytes
            shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(kept, root / "hf", ignore=None if tokenizer else shutil.ignore_patterns(*TOKENIZER_FILES))
    return convert_checkpoint(root / "hf", root / "out", progress=False, log=lambda _: None)
