"""Spoken chat completions through the server route (issue 39): the first audio delta of a streamed
`modalities: ["text", "audio"]` chat completion, with Qwen3-Omni's talker starting on the engine's speech pool while
the thinker still writes (`written`, the route's behaviour since `speech_engine.WrittenSpeech`) against the same
request with the pool given the finished answer (`finished`, the route's behaviour before: the bench replaces
`chat_completions.written_speech` by a function returning None, so the route speaks `_content_tokens(answer)` once
the text is done, as it did). `--talker-steps K` adds the arm `written xK`: the same as written with the engine's
pool replaced (while the server is idle) by one of the same settings but `SpeechConfig.steps_per_tick` K, so the
talker may take up to K steps a tick and keep up with an answer decoded tau tokens a tick.

The release is `bench.peers.speech_latency`'s tiny seeded Qwen3-Omni (float32; Code2Wav at the release's 1,920
samples a frame, 80 ms), served in this process by `omnijax.serve.app.build_context` (its speech pool, first vocoder
chunk 4 frames then 25; the engine's answer tau tokens a tick, `--tau`) and asked through the official `openai` SDK
(`stream=True`, voice Ethan, greedy talker, `--answer-tokens` at most, `--frames` of speech: the random talker never
ends early). The arms alternate first round by round; each arm answers once unmeasured first (compilation). Both
arms must send the same PCM16 (checked, `same_pcm`: within 1 LSB of the first run's, the written arm's text rows
projected in pieces). From the moment the request is sent:

    first_text_ms   the first transcript delta
    last_text_ms    the last transcript delta (the text is done)
    first_audio_ms  the first audio delta (what a listener waits for)
    last_audio_ms   the last audio delta
    text_deltas     transcript deltas (one per engine tick that decoded text: about answer tokens / tau)
    audio_s         seconds of speech

CPU figures of tiny weights, on a shared machine: compare the arms within a run (`first_ratio_same_round`, median
over rounds of written / finished in the same round), not the absolute times.

    python -m bench.metronome.speech_route --rounds 5 --out bench/metronome/results
"""

from __future__ import annotations

import asyncio
import base64
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from bench import harness
from bench.peers import speech_latency as release

ARMS = ("written", "finished")
QUESTION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello to everyone."}]


