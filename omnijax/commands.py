"""`omnijax chat` and `omnijax watch`: a checkpoint in the terminal, and a video streamed into it.

    omnijax chat CKPT [--policy omnipick --paging tile_skip --pages 96] [--speak out.wav --voice Chelsie]
    omnijax watch CKPT VIDEO --ask "What happened?" [--at 0:50] [--policy omnipick --paging tile_skip]
                  [--plot out.png] [--speak answers.wav --voice Chelsie]

`chat` reads one message per line from standard input and streams the answer; lines starting with `/` are commands:
`/image PATH`, `/audio PATH.wav`, `/video PATH`, `/kept` (what the cache holds), `/quit`. It starts with quick start
on (`Chat(quick_start=True)`, `omnijax.streaming.quick_start`): a fresh process's first steps, while the policy
cannot trim yet, run a program compiled quickly while the full step compiles in a background thread after the first
answer block, so with an empty compilation cache the first answer comes ~2x sooner (same tokens; the process then
exits once that compile has ended, and the full step is kept for the next process); `--no-quick-start` compiles the
full step before the first answer. `watch` feeds a video's
audiovisual units with a progress bar, asks each question at its time (`--at`, default the end), and prints the
answers and the cache's statistics. `omnijax.cli` dispatches to `main` here.

`chat --speak out.wav` (a checkpoint with speech output: Qwen3-Omni or Qwen2.5-Omni converted from its full release)
also speaks each answer (`Chat.ask(..., speak=...)`, `--voice`, default Ethan) and writes the whole conversation's
speech to one WAV file (16-bit mono PCM at the model's rate, 24 kHz), the answers one after the other; the file is
rewritten after each answer, so it is whole whenever the chat stops. A checkpoint without speech output or an unknown
voice is refused before the first message is read. Units fed with `/image`, `/audio` or `/video` lie before the
question's turn, so Qwen3-Omni's talker does not read them (it reads the questions and answers); Qwen2.5-Omni's reads
every unit, a video's audiovisual units included (kept with the positions they were fed at). `--early-start`
(Qwen2.5-Omni) starts its talker after each answer's first block instead of after the answer
(`SpeakOptions.early_start`). `--speech-first-chunk FRAMES` / `--speech-chunk FRAMES` set the vocoder's chunks
(`SpeakOptions.first_chunk` / `chunk`, default 4 then 25 codec frames); the streamed vocoders carry their state from
call to call, so any chunk of at least 1 frame gives the same speech, and a smaller one is refused before the
checkpoint is read.

`watch --speak answers.wav` speaks each answer the same way (all answers in one WAV file, in the order asked). The
video's units are fed outside the questions' user turns, so Qwen3-Omni's talker reads each question and its answer
only; Qwen2.5-Omni's reads the video's units too. A checkpoint without speech output, an unknown voice, or a talker
that reads every fed unit but cannot read audiovisual ones is refused before the video is read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence, TextIO

import numpy as np
from tqdm import tqdm

from omnijax import compilation_cache, plot
from omnijax.chat import Chat, SpeakOptions, clock, format_kept, kept_by_kind
from omnijax.decoding import Greedy, Sampling
from omnijax.media.audio import pcm16, read_wav, wav_bytes
from omnijax.models.registry import load
from omnijax.models.talker_kv import talker_policy
from omnijax.retention import get_policy
from omnijax.streaming.config import StreamConfig


def parse_clock(text: str) -> float:
    """`"50"`, `"0:50"`, `"1:02:03"` -> seconds."""
    try:
        parts = [float(p) for p in text.split(":")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a time: {text!r} (use seconds, M:SS or H:MM:SS)") from None
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts):
        raise argparse.ArgumentTypeError(f"not a time: {text!r} (use seconds, M:SS or H:MM:SS)")
    seconds = 0.0
    for p in parts:
        seconds = seconds * 60 + p
    return seconds


def _session_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT", help="converted omnijax checkpoint directory")
    parser.add_argument("--policy", default="full",
                        help="retention policy, with settings: e.g. omnipick, "
                             "omnipick:high_watermark=2500,low_watermark=1800, sink_window, full (default)")
    parser.add_argument("--paging", default="native", help="native (default), tile_skip, ordered_suffix, eager")
    parser.add_argument("--pages", type=int, default=256, help="KV pool pages (default 256)")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--impl", default="xla", help="attention: xla (default), pallas, reference")
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens per answer (default 256)")
    parser.add_argument("--block", type=int, default=16, help="answer tokens decoded per step (default 16)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy decoding")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--system", default=None, help="system message")


def build_parser(command: str) -> argparse.ArgumentParser:
    """The parser of `omnijax chat` or `omnijax watch`."""
    parser = argparse.ArgumentParser(prog=f"omnijax {command}", description=HELP[command])
    _session_options(parser)
    if command == "watch":
        parser.add_argument("video", metavar="VIDEO", help="a video file with an audio track (PyAV reads it)")
        parser.add_argument("--ask", action="append", required=True, help="a question (repeat for several)")
        parser.add_argument("--at", action="append", type=parse_clock, default=[],
                            help="when to ask (seconds or M:SS): the n-th --at goes with the n-th --ask; questions "
                                 "without one are asked at the video's end")
        parser.add_argument("--plot", default=None, help="write a PNG of the session's cache and latency")
        parser.add_argument("--silent-video", action="store_true",
                            help="take a video without an audio track (its units carry silence); refused otherwise")
    if command == "chat":
        parser.add_argument("--quick-start", action=argparse.BooleanOptionalAction, default=True,
                            help="run the first steps, while the retention policy cannot trim yet, in a program "
                                 "compiled quickly while the full step compiles in the background "
                                 "(Chat(quick_start=True); default on: a new process's first answer ~2x sooner "
                                 "with an empty compilation cache, the same tokens; --no-quick-start compiles the "
                                 "full step before the first answer)")
    parser.add_argument("--speak", default=None, metavar="OUT.wav",
                        help="speak each answer too (a checkpoint with speech output) and write the "
                             "conversation's speech to this WAV file")
    parser.add_argument("--voice", default=None, help="the voice of --speak (default Ethan)")
    parser.add_argument("--max-speech-tokens", type=int, default=None,
                        help="the talker's tokens at most per answer, one per 80 ms frame (default 4096)")
    parser.add_argument("--talker-window", type=int, default=None, metavar="CELLS",
                        help="bound the talker's KV cache of --speak: keep its newest CELLS cells (>= 2) beside "
                             "its 4 oldest (default: unbounded, what equals transformers)")
    parser.add_argument("--speech-first-chunk", type=int, default=None, metavar="FRAMES",
                        help="codec frames of the vocoder's first call of each spoken answer (>= 1; default 4: "
                             "320 ms for Qwen3-Omni; Qwen2.5-Omni rounds up to whole DiT blocks of 12)")
    parser.add_argument("--speech-chunk", type=int, default=None, metavar="FRAMES",
                        help="codec frames of each later vocoder call (>= 1; default 25), as --speech-first-chunk")
    parser.add_argument("--early-start", action="store_true",
                        help="Qwen2.5-Omni: start speaking after the answer's first block, from the rows the stream "
                             "computed (SpeakOptions.early_start; Qwen3-Omni's talker always starts with the answer)")
    return parser


HELP = {"chat": "talk to a checkpoint in the terminal",
        "watch": "stream a video file into a checkpoint and ask about it"}


def stream_config(args: argparse.Namespace) -> StreamConfig:
    """The `StreamConfig` of the session options."""
    decoding = Greedy() if args.temperature == 0 else Sampling(temperature=args.temperature, top_k=args.top_k,
                                                               top_p=args.top_p, seed=args.seed)
    return StreamConfig(policy=get_policy(args.policy), paging=args.paging, impl=args.impl, page_size=args.page_size,
                        num_pages=args.pages, max_answer_tokens=args.block, decoding=decoding)


def open_chat(args: argparse.Namespace) -> Chat:
    config = stream_config(args)  # refuses bad settings before the checkpoint is read
    model = load(args.checkpoint)
    chat = Chat(model, config, quick_start=getattr(args, "quick_start", False))  # (`chat` only: see --quick-start)
    if args.system:
        chat.system(args.system)
    return chat


def speak_options(args: argparse.Namespace) -> SpeakOptions | None:
    """The `SpeakOptions` of `--speak`, `--voice`, `--max-speech-tokens`, `--talker-window`, `--speech-first-chunk`,
    `--speech-chunk`, `--early-start` (None without `--speak`)."""
    speak = getattr(args, "speak", None)
    if speak is None:
        for flag in ("voice", "max_speech_tokens", "talker_window", "speech_first_chunk", "speech_chunk"):
            if getattr(args, flag, None) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} needs --speak OUT.wav")
        if getattr(args, "early_start", False):
            raise ValueError("--early-start needs --speak OUT.wav")
        return None
    if not str(speak).lower().endswith(".wav"):
        raise ValueError(f"--speak writes a WAV file: give a path ending in .wav, got {speak!r}")
    settings = {k: v for k, v in (("voice", args.voice), ("max_speech_tokens", args.max_speech_tokens),
                                  ("first_chunk", getattr(args, "speech_first_chunk", None)),
                                  ("chunk", getattr(args, "speech_chunk", None))) if v is not None}
    for flag in ("speech_first_chunk", "speech_chunk"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:  # the streamed vocoders carry their state: any chunk >= 1 works
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1 codec frame, got {value}")
    window = getattr(args, "talker_window", None)
    talker_policy(window, what="--talker-window")  # refused naming the flag
    return SpeakOptions(**settings, talker_window=window, early_start=bool(getattr(args, "early_start", False)))


class SpeechFile:
    """The conversation's speech as one WAV file at `path`, rewritten whole after each answer (`add`)."""

    def __init__(self, path: str | Path, sample_rate: int):
        self.path, self.sample_rate = Path(path), int(sample_rate)
        self.samples: list[np.ndarray] = []

    def add(self, chunks: list[np.ndarray]) -> float:
        """Appends an answer's float PCM chunks, rewrites the file; returns the answer's seconds."""
        pcm = pcm16(np.concatenate(chunks)) if chunks else np.zeros((0,), "<i2")
        self.samples.append(pcm)
        self.path.write_bytes(wav_bytes(np.concatenate(self.samples), self.sample_rate))
        return pcm.shape[0] / self.sample_rate


