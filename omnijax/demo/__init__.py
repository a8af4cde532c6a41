"""`make demo`: a real model answering, what a bounded cache keeps of a long conversation, and the omni path.

In one run (`python -m omnijax.demo`):

1. **A real model.** SmolLM2-135M-Instruct, from the Q4_1 GGUF `make demo` installs (`omnijax/demo/smollm2.py`;
   nothing is downloaded at run time), converted once into `OUT/smollm2` and reused while the file is unchanged,
   answers a short chat through `omnijax.Chat`.
2. **A long conversation through a bounded cache** (`omnijax/demo/passkey.py`): turn 1 states a pass key, small talk
   follows, the last turn asks for the key; full context (NoSlide), OmniPick and a sliding window (SinkWindow) side
   by side: cells held, what is left of turn 1, each one's answer; `OUT/conversation.png` plots the three.
3. **The omni path** (`omnijax/demo/omni.py`) on a tiny Qwen2.5-Omni with random weights built here (audiovisual
   units through its encoders; the cache figures are real, the answers gibberish): `OUT/session.png`,
   `OUT/clip.mp4`.

Run: `python -m omnijax.demo [--out DIR] [--gguf FILE] [--model-dir DIR] [--exchanges N] [--budget CELLS]
[--seed S] [--units N]`. OUT (default `demo_out`) keeps the converted model between runs; the rest of it is
rewritten.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from omnijax import compilation_cache, plot
from omnijax.chat import Chat
from omnijax.demo import omni, passkey, smollm2
from omnijax.models.registry import load

SHORT_SYSTEM = "You are a helpful assistant."
SHORT_CHAT = ("What is the capital of France?", "And of Germany?")
PREVIOUS = ("omnijax", "hf", "session.png", "clip.mp4")  # what an older demo left in OUT


def main(argv: Sequence[str] | None = None) -> int:
    compilation_cache.enable()  # a command line caches its compiled programs (OMNIJAX_COMPILATION_CACHE)
    parser = argparse.ArgumentParser(prog="python -m omnijax.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="demo_out", help="working directory (default demo_out)")
    parser.add_argument("--gguf", default=None, help=f"SmolLM2's GGUF file (default ${smollm2.ENV}, else "
                                                     f"{smollm2.default_gguf()})")
    parser.add_argument("--model-dir", default=None, help="where the converted SmolLM2 is kept (default OUT/smollm2)")
    parser.add_argument("--exchanges", type=int, default=len(passkey.EXCHANGES),
                        help=f"small-talk exchanges between the pass key and the question (1-"
                             f"{len(passkey.EXCHANGES)}, default all)")
    parser.add_argument("--budget", type=int, default=512, help="cells the bounded caches hold (default 512)")
    parser.add_argument("--seed", type=int, default=0, help="picks the pass key")
    parser.add_argument("--units", type=int, default=12, help="audiovisual 2 s units of the omni session")
    parser.add_argument("--page-size", type=int, default=16, help="the omni session's KV page size")
    parser.add_argument("--high", type=int, default=400, help="the omni session's OmniPick high watermark (cells)")
    parser.add_argument("--low", type=int, default=280, help="the omni session's OmniPick low watermark (cells)")
    args = parser.parse_args(argv)
    if not 1 <= args.exchanges <= len(passkey.EXCHANGES):
        parser.error(f"--exchanges must be between 1 and {len(passkey.EXCHANGES)}")
    if args.budget < 64:
        parser.error("--budget must be at least 64 cells")
    if args.units < 1:
        parser.error("--units must be at least 1")
    try:
        gguf = smollm2.find_gguf(args.gguf)
    except smollm2.ModelFileMissing as e:
        print(f"python -m omnijax.demo: error: {e}", file=sys.stderr)
        return 1

    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in PREVIOUS:
        _remove(out / name)
    script = Path(sys.executable).parent / "omnijax"  # the console script installed beside this Python

    print("== 1. A real model: SmolLM2-135M-Instruct (Apache-2.0), from the GGUF `make demo` installed ==")
    ckpt, _ = smollm2.converted(gguf, Path(args.model_dir) if args.model_dir else out / "smollm2")
    model = load(ckpt)
    configs = passkey.configs(args.budget)
    chat = Chat(model, configs["NoSlide"])  # the long conversation's full-context config: same compiled steps
    chat.system(SHORT_SYSTEM)
    for question in SHORT_CHAT:
        print(f"you> {question}\nsmollm2> ", end="", flush=True)
        for delta in chat.ask(question, max_tokens=32):
            print(delta, end="", flush=True)
        print()

    key = passkey.pass_key(args.seed)
    tokens = passkey.conversation_tokens(model, args.exchanges, key)
    print(f"\n== 2. A long conversation through a bounded cache: {args.exchanges + 2} turns, {tokens} tokens ==")
    print(f"turn 1 states the pass key {key}; {args.exchanges} small-talk exchanges follow (their assistant turns "
          f"scripted); the last turn asks for the key. Full context vs OmniPick vs SinkWindow, the bounded two "
          f"holding about {args.budget} cells:")
    runs = [passkey.run(model, name, config, key=key, exchanges=args.exchanges) for name, config in configs.items()]
    print(passkey.table(runs, key))
    print("(cells held at the end; peak: most cells held after any turn; turn 1 kept: its tokens still cached)")
    try:
        figure = plot.compare({r.name: r.trace for r in runs}, out / "conversation.png",
                              title=f"SmolLM2-135M: {tokens}-token conversation, pass key in turn 1")
        print(f"wrote {figure}")
    except ImportError as e:
        print(f"(no plot: {e})")

    print("\n== 3. The omni path (audio + video units) on a tiny Qwen2.5-Omni with RANDOM weights ==")
    omni.run(out, units=args.units, page_size=args.page_size, high=args.high, low=args.low, script=script)
    print(f"\nnext: {script} chat {ckpt}\n      {script} serve {ckpt} --chunk-tokens 64 --port 8000"
          f"\n(done in {time.perf_counter() - started:.0f} s)")
    return 0


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
