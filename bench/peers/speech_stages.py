"""The spoken answer stage by stage (issue 39 item 5): wall and CPU seconds per generated audio second of the thinker,
the talker, the code predictor and Code2Wav on CPU for `bench.peers.speech_latency`'s tiny seeded Qwen3-Omni release
(saved by transformers, converted by `omnijax convert`; its end-to-end first PCM against transformers is that
script's), a Code2Wav chunk sweep (first call 2 / 4 / 8 frames, then 10 / 25 / 50 a call: first packet against RTF),
and beside them the full-size analytic budget of Qwen3-Omni-30B-A3B (`bench.peers._speech_budget`: FLOPs and bytes
per audio second of every stage from the release's widths, the report's per-frame figures beside them) projected to
a first packet and RTF at a stated accelerator, every stage at its roofline and every stage at the report's rates,
against the report's 234 ms / 0.47. Then Qwen2.5-Omni's stages
(`bench.peers._speech_stages_qwen25`: thinker, talker, Token2Wav's DiT and BigVGAN, and the first packet, on a tiny
seeded release at the release's codec rates, 50 tokens an audio second; `--qwen25-frames` codec tokens).

Each stage runs alone, once unmeasured (compilation), then `--rounds` times measured (medians):

    thinker          `Chat.ask` of the question without speech (decoded 16 tokens a block); per token = the
                     answer's time, prefill included, / its tokens (an upper bound); RTF at one text token per 80 ms
                     frame (the report's convention: 12.5 tokens an audio second)
    talker           the talker's prefill, then `--frames` steps (`talker_decode.TalkerDecode.advance`: the talker
                     and its code predictor in one compiled call), less the code predictor's time
    code predictor   `talker_forward.predict_codes` alone on a talker hidden state, `--frames` calls
    vocoder          `Code2WavStream.push` of the talker's frames in chunks: the first call `first` frames, then
                     `chunk` a call, for each pair of the sweep (the stage row: first 4, then 25)

    RTF              compute seconds / audio seconds (80 ms a frame); below 1 keeps up
    first packet     thinker answer + talker prefill + `first` talker steps + Code2Wav's first call, each as
                     measured alone (serial: no stage overlaps another)

CPU figures of tiny weights: they say where the time goes and how the first chunk moves the first packet, not what
a GPU does at full size (the analytic table; measured GPU figures belong to the GPU issue).

    python -m bench.peers.speech_stages --rounds 3 --out bench/peers/results
"""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from bench import harness
from bench.peers import _speech_budget as budget_lib
from bench.peers import _speech_stages_qwen25 as qwen25
from bench.peers import speech_latency as release

FIRST_CHUNKS, CHUNKS = (2, 4, 8), (10, 25, 50)
VOCODER_ROW = (4, 25)  # the stage row's Code2Wav schedule (vllm-omni's); the sweep's median when not swept


def _clock():
    return time.perf_counter(), harness.cpu_seconds()


def _since(mark) -> tuple[float, float]:
    wall, cpu = _clock()
    return wall - mark[0], cpu - mark[1]


def thinker_times(model, answer_tokens: int) -> tuple[float, float]:
    """Wall / CPU seconds of the whole answer (`Chat.ask` without speech: prefill and decode)."""
    import omnijax

    chat = omnijax.Chat(model, omnijax.StreamConfig(num_pages=64, page_size=16, max_answer_tokens=16))
    chat.system(release.SYSTEM)
    mark = _clock()
    for _ in chat.ask(release.QUESTION, max_tokens=answer_tokens):
        pass
    return _since(mark)