def _answer(chat, question: str, max_tokens: int, out, speak: SpeakOptions | None = None,
            speech: SpeechFile | None = None) -> str:
    text, pcm = [], []
    for delta in chat.ask(question, max_tokens=max_tokens, speak=speak or False):
        if isinstance(delta, str):
            out.write(delta)
            out.flush()
            text.append(delta)
        else:
            pcm.append(delta)
    out.write("\n")
    if speech is not None:
        out.write(f"[spoke {speech.add(pcm):.2f} s -> {speech.path}]\n")
    return "".join(text)


def run_chat(args: argparse.Namespace, stdin: TextIO | None = None, out: TextIO | None = None) -> int:
    stdin, out = stdin or sys.stdin, out or sys.stdout
    speak = speak_options(args)  # refuses bad settings before the checkpoint is read
    chat = open_chat(args)
    speech = None
    if speak is not None:
        chat.check_speak(speak)  # a checkpoint without speech output, an unknown voice: before any message
        assert chat.model.speech is not None
        speech = SpeechFile(args.speak, chat.model.speech.sample_rate)
    interactive = stdin.isatty()
    if interactive:
        out.write("omnijax chat: one message per line; /image PATH, /audio PATH.wav, /video PATH, /kept, /quit\n")
    while True:
        if interactive:
            out.write("you> ")
            out.flush()
        line = stdin.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        command, _, rest = line.partition(" ")
        try:
            if command == "/quit":
                break
            elif command == "/kept":
                out.write(format_kept(chat.kept()) + "\n")
            elif command == "/image":
                chat.image(rest.strip())
            elif command == "/audio":
                chat.audio(*read_wav(rest.strip()))
            elif command == "/video":
                units = chat.video(rest.strip())
                out.write(f"[fed {units} audiovisual units]\n")
            elif command.startswith("/"):
                out.write(f"unknown command {command}; known: /image /audio /video /kept /quit\n")
            else:
                if interactive:
                    out.write("model> ")
                _answer(chat, line, args.max_tokens, out, speak, speech)
        except (ValueError, ImportError) as e:  # bad input: the conversation is unchanged, keep going
            out.write(f"error: {e}\n")
    return 0


