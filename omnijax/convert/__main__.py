"""Command line: `omnijax-convert SRC DST [--dtype float32|bfloat16] [--quantize int8|int4 [--group-size N]]
[--keep-quantized] [--force]` (also `python -m omnijax.convert` and
`omnijax convert`). SRC is a Hugging Face safetensors checkpoint directory or a `.gguf` file."""

from __future__ import annotations

import argparse
import sys

from omnijax import compilation_cache
from omnijax.checkpoint.format import CheckpointFormatError
from omnijax.convert import DTYPES, SUPPORTED_MODEL_TYPES, QuantizeOptions, convert_checkpoint
from omnijax.convert.gguf import ARCHITECTURES as GGUF_ARCHITECTURES
from omnijax.convert.quantize import QUANTIZE_CHOICES
from omnijax.errors import ConvertError
from omnijax.kernels.quant import GROUP_SIZES


def build_parser(prog: str = "omnijax-convert") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Convert a Hugging Face safetensors checkpoint directory, or a GGUF file (llama.cpp), into an "
                    f"omnijax checkpoint (supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}; GGUF "
                    f"architectures: {', '.join(GGUF_ARCHITECTURES)}, needs pip install 'omnijax[gguf]').")
    parser.add_argument("src", metavar="SRC", help="Hugging Face checkpoint directory (config.json + safetensors), or "
                        "a .gguf file (config, weights dequantised and tokenizer from the file)")
    parser.add_argument("dst", metavar="DST", help="output directory")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="parameter dtype (default: float32); GGUF tensors are dequantised to it")
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=None,
                        help="store the decoder's linear weights quantised: int8 (one scale per output channel, or per "
                             "--group-size rows) or int4 (scale and offset per --group-size rows, default 32)")
    parser.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=None,
                        help="input rows per scale of --quantize (must divide every linear weight's input width)")
    parser.add_argument("--keep-quantized", action="store_true",
                        help="GGUF only: keep Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K weights quantised (repacked, no float "
                             "round trip); other types are dequantised, or requantised with --quantize, and reported")
    parser.add_argument("--force", action="store_true",
                        help="replace DST if it exists and is not empty (a DST that is a symbolic link is refused)")
    parser.add_argument("--no-progress", action="store_true", help="do not show the progress bar")
    return parser


def main(argv: list[str] | None = None, prog: str = "omnijax-convert") -> int:
    """Runs the converter; returns the process exit code (0 on success, 1 on a reported error)."""
    compilation_cache.enable()  # a command line caches its compiled programs (OMNIJAX_COMPILATION_CACHE)
    args = build_parser(prog).parse_args(argv)
    try:
        out = convert_checkpoint(args.src, args.dst, dtype=args.dtype, force=args.force,
                                 progress=not args.no_progress,
                                 quantize=QuantizeOptions(args.quantize, args.group_size, args.keep_quantized))
    except (ConvertError, CheckpointFormatError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
