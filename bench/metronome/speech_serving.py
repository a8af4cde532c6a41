"""Spoken sessions on the engine's ticks (issue 39 item 4): N utterances spoken at once by the engine's speech pool
(one batched talker + code-predictor step per tick, the due vocoder chunks batched per call, by playback deadline;
`--vocoder-rows 1`: one session per Code2Wav call) against the same N spoken
one after another, each alone (`speak_streamed`, what a server without the pool does per request), at concurrency
1 / 2 / 4: the first PCM after admission and the real-time factor.

The release is `bench.peers.speech_latency`'s tiny seeded Qwen3-Omni (float32; Code2Wav at the release's 1,920
samples a frame, 80 ms), saved by transformers and converted by `omnijax convert`. Each utterance speaks a random
16-token answer to a short templated question, its talker greedy for at most `--frames` frames (it may end
earlier: utterance lengths vary; both arms speak the same ones). Both arms run in one process, interleaved round by
round (the engine's arm and the serial arm alternate first); each round's utterances are spoken once by both arms
unmeasured first (compilation: every vocoder chunk size and row-bucket move they need).

    first_pcm_ms   from the moment the N utterances are handed over (engine: admitted between ticks; serial: the
                   first starts) to each utterance's first PCM chunk; serial utterances wait for the ones before
    rtf_session    (an utterance's last PCM - that moment) / its audio seconds, median over the N
    rtf_wall       wall time of all N / their audio seconds together (the throughput: below 1 keeps up)
    wall ratio     median over rounds of engine wall / serial wall for the same utterances in the same round
    late           chunks sent past their playback deadline (the audio sent so far, playing from the first PCM,
                   had run out; the engine reports each, `SpeechChunk.late_s`, and drops none)

CPU figures of tiny weights: they show what batching the talker across sessions buys at the tick, not what a GPU
does at full size (the GPU issue).

    python -m bench.metronome.speech_serving --rounds 3 --out bench/metronome/results
"""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from bench import harness
from bench.peers import speech_latency as release

ARMS = ("engine", "serial")
CONCURRENCY = (1, 2, 4)
FIRST_CHUNK, CHUNK = 4, 25
T = release.TTS


def prompt_ids(rng) -> np.ndarray:
    """A system turn, a user turn of 6 random words, the assistant's opening (ChatML ids of the tiny release)."""
    words = [int(w) for w in rng.integers(10, 250, size=6)]
    return np.asarray([T["im_start_token_id"], T["system_token_id"], 198, 11, 12, T["im_end_token_id"], 198,
                       T["im_start_token_id"], T["user_token_id"], 198, *words, T["im_end_token_id"], 198,
                       T["im_start_token_id"], T["assistant_token_id"], 198])


def utterances(n: int, seed: int, answer_tokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(prompt_ids(rng), rng.integers(10, 250, size=answer_tokens)) for _ in range(n)]


def engine_arm(engine, jobs, frames: int) -> dict:
    """The N utterances admitted together between ticks, then ticks until the pool is empty."""
    start = time.perf_counter()
    for i, (prompt, answer) in enumerate(jobs):
        engine.speak(f"u{i}", prompt, answer, voice="Ethan", max_new_tokens=frames + 1)
    first, last, samples, late, ticks = {}, {}, {}, 0, 0
    while engine.speech.busy:
        report = engine.tick()
        ticks += 1
        now = time.perf_counter() - start
        for c in report.speech:
            if c.pcm.size:
                first.setdefault(c.speech_id, now)
                last[c.speech_id] = now
            samples[c.speech_id] = samples.get(c.speech_id, 0) + c.pcm.size
            late += c.late_s > 0
    return dict(first=[first[k] for k in sorted(first)], last=[last[k] for k in sorted(last)],
                samples=[samples[k] for k in sorted(samples)], wall=time.perf_counter() - start, late=late,
                ticks=ticks)


