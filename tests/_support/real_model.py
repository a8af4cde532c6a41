"""The real model in tests: SmolLM2-135M-Instruct's GGUF, which `make test` installs (`make smollm2`), converted once
into a cache outside the clone and shared by the test modules and their reruns.

    $OMNIJAX_SMOLLM2_GGUF, else <sys.prefix>/share/omnijax/SmolLM2-135M-Instruct.Q4_1.gguf   the file
    $OMNIJAX_TEST_MODEL_CACHE, else ~/.cache/omnijax-tests/models                         the conversion

The conversion is keyed by the file (name, size, modification time) and the converter's source
(`omnijax.demo.smollm2.converted`), so a changed converter converts again. The transformers reference loads the same
file with its GGUF loader once and keeps what it loaded (`save_pretrained`, keyed by the file and the transformers
version): reading the GGUF through transformers takes ~30 s of CPU, its saved copy ~2 s. `make test` sets
$OMNIJAX_SMOLLM2_GGUF, so a missing file fails the tests that need it; run elsewhere without the file, they skip,
naming `make smollm2`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from omnijax.demo import smollm2

CACHE_ENV = "OMNIJAX_TEST_MODEL_CACHE"


def cache_dir() -> Path:
    """Where converted test models are kept."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "omnijax-tests", "models")
    return Path(os.environ.get(CACHE_ENV) or default)


def gguf_file() -> Path:
    """The installed GGUF file; skips (fails when $OMNIJAX_SMOLLM2_GGUF named it) when it is missing."""
    try:
        return smollm2.find_gguf()
    except smollm2.ModelFileMissing as e:
        if os.environ.get(smollm2.ENV):
            pytest.fail(str(e))
        pytest.skip(str(e))


def checkpoint() -> Path:
    """The omnijax checkpoint of the GGUF file, converted on first use (about 20 s) and then reused."""
    path, _ = smollm2.converted(gguf_file(), cache_dir() / "smollm2", log=lambda line: None)
    return path


def transformers_reference() -> tuple[Any, Any]:
    """`(model, tokenizer)`: transformers' float32 model and tokenizer of the GGUF file, as its GGUF loader
    (`from_pretrained(dir, gguf_file=...)`) reads them; saved on first use and loaded from the copy later."""
    import torch  # the test extra
    import transformers  # the test extra

    path = gguf_file()
    key = dict(smollm2.source_key(path), transformers=transformers.__version__)
    key.pop("converter_sha256")
    saved = cache_dir() / "smollm2-transformers"
    with smollm2.locked(saved):
        try:
            fresh = json.loads((saved / "gguf-source.json").read_text()) == key
        except (OSError, ValueError):
            fresh = False
        if fresh:
            model = transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
            return model.eval(), transformers.AutoTokenizer.from_pretrained(saved)
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        staging = saved.with_name(f".{saved.name}.tmp")
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "gguf-source.json").write_text(json.dumps(key))
        shutil.rmtree(saved, ignore_errors=True)
        os.replace(staging, saved)
        return model.eval(), tokenizer