def spoken_ids(model, answer_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The prompt and answer ids `Chat` speaks for the question (greedy: the same answer every time)."""
    import omnijax
    from omnijax.chat import SpeakOptions

    chat = omnijax.Chat(model, omnijax.StreamConfig(num_pages=64, page_size=16, max_answer_tokens=16))
    chat.system(release.SYSTEM)
    for _ in chat.ask(release.QUESTION, max_tokens=answer_tokens,
                      speak=SpeakOptions(max_speech_tokens=2, first_chunk=1, chunk=1)):
        pass
    spoken = chat.last_spoken
    assert spoken is not None and spoken.answer_ids, "the thinker gave no answer to speak"
    return np.asarray(spoken.prompt_ids), np.asarray(spoken.answer_ids)


def talker_times(model, prompt: np.ndarray, answer: np.ndarray, frames: int) -> dict:
    """The talker's prefill and each step (talker + code predictor fused), and the frames it decoded."""
    from omnijax.models.qwen3_omni import speech as qwen3_speech
    from omnijax.models.qwen3_omni.talker_decode import TalkerDecode

    _, partial = qwen3_speech._talker(model, prompt, answer, "Ethan", frames + 1, ())
    config, params, rows, positions, trailing, pad = partial.args
    mark = _clock()
    run = TalkerDecode(config, params, rows, positions, max_new_tokens=frames + 1,
                       suppress=partial.keywords["suppress"])  # the prefill (its first token read back)
    prefill = _since(mark)
    steps, codes = [], []
    while not run.done:
        mark = _clock()
        codes.append(run.advance(trailing[run.step] if run.step < trailing.shape[0] else pad))
        steps.append(_since(mark))
    return dict(prefill=prefill, steps=steps, codes=np.stack(codes, axis=1), config=config, params=params,
                token=run.tokens[0])


def predictor_times(config, params, token: int, frames: int, seed: int) -> list[tuple[float, float]]:
    """`predict_codes` alone, `frames` calls on seeded talker hidden states (its work does not depend on them)."""
    import jax
    import jax.numpy as jnp

    from omnijax.models.qwen3_omni.talker_forward import predict_codes

    rng = np.random.default_rng(seed)
    code0 = jnp.asarray([token], jnp.int32)
    out = []
    for _ in range(frames):
        hidden = jnp.asarray(rng.standard_normal((1, config.decoder.hidden_size)), config.jnp_dtype)
        mark = _clock()
        jax.block_until_ready(predict_codes(config, params, hidden, code0))
        out.append(_since(mark))
    return out


def vocoder_times(model, codes: np.ndarray, first: int, chunk: int) -> list[tuple[float, float, int]]:
    """Each `Code2WavStream.push` of the schedule (first call `first` frames, then `chunk`): wall, CPU, samples."""
    import jax

    from omnijax.models.qwen3_omni.code2wav_decode import Code2WavStream

    stream, out, start = Code2WavStream(model.speech.code2wav), [], 0
    while start < codes.shape[1]:
        end = min(start + (first if start == 0 else chunk), codes.shape[1])
        mark = _clock()
        wav = jax.block_until_ready(stream.push(codes[None, :, start:end]))
        out.append((*_since(mark), int(wav.shape[-1])))
        start = end
    return out


def measure(args) -> tuple[list[dict], list[dict], dict]:
    """Stage rows and sweep rows (medians over rounds) and the raw per-round figures."""
    import omnijax

    sweep_pairs = [(f, c) for f in args.first_chunks for c in args.chunks]
    with tempfile.TemporaryDirectory(prefix="speech_stages_") as tmp:
        root = release.build_release(Path(tmp))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            model = omnijax.load(root / "omnijax")
        prompt, answer = spoken_ids(model, args.answer_tokens)
        raw = {"thinker": [], "talker": [], "predictor": [], "vocoder": {p: [] for p in sweep_pairs}}
        for r in range(args.rounds + 1):  # round 0 compiles (every shape each stage needs), unmeasured
            th = thinker_times(model, args.answer_tokens)
            tk = talker_times(model, prompt, answer, args.frames)
            pr = predictor_times(tk["config"], tk["params"], tk["token"], args.frames, seed=r)
            voc = {p: vocoder_times(model, tk["codes"], *p) for p in sweep_pairs}
            if r:
                raw["thinker"].append(th)
                raw["talker"].append(tk)
                raw["predictor"].append(pr)
                for p in sweep_pairs:
                    raw["vocoder"][p].append(voc[p])
            print(f"  round {r}/{args.rounds}{' (compile)' if r == 0 else ''}: thinker {th[0] * 1e3:.0f} ms, "
                  f"talker {sum(s[0] for s in tk['steps']) * 1e3:.0f} ms for {tk['codes'].shape[1]} frames", flush=True)
    return summarise(raw, len(answer), args.load)


def _med(values) -> float:
    return float(np.median(values))


def summarise(raw: dict, answer_len: int, load: list[float]) -> tuple[list[dict], list[dict], dict]:
    frames = raw["talker"][0]["codes"].shape[1]
    audio_s = frames * budget_lib.FRAME_S
    stages = []
    for i, unit in enumerate(("wall", "cpu")):
        per_token = _med([t[i] / answer_len for t in raw["thinker"]])
        step = [sum(s[i] for s in t["steps"]) for t in raw["talker"]]
        predictor = [sum(p[i] for p in ps) for ps in raw["predictor"]]
        talker = _med(step) - _med(predictor)
        vocoder = {p: _med([sum(c[i] for c in calls) for calls in runs]) for p, runs in raw["vocoder"].items()}
        for stage, per_audio_s in (("thinker", per_token * budget_lib.FRAMES_PER_S), ("talker", talker / audio_s),
                                   ("code predictor", _med(predictor) / audio_s),
                                   ("vocoder", vocoder.get(VOCODER_ROW, _med(list(vocoder.values()))) / audio_s)):
            stages.append(dict(stage=stage, clock=unit, seconds_per_audio_s=per_audio_s, rtf=per_audio_s,
                               ms_per_frame=per_audio_s * budget_lib.FRAME_S * 1e3))
        stages.append(dict(stage="all four", clock=unit, seconds_per_audio_s=sum(s["rtf"] for s in stages[-4:]),
                           rtf=sum(s["rtf"] for s in stages[-4:]),
                           ms_per_frame=sum(s["ms_per_frame"] for s in stages[-4:])))
    thinker_ms = _med([t[0] for t in raw["thinker"]]) * 1e3
    prefill_ms = _med([t["prefill"][0] for t in raw["talker"]]) * 1e3
    step_ms = _med([s[0] for t in raw["talker"] for s in t["steps"]]) * 1e3
    base = sum(s["rtf"] for s in stages[:3])  # wall: thinker + talker + code predictor
    sweep = []
    for (first, chunk), runs in raw["vocoder"].items():
        first_call = _med([calls[0][0] for calls in runs]) * 1e3
        total = _med([sum(c[0] for c in calls) for calls in runs])
        sweep.append(dict(first_chunk=first, chunk=chunk, vocoder_first_ms=first_call,
                          first_packet_ms=thinker_ms + prefill_ms + first * step_ms + first_call,
                          vocoder_rtf=total / audio_s, rtf=base + total / audio_s,
                          calls=len(runs[0]), samples=sum(c[2] for c in runs[0])))
    detail = dict(frames=frames, audio_s=audio_s, answer_tokens=answer_len, thinker_answer_ms=thinker_ms,
                  talker_prefill_ms=prefill_ms, talker_step_ms=step_ms, load_avg=load)
    return stages, sweep, detail


def _ints(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(","))
    if not values or min(values) < 1:
        raise ValueError(f"chunk sizes are integers >= 1, got {text!r}")
    return values


def main(argv=None) -> int:
    p = harness.parser(__doc__)
    p.add_argument("--rounds", type=int, default=3, help="measured runs of every stage (after one compiling run)")
    p.add_argument("--frames", type=int, default=100, help="codec frames of speech (80 ms each)")
    p.add_argument("--answer-tokens", type=int, default=32, help="the thinker's answer, tokens at most")
    p.add_argument("--first-chunks", type=_ints, default=FIRST_CHUNKS, help="Code2Wav first call sizes, frames")
    p.add_argument("--chunks", type=_ints, default=CHUNKS, help="Code2Wav later call sizes, frames")
    p.add_argument("--accelerator", choices=sorted(budget_lib.ACCELERATORS), default="H100",
                   help="the analytic budget's accelerator (peak and bandwidth; efficiencies 40%% / 60%%)")
    p.add_argument("--prompt-tokens", type=int, default=100, help="the analytic budget's cold-start prompt")
    p.add_argument("--qwen25-frames", type=int, default=250,
                   help="Qwen2.5-Omni codec tokens of speech (20 ms each; 0 skips its stages)")
    args = harness.parse(p, argv, smoke={"rounds": 1, "frames": 10, "answer_tokens": 4, "first_chunks": (4,),
                                         "chunks": (10,), "qwen25_frames": 30})
    if args.qwen25_frames < 0:
        p.error(f"--qwen25-frames must be at least 0, got {args.qwen25_frames}")
    for name in ("rounds", "frames", "answer_tokens", "prompt_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    out = harness.output_dir(args)
    args.load = np_load()
    stages, sweep, detail = measure(args)
    detail["load_avg"] = [*detail["load_avg"], *np_load()]
    full = budget_lib.budget(budget_lib.ACCELERATORS[args.accelerator], prompt_tokens=args.prompt_tokens,
                             first_chunks=args.first_chunks, chunk=VOCODER_ROW[1])
    print(f"\nCPU, tiny release: {detail['frames']} frames ({detail['audio_s']:.2f} s of audio), answer of "
          f"{detail['answer_tokens']} tokens, load {detail['load_avg']}")
    harness.print_table(stages, [("stage", "stage", ""), ("clock", "clock", ""),
                                 ("ms / 80 ms frame", "ms_per_frame", ".2f"), ("RTF", "rtf", ".3f")])
    print("\nCode2Wav chunk sweep (CPU, tiny): first packet = thinker + talker prefill + first x talker step + "
          "first Code2Wav call")
    harness.print_table(sweep, [("first", "first_chunk", "d"), ("then", "chunk", "d"),
                                ("first packet ms", "first_packet_ms", ".0f"),
                                ("Code2Wav first call ms", "vocoder_first_ms", ".1f"),
                                ("Code2Wav RTF", "vocoder_rtf", ".3f"), ("RTF all stages", "rtf", ".3f")])
    print(f"\nQwen3-Omni-30B-A3B, analytic, {full['accelerator']['name']} (prompt {full['prompt_tokens']} tokens, "
          f"prefill {full['prefill_ms']:.1f} ms):")
    harness.print_table(full["stages"], [("stage", "stage", ""), ("GFLOP / audio s", _gflop, ""),
                                         ("GB / audio s", _gbyte, ""), ("ms / frame", "ms_per_frame", ".2f"),
                                         ("RTF", "rtf", ".4f"), ("report ms / frame", "report_ms_per_frame", ".1f"),
                                         ("report RTF", "report_rtf", ".3f"), ("source", "source", "")])
    harness.print_table(full["sweep"], [("stages at", "thinker", ""), ("first", "first_chunk", "d"),
                                        ("first packet ms", "first_packet_ms", ".0f"),
                                        ("RTF", "rtf", ".2f")])
    print(f"report: first packet {budget_lib.REPORT['first_packet_ms']:.0f} ms, RTF {budget_lib.REPORT['rtf']}")
    table = {"cpu_stages": stages, "cpu_sweep": sweep, "cpu": detail, "full_size": full, "rounds": args.rounds,
             "smoke": bool(args.smoke)}
    if args.qwen25_frames:
        table["qwen2_5_omni"] = qwen2_5_stages(args)
    harness.write_json(out, "speech_stages", table)
    plot(sweep, full, out)
    return 0


def qwen2_5_stages(args) -> dict:
    """Qwen2.5-Omni's stage rows and details (`_speech_stages_qwen25.measure`), printed."""
    load = np_load()
    with tempfile.TemporaryDirectory(prefix="speech_stages25_") as tmp:
        rows, detail = qwen25.measure(Path(tmp), args.rounds, args.qwen25_frames, args.answer_tokens)
    detail["load_avg"] = [*load, *np_load()]
    print(f"\nQwen2.5-Omni, CPU, tiny release at the release's codec rates: {detail['frames']} codec tokens "
          f"({detail['audio_s']:.2f} s of audio), answer of {detail['answer_tokens']} tokens, Token2Wav chunks "
          f"{detail['first_chunk']} then {detail['chunk']} tokens, load {detail['load_avg']}")
    harness.print_table(rows, [("stage", "stage", ""), ("clock", "clock", ""), ("s", "seconds", ".3f"),
                               ("ms / 20 ms token", "ms_per_token", ".2f"), ("RTF", "rtf", ".3f")])
    print(f"first packet (serial: answer + talker + DiT + BigVGAN calls before the first PCM) "
          f"{detail['first_packet_ms']:.0f} ms; talker prefill {detail['talker_prefill_ms']:.1f} ms; "
          f"{detail['dit_calls']} DiT solves, {detail['bigvgan_calls']} BigVGAN calls")
    return {"cpu_stages": rows, "cpu": detail}


def np_load() -> list[float]:
    import os

    return [round(float(v), 2) for v in os.getloadavg()]


def _gflop(row) -> str:
    return "n/a" if row["flops_per_audio_s"] is None else f"{row['flops_per_audio_s'] / 1e9:.0f}"


def _gbyte(row) -> str:
    return "n/a" if row["bytes_per_audio_s"] is None else f"{row['bytes_per_audio_s'] / 1e9:.1f}"


def plot(sweep: list[dict], full: dict, out: Path) -> None:
    plt = harness.pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for i, chunk in enumerate(sorted({s["chunk"] for s in sweep})):
        rows = [s for s in sweep if s["chunk"] == chunk]
        a.plot([s["rtf"] for s in rows], [s["first_packet_ms"] for s in rows], "o-", color=f"C{i}",
               label=f"then {chunk} frames a call")
        for s in rows:
            a.annotate(f"{s['first_chunk']}", (s["rtf"], s["first_packet_ms"]), textcoords="offset points",
                       xytext=(4, 4), fontsize=8)
    a.set_xlim(0, 1.25 * max(s["rtf"] for s in sweep))
    a.set_ylim(0, 1.25 * max(s["first_packet_ms"] for s in sweep))
    a.set_xlabel("RTF, all four stages (compute s / audio s)")
    a.set_ylabel("first packet, ms (label: first call frames)")
    a.set_title("tiny Qwen3-Omni on CPU: Code2Wav chunk sweep")
    a.legend(fontsize=8)
    for i, thinker in enumerate(dict.fromkeys(s["thinker"] for s in full["sweep"])):
        rows = [s for s in full["sweep"] if s["thinker"] == thinker]
        b.plot([s["rtf"] for s in rows], [s["first_packet_ms"] for s in rows], "o-", color=f"C{i}",
               label=f"projection, every stage at its {thinker}" if thinker == "roofline"
               else f"projection, every stage at the {thinker}")
        for s in rows:
            b.annotate(f"{s['first_chunk']}", (s["rtf"], s["first_packet_ms"]), textcoords="offset points",
                       xytext=(4, 4), fontsize=8)
    b.plot([full["report"]["rtf"]], [full["report"]["first_packet_ms"]], "r*", ms=12, label="report: 234 ms, 0.47")
    b.set_xlim(0, 0.6)
    b.set_ylim(0, 300)
    b.set_xlabel("RTF")
    b.set_ylabel("first packet, ms")
    b.set_title(f"Qwen3-Omni-30B-A3B, {full['accelerator']['name'].split(' (')[0]}")
    b.legend(fontsize=8)
    fig.tight_layout()
    harness.save_png(fig, out, "speech_stages")


if __name__ == "__main__":
    raise SystemExit(main())