def serial_arm(model, jobs, frames: int, chunk: int = CHUNK) -> dict:
    """The N utterances spoken one after another, each alone (`speak_streamed`)."""
    from omnijax.models.qwen3_omni import speech as speech_lib

    start = time.perf_counter()
    first, last, samples, late = [], [], [], 0
    for prompt, answer in jobs:
        n, seen = 0, None
        for pcm in speech_lib.speak_streamed(model, prompt, answer, speaker="Ethan", max_new_tokens=frames + 1,
                                             first_chunk=FIRST_CHUNK, chunk=chunk):
            now = time.perf_counter() - start
            # the pool's definition: past the moment the audio sent so far runs out (playing from the first PCM)
            late += seen is not None and now > seen + n / model.speech.sample_rate
            seen = now if seen is None else seen
            n += pcm.size
        first.append(seen)
        last.append(time.perf_counter() - start)
        samples.append(n)
    return dict(first=first, last=last, samples=samples, wall=time.perf_counter() - start, late=late, ticks=0)


def measure(root: Path, concurrency, rounds: int, frames: int, answer_tokens: int, chunk: int = CHUNK,
            vocoder_rows: int | None = None) -> tuple[list[dict], dict]:
    import omnijax
    from omnijax.serve.engine.engine import Engine, EngineConfig
    from omnijax.serve.engine.speech import SpeechConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = omnijax.load(root / "omnijax")
    top = max(concurrency)
    rows = tuple(b for b in (1, 2, 4, 8, 16) if b < top) + (top,)
    speech = SpeechConfig(rows=rows, num_pages=16 * top, page_size=16, first_chunk=FIRST_CHUNK, chunk=chunk,
                          vocoder_rows=vocoder_rows)
    engine = Engine(model, EngineConfig(stream=omnijax.StreamConfig(num_pages=8, page_size=16), chunk_tokens=8,
                                        buckets=(1,), speech=speech))
    out, check, start = [], {}, time.perf_counter()
    for n in (*concurrency, *concurrency):  # warm-up, twice: every shape and every move between row buckets
        engine_arm(engine, utterances(n, 0, answer_tokens), frames)
        serial_arm(model, utterances(n, 0, answer_tokens), frames, chunk)
    print(f"  warm-up done at {time.perf_counter() - start:.0f} s", flush=True)
    for r in range(rounds):
        for n in concurrency:
            jobs = utterances(n, 1 + r, answer_tokens)
            # unmeasured first: a talker that ends early leaves a vocoder chunk of a new size (one compile each),
            # and rows that end early move the engine between row buckets mid-run
            engine_arm(engine, jobs, frames)
            serial_arm(model, jobs, frames, chunk)
            for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                got = engine_arm(engine, jobs, frames) if arm == "engine" else serial_arm(model, jobs, frames, chunk)
                out.append(dict(got, arm=arm, concurrency=n, round=r))
                check.setdefault((n, r), {})[arm] = got["samples"]
            print(f"  round {r + 1}/{rounds} concurrency {n}: engine "
                  f"{out[-2 if out[-1]['arm'] == 'serial' else -1]['wall']:.2f} s, serial "
                  f"{out[-1 if out[-1]['arm'] == 'serial' else -2]['wall']:.2f} s", flush=True)
    same = all(v["engine"] == v["serial"] for v in check.values())
    return out, dict(same_samples=same, speech_stats=dict(engine.speech.stats))


def summarise(rows: list[dict], sample_rate: int = 24_000) -> list[dict]:
    out = []
    for n in sorted({r["concurrency"] for r in rows}):
        base = None
        for arm in ARMS:
            group = [r for r in rows if (r["arm"], r["concurrency"]) == (arm, n)]
            audio = [s / sample_rate for r in group for s in r["samples"]]
            first = [1e3 * f for r in group for f in r["first"]]
            session = [la / (s / sample_rate) for r in group for la, s in zip(r["last"], r["samples"])]
            wall = [r["wall"] / (sum(r["samples"]) / sample_rate) for r in group]
            row = dict(arm=arm, concurrency=n, first_pcm_ms=float(np.median(first)),
                       first_pcm_p90_ms=float(np.percentile(first, 90)), rtf_session=float(np.median(session)),
                       rtf_wall=float(np.median(wall)), audio_s=float(np.median(audio)),
                       late=int(sum(r["late"] for r in group)), runs=len(group))
            base = row if arm == "serial" else base
            out.append(row)
        engine_row = next(r for r in out if (r["arm"], r["concurrency"]) == ("engine", n))
        engine_row["first_vs_serial"] = engine_row["first_pcm_ms"] / base["first_pcm_ms"]
        engine_row["wall_vs_serial"] = engine_row["rtf_wall"] / base["rtf_wall"]
        # the same utterances in the same round, robust to the machine's speed drifting between rounds
        walls = {arm: [r["wall"] for r in sorted((r for r in rows if (r["arm"], r["concurrency"]) == (arm, n)),
                                                 key=lambda r: r["round"])] for arm in ARMS}
        engine_row["wall_ratio_same_round"] = harness.same_round_ratio(walls["engine"], walls["serial"])
    return out