async def _ask(base_url: str, answer_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    start = time.perf_counter()
    marks: dict = {}
    pcm = []
    stream = await client.chat.completions.create(model="omnijax", messages=QUESTION, max_tokens=answer_tokens,
                                                  modalities=["text", "audio"],
                                                  audio={"voice": "Ethan", "format": "pcm16"}, stream=True)
    async for chunk in stream:
        audio = chunk.choices[0].delta.audio if chunk.choices else None
        now = (time.perf_counter() - start) * 1e3
        if audio is not None and audio.transcript:
            marks.setdefault("first_text_ms", now)
            marks["last_text_ms"] = now
            marks["text_deltas"] = marks.get("text_deltas", 0) + 1
        if audio is not None and audio.data:
            marks.setdefault("first_audio_ms", now)
            marks["last_audio_ms"] = now
            pcm.append(np.frombuffer(base64.b64decode(audio.data), "<i2"))
    wave = np.concatenate(pcm)
    return dict(marks, audio_s=wave.size / 24_000, pcm=wave)


def arms(talker_steps: int) -> tuple[str, ...]:
    return ARMS + ((f"written x{talker_steps}",) if talker_steps > 1 else ())


def measure(root: Path, rounds: int, answer_tokens: int, frames: int, tau: int, talker_steps: int = 1
            ) -> tuple[list[dict], dict]:
    import dataclasses

    import omnijax
    from omnijax.serve import chat_completions
    from omnijax.serve.app import BackgroundServer, build_context
    from omnijax.serve.context import ServeOptions
    from omnijax.serve.engine.speech import SpeechPool

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = omnijax.load(root / "omnijax")
    options = ServeOptions(port=0, max_output_tokens=answer_tokens, max_speech_tokens=frames + 1)
    context = build_context(model, options=options, chunk_tokens=64, buckets=(1,), aimd_target=0,
                            stream=omnijax.StreamConfig(num_pages=64, page_size=16, max_answer_tokens=tau))
    written = chat_completions.written_speech
    engine = context.worker.engine
    pools = {arm: engine.speech for arm in ARMS}
    if talker_steps > 1:  # the same pool settings but `steps_per_tick`: swapped in while the server is idle
        pools[f"written x{talker_steps}"] = SpeechPool(model, dataclasses.replace(engine.speech.config,
                                                                                  steps_per_tick=talker_steps))
    rows, pcm = [], {}
    with BackgroundServer(context) as server:
        def run(arm: str) -> dict:
            chat_completions.written_speech = written if arm != "finished" else (lambda *a, **k: None)
            engine.speech = pools[arm]
            try:
                return asyncio.run(asyncio.wait_for(_ask(server.base_url, answer_tokens), 600))
            finally:
                chat_completions.written_speech = written

        for arm in arms(talker_steps):  # unmeasured: compilation
            run(arm)
        for r in range(rounds):
            for arm in (arms(talker_steps) if r % 2 == 0 else arms(talker_steps)[::-1]):
                got = run(arm)
                wave = got.pop("pcm").astype(np.int32)
                first = pcm.setdefault("first", wave)
                # the written arm projects the text rows in pieces: equal up to float rounding, so 1 LSB at most
                got["max_lsb_diff"] = int(np.abs(wave - first).max()) if wave.shape == first.shape else -1
                rows.append(dict(got, arm=arm, round=r))
                print(f"  round {r + 1}/{rounds} {arm}: first audio {got['first_audio_ms']:.0f} ms, last text "
                      f"{got['last_text_ms']:.0f} ms", flush=True)
        stats = {arm: dict(pool.stats) for arm, pool in pools.items()}
    same = all(0 <= r["max_lsb_diff"] <= 1 for r in rows)
    return rows, dict(same_pcm=bool(same), speech_stats=stats)


def summarise(rows: list[dict], talker_steps: int = 1) -> list[dict]:
    out = []
    for arm in arms(talker_steps):
        group = [r for r in rows if r["arm"] == arm]
        out.append({k: float(np.median([r[k] for r in group])) for k in
                    ("first_text_ms", "last_text_ms", "first_audio_ms", "last_audio_ms", "audio_s", "text_deltas")}
                   | dict(arm=arm, runs=len(group)))
    by_round = {arm: [r["first_audio_ms"] for r in sorted((r for r in rows if r["arm"] == arm),
                                                           key=lambda r: r["round"])] for arm in arms(talker_steps)}
    for row in out:
        if row["arm"] != "finished":
            row["first_ratio_same_round"] = harness.same_round_ratio(by_round[row["arm"]], by_round["finished"])
    return out


def plot(summary: list[dict], out: Path) -> None:
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(7, 3))
    for i, s in enumerate(summary):
        ax.barh(i, s["last_text_ms"] - s["first_text_ms"], left=s["first_text_ms"], color="C0", alpha=0.5,
                label="text" if i == 0 else None)
        ax.barh(i, s["last_audio_ms"] - s["first_audio_ms"], left=s["first_audio_ms"], height=0.4, color="C1",
                label="audio" if i == 0 else None)
    ax.set_yticks(range(len(summary)), [s["arm"] for s in summary])
    ax.set_xlabel("ms after the request (median)")
    ax.set_title("streamed spoken chat completion (tiny Qwen3-Omni, CPU)")
    ax.legend()
    harness.save_png(fig, out, "speech_route")


def main(argv=None) -> int:
    p = harness.parser(__doc__)
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (both arms)")
    p.add_argument("--answer-tokens", type=int, default=48, help="the thinker's answer, tokens at most")
    p.add_argument("--frames", type=int, default=50, help="codec frames of speech (80 ms each)")
    p.add_argument("--tau", type=int, default=4, help="answer tokens the engine decodes a tick")
    p.add_argument("--talker-steps", type=int, default=1,
                   help="above 1: a third arm, written with the pool's SpeechConfig.steps_per_tick at this value")
    args = harness.parse(p, argv, smoke={"rounds": 1, "answer_tokens": 8, "frames": 6})
    if min(args.rounds, args.answer_tokens, args.frames, args.tau, args.talker_steps) < 1:
        p.error("--rounds, --answer-tokens, --frames, --tau and --talker-steps must be at least 1")
    out = harness.output_dir(args)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="speech_route_") as tmp:
        root = release.build_release(Path(tmp))
        rows, checks = measure(root, args.rounds, args.answer_tokens, args.frames, args.tau, args.talker_steps)
    summary = summarise(rows, args.talker_steps)
    harness.print_table(summary, [("arm", "arm", ""), ("first text ms", "first_text_ms", ".0f"),
                                  ("last text ms", "last_text_ms", ".0f"), ("first audio ms", "first_audio_ms", ".0f"),
                                  ("last audio ms", "last_audio_ms", ".0f"), ("audio s", "audio_s", ".2f"),
                                  ("first audio / finished, same round",
                                   lambda r: r.get("first_ratio_same_round"), ".2f")])
    print(f"same PCM in both arms (1 LSB): {checks['same_pcm']}; {time.perf_counter() - start:.0f} s")
    harness.write_json(out, "speech_route", {
        "rounds": args.rounds, "answer_tokens": args.answer_tokens, "frames": args.frames, "tau": args.tau,
        "talker_steps": args.talker_steps,
        "summary": summary, "rows": rows, **checks, "smoke": bool(args.smoke)})
    plot(summary, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
