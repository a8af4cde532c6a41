"""The demo's omni path, on a tiny Qwen2.5-Omni with RANDOM weights built here: real cache figures, gibberish answers.

Builds a tiny random Qwen2.5-Omni checkpoint in Hugging Face layout with a tiny tokenizer, converts it as
`omnijax convert` does, and streams one synthetic session (a system message, `units` 2 s units of moving shapes and
a tone through the vision and audio encoders, then a question) through `omnijax.Chat` with full context (NoSlide)
and with OmniPick on tile_skip paging. Prints cells held, peak span, active pages, per-unit latency, the answer and
what the bounded cache keeps per unit, and writes `session.png` and `clip.mp4` (the session's frames and audio, for
`omnijax watch`).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from omnijax import plot
from omnijax.chat import Chat, clock, format_kept, kept_by_kind
from omnijax.convert import convert_checkpoint
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
RUNS = ("NoSlide", "OmniPick+tile_skip")


def configs(total_tokens: int, page_size: int, high: int, low: int) -> dict[str, StreamConfig]:
    """Full context, and OmniPick (`high` / `low` watermarks) on tile_skip paging."""
    pick = OmniPick(high_watermark=high, low_watermark=low, recent_units=2)
    bounded = -(-2 * high // page_size) + 8  # room for the trim's high watermark, the answer and class pages
    return {"NoSlide": StreamConfig(num_pages=-(-total_tokens // page_size) + 8, page_size=page_size),
            "OmniPick+tile_skip": StreamConfig(policy=pick, paging="tile_skip", num_pages=bounded,
                                               page_size=page_size)}


def run(out: Path, *, units: int, page_size: int, high: int, low: int, script: Path) -> None:
    """Builds the random checkpoint under `out` (`out/omni-random`), streams the session both ways, prints the
    tables and writes `out/session.png` and `out/clip.mp4`."""
    hf_dir = write_chat_checkpoint(out / "omni-random-hf")
    ckpt = out / "omni-random"
    print(f"built a tiny Qwen2.5-Omni with RANDOM weights (Hugging Face layout) and a tiny tokenizer: {hf_dir}")
    print(f"$ omnijax convert {hf_dir} {ckpt}", flush=True)
    convert_checkpoint(hf_dir, ckpt, force=True, progress=False, log=lambda message: None)
    model = load(ckpt)
    print(f"loaded: {model.config.num_layers} layers, hidden {model.config.hidden_size}, vocab "
          f"{model.config.vocab_size}; audio and vision encoders: "
          f"{'yes' if model.audio is not None and model.vision is not None else 'no'}")
    session_units = synthetic_units(units)
    clip = _write_clip(out / "clip.mp4", session_units)
    video_kwargs = {"min_pixels": DEMO_VIDEO_MIN_PIXELS}
    frames, pcm = session_units[0]
    per_unit = units_for(model).av(frames, pcm, 0, **video_kwargs).length
    print(f"session: a system message, {units} audiovisual units ({units * UNIT_SECONDS:g} s: {FRAME_HEIGHT}x"
          f"{FRAME_WIDTH} frames at {FPS:g} fps + a 16 kHz tone; {per_unit} tokens each, {units * per_unit} in "
          f"all), then a question answered as text")
    rows, traces, chats = [], {}, {}
    for name, config in configs(units * per_unit + 256, page_size, high, low).items():
        chat = Chat(model, config, video_kwargs=video_kwargs)
        chat.system(SYSTEM)
        started = time.perf_counter()
        for k, (frames, pcm) in enumerate(tqdm(session_units, desc=f"{name:>18}", unit="unit", leave=False,
                                               disable=None)):
            chat.av(frames, pcm, label=f"{clock(k * UNIT_SECONDS)}-{clock((k + 1) * UNIT_SECONDS)}")
        answer = "".join(chat.ask(QUESTION, max_tokens=8))
        seconds = time.perf_counter() - started
        av_ms = sorted(s.latency_ms for s in chat.steps if s.label == "av")
        rows.append((name, chat.steps[-1].retained, max(s.physical_span for s in chat.steps),
                     chat.steps[-1].active_pages, config.num_pages, av_ms[len(av_ms) // 2], seconds, answer))
        traces[name], chats[name] = chat.trace(), chat
    print(f"{'policy':>18} {'cells held':>10} {'peak span':>9} {'pages':>5} {'pool':>5} {'ms/unit':>7} "
          f"{'total s':>7}  answer (RANDOM weights: any text)")
    for name, retained, span, pages, pool, ms, seconds, answer in rows:
        print(f"{name:>18} {retained:>10} {span:>9} {pages:>5} {pool:>5} {ms:>7.1f} {seconds:>7.1f}  {answer!r}")
    print("(cells held at the end; peak span: the largest extent attention traversed; pages: active pages at the "
          "end; ms/unit: median per audiovisual unit, encoders included)")
    print("\nwhat OmniPick+tile_skip keeps, per kind of unit and span (Chat.kept(), summed by kept_by_kind):")
    print(format_kept(kept_by_kind(chats["OmniPick+tile_skip"].kept())))
    try:
        print(f"wrote {plot.compare(traces, out / 'session.png', title=f'{units} audiovisual units, random weights')}")
    except ImportError as e:
        print(f"(no plot: {e})")
    if clip is not None:
        print(f"next: {script} watch {ckpt} {clip} --ask \"What happened?\" --at 0:10 --policy omnipick "
              f"--paging tile_skip --plot {out / 'watch.png'}")


def _write_clip(path: Path, units) -> Path | None:
    """The session's frames and audio as an mp4 (for `omnijax watch`), when PyAV is installed."""
    frames = np.concatenate([f for f, _ in units])
    pcm = np.concatenate([p for _, p in units])
    try:
        return video.write_clip(path, frames, int(FPS), pcm)
    except ImportError:
        print("(PyAV is not installed, so no clip.mp4 for `omnijax watch`: pip install 'omnijax[video]')")
        return None
