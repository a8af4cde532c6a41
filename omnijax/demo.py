"""`make demo`: what a bounded cache buys on a long audiovisual stream, on a tiny model built here (no download).

Builds a tiny random Qwen2.5-Omni checkpoint in Hugging Face format with a tiny tokenizer, converts it with
`omnijax convert`, loads it, and streams one synthetic session (a system message, `--units` 2 s units of moving
shapes and a tone through the vision and audio encoders, then a question) through `omnijax.Chat` three times: full
context (NoSlide), OmniPick with small watermarks, and OmniPick with tile_skip paging. Prints a table (cells
retained, peak span, active pages, per-unit latency, the answer as text) and what the bounded cache keeps per unit,
writes `session.png` (the three runs over the session) and `clip.mp4` (the session's frames and audio, for
`omnijax watch`), and prints the commands to try next on the tiny checkpoint.

Run: `python -m omnijax.demo [--out DIR] [--units N] [--page-size P] [--high H] [--low L]`.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from omnijax import compilation_cache, plot
from omnijax.chat import Chat, clock, format_kept, kept_by_kind
from omnijax.media import video
from omnijax.models.frontend import units_for
from omnijax.models.registry import load
from omnijax.retention import OmniPick
from omnijax.streaming.config import StreamConfig
from omnijax.testing.checkpoints import (
    DEMO_VIDEO_MIN_PIXELS,
    FPS,
    FRAME_HEIGHT,
    FRAME_WIDTH,
    UNIT_SECONDS,
    synthetic_units,
    write_chat_checkpoint,
)

SYSTEM = "You are watching a live stream. Answer briefly."
QUESTION = "What colour was the first shape you saw?"


def _configs(total_tokens: int, page_size: int, high: int, low: int):
    pick = OmniPick(high_watermark=high, low_watermark=low, recent_units=2)
    bounded = -(-2 * high // page_size) + 8  # room for the trim's high watermark, the answer and class pages
    return {"NoSlide": StreamConfig(num_pages=-(-total_tokens // page_size) + 8, page_size=page_size),
            "OmniPick": StreamConfig(policy=pick, num_pages=bounded, page_size=page_size),
            "OmniPick+tile_skip": StreamConfig(policy=pick, paging="tile_skip", num_pages=bounded,
                                                       page_size=page_size)}


def main(argv: Sequence[str] | None = None) -> int:
    compilation_cache.enable()  # a command line caches its compiled programs (OMNIJAX_COMPILATION_CACHE)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="demo_out", help="working directory (replaced)")
    parser.add_argument("--units", type=int, default=48, help="audiovisual 2 s units in the session (default 48)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--high", type=int, default=800, help="OmniPick's high watermark (cells)")
    parser.add_argument("--low", type=int, default=560, help="OmniPick's low watermark (cells)")
    args = parser.parse_args(argv)
    if args.units < 1:
        parser.error("--units must be at least 1")



    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    hf_dir = write_chat_checkpoint(out / "hf")
    print(f"wrote a tiny random Qwen2.5-Omni checkpoint (Hugging Face layout) and a tiny tokenizer to {hf_dir}")
    script = Path(sys.executable).parent / "omnijax"  # the console script installed beside this Python
    cmd = [str(script), "convert", str(hf_dir), str(out / "omnijax"), "--no-progress"]
    print("$ omnijax convert", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True)
    model = load(out / "omnijax")
    print(f"loaded: {model.config.num_layers} layers, hidden {model.config.hidden_size}, vocab "
          f"{model.config.vocab_size}; audio and vision encoders: "
          f"{'yes' if model.audio is not None and model.vision is not None else 'no'}; tokenizer: "
          f"{'yes' if model.tokenizer is not None else 'no'}")

    units = synthetic_units(args.units)
    clip = _write_clip(out / "clip.mp4", units)
    video_kwargs = {"min_pixels": DEMO_VIDEO_MIN_PIXELS}
    frames, pcm = units[0]
    probe = units_for(model).av(frames, pcm, 0, **video_kwargs)
    total = args.units * probe.length + 256
    print(f"session: a system message, {args.units} audiovisual units ({args.units * UNIT_SECONDS:g} s: "
          f"{FRAME_HEIGHT}x{FRAME_WIDTH} frames at {FPS:g} fps + a 16 kHz tone; {probe.length} tokens each, "
          f"{args.units * probe.length} in all), then a question answered as text")

    rows, traces, chats = [], {}, {}
    for name, config in _configs(total, args.page_size, args.high, args.low).items():
        chat = Chat(model, config, video_kwargs=video_kwargs)
        chat.system(SYSTEM)
        started = time.perf_counter()
        for k, (frames, pcm) in enumerate(tqdm(units, desc=f"{name:>18}", unit="unit", leave=False, disable=None)):
            chat.av(frames, pcm, label=f"{clock(k * UNIT_SECONDS)}-{clock((k + 1) * UNIT_SECONDS)}")
        answer = "".join(chat.ask(QUESTION, max_tokens=12))
        seconds = time.perf_counter() - started
        av_ms = sorted(s.latency_ms for s in chat.steps if s.label == "av")
        rows.append((name, chat.steps[-1].retained, max(s.physical_span for s in chat.steps),
                     chat.steps[-1].active_pages, config.num_pages, av_ms[len(av_ms) // 2], seconds, answer))
        traces[name], chats[name] = chat.trace(), chat

    header = f"{'policy':>18} {'retained':>8} {'peak span':>9} {'pages':>5} {'pool':>5} {'ms/unit':>7} {'total s':>7}"
    print(header + "  answer (random weights: any text)")
    for name, retained, span, pages, pool, ms, seconds, answer in rows:
        print(f"{name:>18} {retained:>8} {span:>9} {pages:>5} {pool:>5} {ms:>7.1f} {seconds:>7.1f}  {answer!r}")
    print("(retained: cells held at the end; peak span: the largest extent attention traversed; pages: active pages "
          "at the end; ms/unit: median per audiovisual unit, encoders included)")
    kept = chats["OmniPick+tile_skip"].kept()
    print("\nwhat OmniPick+tile_skip keeps, per kind of unit and span (Chat.kept(), summed by kept_by_kind):")
    print(format_kept(kept_by_kind(kept)))
    print("the last audiovisual units and the question, unit by unit:")
    print("\n".join(format_kept(kept).splitlines()[-9:]))
    try:
        figure = plot.compare(traces, out / "session.png", title=f"{args.units} audiovisual units")
        print(f"\nwrote {figure}")
    except ImportError as e:
        print(f"\n(no plot: {e})")
    print(f"\nnext: {script} chat {out / 'omnijax'}")
    if clip is not None:
        print(f"      {script} watch {out / 'omnijax'} {clip} --ask \"What happened?\" --at 0:10 "
              f"--policy omnipick --paging tile_skip --plot {out / 'watch.png'}")
    return 0


def _write_clip(path: Path, units) -> Path | None:
    """The session's frames and audio as an mp4 (for `omnijax watch`), when PyAV is installed."""
    frames = np.concatenate([f for f, _ in units])
    pcm = np.concatenate([p for _, p in units])
    try:
        return video.write_clip(path, frames, int(FPS), pcm)
    except ImportError:
        print("(PyAV is not installed, so no clip.mp4 for `omnijax watch`: pip install 'omnijax[video]')")
        return None


if __name__ == "__main__":
    sys.exit(main())