def plot(summary: list[dict], out: Path) -> None:
    plt = harness.pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for i, (arm, style) in enumerate(zip(ARMS, ("o-", "s--"))):
        rows = [s for s in summary if s["arm"] == arm]
        x = [s["concurrency"] for s in rows]
        label = "engine: batched talker ticks" if arm == "engine" else "serial: each alone"
        a.plot(x, [s["first_pcm_ms"] for s in rows], style, color=f"C{i}", label=label)
        b.plot(x, [s["rtf_wall"] for s in rows], style, color=f"C{i}", label=label + " (all N)")
        b.plot(x, [s["rtf_session"] for s in rows], style, color=f"C{i}", alpha=0.35, label=label + " (per session)")
    for axis in (a, b):
        axis.set_xticks(sorted({s["concurrency"] for s in summary}))
    a.set_xlabel("utterances at once")
    a.set_ylabel("first PCM, ms after hand-over (median)")
    a.set_title("first audio packet (tiny Qwen3-Omni, CPU)")
    a.legend()
    b.axhline(1.0, color="gray", lw=0.8)
    b.set_xlabel("utterances at once")
    b.set_ylabel("real-time factor (lower is faster)")
    b.legend(fontsize=7)
    harness.save_png(fig, out, "speech_serving")


def main(argv=None) -> int:
    p = harness.parser(__doc__)
    p.add_argument("--rounds", type=int, default=3, help="measured rounds (both arms, every concurrency)")
    p.add_argument("--concurrency", type=lambda s: tuple(int(v) for v in s.split(",")), default=CONCURRENCY,
                   help="utterances at once, comma-separated")
    p.add_argument("--frames", type=int, default=50, help="codec frames per utterance (80 ms each)")
    p.add_argument("--answer-tokens", type=int, default=16, help="thinker answer tokens spoken per utterance")
    p.add_argument("--chunk", type=int, default=CHUNK, help="codec frames of each vocoder call after the first 4")
    p.add_argument("--vocoder-rows", type=int, default=None,
                   help="sessions at most in one Code2Wav call of the engine (default: all; 1: one at a time)")
    args = harness.parse(p, argv, smoke={"rounds": 1, "concurrency": (1, 2), "frames": 4, "answer_tokens": 4})
    if min(args.rounds, args.frames, args.answer_tokens, args.chunk, *args.concurrency,
           args.vocoder_rows or 1) < 1:
        p.error("--rounds, --frames, --answer-tokens, --chunk, --vocoder-rows and every --concurrency must be at "
                "least 1")
    out = harness.output_dir(args)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="speech_serving_") as tmp:
        root = release.build_release(Path(tmp))
        print(f"  release built and converted in {time.perf_counter() - start:.0f} s", flush=True)
        rows, checks = measure(root, args.concurrency, args.rounds, args.frames, args.answer_tokens, args.chunk,
                               args.vocoder_rows)
    summary = summarise(rows)
    harness.print_table(summary, [("arm", "arm", ""), ("N", "concurrency", "d"),
                                  ("first PCM ms", "first_pcm_ms", ".0f"), ("p90", "first_pcm_p90_ms", ".0f"),
                                  ("RTF session", "rtf_session", ".2f"), ("RTF all N", "rtf_wall", ".2f"),
                                  ("late", "late", "d"),
                                  ("first vs serial", lambda r: r.get("first_vs_serial"), ".2f"),
                                  ("RTF vs serial", lambda r: r.get("wall_vs_serial"), ".2f"),
                                  ("wall / serial, same round", lambda r: r.get("wall_ratio_same_round"), ".2f")])
    print(f"same samples per utterance in both arms: {checks['same_samples']}; {time.perf_counter() - start:.0f} s")
    harness.write_json(out, "speech_serving", {
        "rounds": args.rounds, "frames": args.frames, "answer_tokens": args.answer_tokens,
        "first_chunk": FIRST_CHUNK, "chunk": args.chunk, "vocoder_rows": args.vocoder_rows, "summary": summary,
        "rows": rows, **checks,
        "smoke": bool(args.smoke)})
    plot(summary, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