def run_watch(args: argparse.Namespace, out: TextIO | None = None) -> int:

    out = out or sys.stdout
    if len(args.at) > len(args.ask):
        raise ValueError(f"{len(args.at)} --at times for {len(args.ask)} --ask questions: each --at goes with the "
                         f"--ask of the same rank")
    speak = speak_options(args)  # refuses bad settings before the checkpoint is read
    chat = open_chat(args)
    speech = None if speak is None else _watch_speech(chat, speak, args.speak)
    units = chat.units_builder
    source = units.open_video(args.video, need_audio=not args.silent_video)  # checked up front
    end = source.num_units * units.unit_seconds
    times = list(args.at) + [end] * (len(args.ask) - len(args.at))
    # the units fed: up to the last question's time (the rest of the video is never read)
    through = min(source.num_units, int(-(-max(times) // units.unit_seconds)))
    bar = tqdm(total=through, unit="unit", desc="video", file=sys.stderr)
    fed_until, iterator = 0, iter(source.units())
    for at, question in sorted(zip(times, args.ask), key=lambda pair: pair[0]):
        target = min(source.num_units, int(-(-at // units.unit_seconds)))
        while fed_until < target:
            unit = next(iterator, None)
            if unit is None:  # the file ended before its stated duration (omnijax.media.video warned, naming it)
                target = fed_until
                break
            frames, pcm = unit
            at = fed_until * units.unit_seconds
            chat.av(frames, pcm, label=f"{clock(at)}-{clock(at + units.unit_seconds)}")
            fed_until += 1
            bar.update(1)
        bar.clear()
        out.write(f"[{fed_until * units.unit_seconds:g} s] Q: {question}\nA: ")
        _answer(chat, question, args.max_tokens, out, speak, speech)
        bar.refresh()
    bar.close()
    steps = chat.steps
    last = steps[-1]
    out.write(f"\nKV: {last.retained} cells retained, physical span {last.physical_span}, {last.active_pages} active "
              f"pages of {args.pages}; peak span {max(s.physical_span for s in steps)}; "
              f"median step {sorted(s.latency_ms for s in steps)[len(steps) // 2]:.1f} ms over {len(steps)} steps\n")
    out.write(format_kept(kept_by_kind(chat.kept())) + "\n")
    if args.plot:
        out.write(f"wrote {plot.session(chat, args.plot)}\n")
    return 0


def _watch_speech(chat: Chat, speak: SpeakOptions, path: str) -> SpeechFile:
    """The WAV file of `watch --speak`, after checking this chat can speak answers about a video's units."""
    chat.check_speak(speak)  # a checkpoint without speech output, an unknown voice: before the video is read
    speech = chat.model.speech
    assert speech is not None
    tap = getattr(speech, "media_tap", None)
    if tap is not None and tap(()) is not None and "av" not in getattr(speech, "media_kinds", ("image", "audio")):
        raise ValueError("--speak: this checkpoint's talker reads every unit fed, wherever it lies, and cannot read "
                         "a video's audiovisual units; watch cannot speak its answers (Qwen3-Omni's talker reads "
                         "only the questions and answers)")
    return SpeechFile(path, speech.sample_rate)


def main(command: str, argv: Sequence[str]) -> int:
    """Runs `omnijax chat ...` or `omnijax watch ...` (`command`, then the arguments after it).

    Returns:
        The exit status: 0, 1 for bad settings or input (named on standard error), 2 for bad arguments.
    """
    compilation_cache.enable()  # a command line caches its compiled programs (OMNIJAX_COMPILATION_CACHE)
    args = build_parser(command).parse_args(list(argv))
    args.command = command
    try:
        return run_chat(args) if command == "chat" else run_watch(args)
    except (ValueError, KeyError, TypeError, ImportError, OSError) as e:  # bad settings or input, named
        print(f"omnijax {command}: error: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 1
