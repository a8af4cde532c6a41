"""The `omnijax` command: `convert`, `chat`, `watch`, `serve`.

    omnijax convert SRC DST [--dtype bfloat16]          # Hugging Face safetensors or MODEL.gguf -> omnijax checkpoint
    omnijax chat CKPT [--policy omnipick --paging tile_skip --pages 96]
    omnijax watch CKPT VIDEO --ask "What happened?" [--at 0:50] [--policy omnipick --paging tile_skip]
                  [--plot out.png]
    omnijax serve CKPT [...]                            # OpenAI-compatible + native server (omnijax-serve)
    omnijax --version

This module is the dispatcher only: it imports a subcommand's module (and with it jax and the model code) when that
subcommand runs, so `omnijax --help`, `omnijax --version` and a mistyped subcommand answer at once. Each
subcommand's own options are in `omnijax SUBCOMMAND --help`. `omnijax-convert` and `omnijax-serve` remain as aliases.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from omnijax._version import __version__

# subcommand -> (module, its entry function, one line of help). The entry functions take the arguments after the
# subcommand; `chat` and `watch` share one module and take the subcommand's name first. The modules are imported by
# name when their subcommand runs (all are in the applications layer, as this module is; tests/test_imports.py
# checks the table).
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "convert": ("omnijax.convert.__main__", "main",
                "convert a Hugging Face checkpoint or a GGUF file (see omnijax convert --help)"),
    "chat": ("omnijax.commands", "main", "talk to a checkpoint in the terminal"),
    "watch": ("omnijax.commands", "main", "stream a video file into a checkpoint and ask about it"),
    "serve": ("omnijax.serve.app", "main", "serve a checkpoint (see omnijax serve --help)"),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: the subcommands with their help, `--version`."""
    parser = argparse.ArgumentParser(prog="omnijax", description="Streaming omni-modal LLMs with a bounded KV cache.",
                                     epilog="`omnijax SUBCOMMAND --help` lists a subcommand's options.")
    parser.add_argument("--version", action="version", version=f"omnijax {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, (_, _, help_) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs `omnijax ARGS` (default: the process's arguments).

    Returns:
        The subcommand's exit status; 2 without a subcommand (after printing the help).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        command, rest = argv[0], argv[1:]
        module, function, _ = SUBCOMMANDS[command]
        entry = getattr(importlib.import_module(module), function)
        if command == "convert":
            return entry(rest, prog="omnijax convert")
        return entry(command, rest) if module == "omnijax.commands" else entry(rest)
    parser = build_parser()
    parser.parse_args(argv)  # --help, --version and unknown subcommands end here
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
