"""Pages and time to first token of `n` choices of one prompt: sharing the prompt's pages against copying them.

One engine per mode (bucket up to 8, NoSlide, page size `--page-size`, impl "xla") on a 4-layer decoder (hidden
256, 8 query / 2 KV heads of 32, vocab 4096, random init, float32). Each measurement: session c0 is fed a prompt
of `--prompt` tokens (not timed); then the timed part: the n - 1 other choices' sessions are made to continue from
it, and one tick decodes the first answer token of every choice. Modes: "share" forks them
(`Engine.fork_session`: the prompt's full pages shared, the partly filled last page copied), "copy" is the path
before sharing (`export_session` to the host, `import_session` into each choice: every page copied). Reported per
n: pages in use after the fork (the pool's free count), the fork's own time and the time to first token (fork +
first tick), medians over `--rounds` rounds after a warm-up round, both modes interleaved in each round. CPU
timings on a shared machine are noisy: compare the modes within a run.

Run: `python -m bench.metronome.n_sharing [--prompt 2048] [--page-size 64] [--ns 1 2 4 8] [--rounds 5]
[--out bench/out] [--smoke]`
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

import omnijax
from bench import harness
from omnijax.chunks.chunk import text_chunk
from omnijax.decoding import Greedy
from omnijax.models.config import DecoderConfig
from omnijax.models.decoder import Decoder
from omnijax.retention.base import NoSlide
from omnijax.serve.engine.engine import Engine, EngineConfig

MODES = ("share", "copy")
CHUNK = 256


def _measure(engine: Engine, prompt: np.ndarray, n: int, mode: str, chunk: int) -> dict:
    """One timed fork + first token; every session is closed again, so the pool is empty on return."""
    engine.open("c0")
    for u, at in enumerate(range(0, len(prompt), chunk)):
        engine.submit("c0", text_chunk(prompt[at:at + chunk], unit=u), 0)
        engine.tick()
    names = [f"c{i}" for i in range(n)]
    t0 = time.perf_counter()
    if mode == "share":
        for s in names[1:]:
            engine.open(s)
        if n > 1:
            engine.fork_session("c0", names[1:])
    else:
        snapshot = engine.export_session("c0") if n > 1 else None
        for s in names[1:]:
            engine.import_session(s, snapshot)
    harness.block(engine.state.kv.page_table)
    fork_ms = (time.perf_counter() - t0) * 1e3
    used = engine.config.num_pages - engine.free_pages
    answer = dataclasses.replace(text_chunk(np.zeros((1,), np.int64), unit=99), valid=np.zeros((1, 1), bool),
                                 advance=np.zeros((1,), np.int32))  # no token: continue from the prompt's logits
    for s in names:
        engine.submit(s, answer, 1)
    report = engine.tick()
    first_ms = (time.perf_counter() - t0) * 1e3
    assert all(len(report.outputs[s].tokens) == 1 for s in names)
    for s in names:
        engine.close(s)
    assert engine.free_pages == engine.config.num_pages
    return {"pages_used": used, "fork_ms": fork_ms, "first_token_ms": first_ms}


def main(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4, 8], help="choices per request (at most 8)")
    parser.add_argument("--rounds", type=int, default=5)
    args = harness.parse(parser, argv, smoke=dict(prompt=40, page_size=16, ns=[1, 2], rounds=1))
    if max(args.ns) > 8 or min(args.ns) < 1:
        parser.error(f"--ns must lie in 1..8, got {args.ns}")
    out = harness.output_dir(args)
    config = DecoderConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
                           num_kv_heads=2, head_dim=32, rope_theta=1e6, mrope_section=None)
    model = Decoder(config)
    P = args.page_size
    prompt_pages = -(-args.prompt // P)
    pool = max(args.ns) * (prompt_pages + 1) + 2
    chunk = min(CHUNK, args.prompt)
    stream = omnijax.StreamConfig(policy=NoSlide(), num_pages=pool, page_size=P, max_answer_tokens=1, impl="xla",
                                  decoding=Greedy())
    engines = {mode: Engine(model, EngineConfig(stream=stream, chunk_tokens=chunk, buckets=(1, 2, 4, 8),
                                                return_logits=False)) for mode in MODES}
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, args.prompt)
    got: dict = {(n, mode): [] for n in args.ns for mode in MODES}
    for r in range(args.rounds + 1):  # round 0 warms up (compiles every bucket's programs)
        for n in args.ns:
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                row = _measure(engines[mode], prompt, n, mode, chunk)
                if r:
                    got[(n, mode)].append(row)
    rows = []
    for n in args.ns:
        for mode in MODES:
            runs = got[(n, mode)]
            rows.append({"n": n, "mode": mode, "pages_used": runs[0]["pages_used"],
                         "fork_ms": float(np.median([x["fork_ms"] for x in runs])),
                         "first_token_ms": float(np.median([x["first_token_ms"] for x in runs]))})
    harness.print_table(rows, [("n", "n", "d"), ("mode", "mode", ""), ("pages in use", "pages_used", "d"),
                               ("fork ms", "fork_ms", ".1f"), ("first token ms", "first_token_ms", ".1f")])
    harness.write_json(out, "n_sharing", {"prompt": args.prompt, "page_size": P, "prompt_pages": prompt_pages,
                                          "rounds": args.rounds, "rows": rows}, indent=2)
    fig, axes = harness.pyplot().subplots(1, 2, figsize=(9, 3.5))
    for mode, color in zip(MODES, ("tab:blue", "gray")):
        mine = [r for r in rows if r["mode"] == mode]
        axes[0].plot([r["n"] for r in mine], [r["pages_used"] for r in mine], "o-", color=color, label=mode)
        axes[1].plot([r["n"] for r in mine], [r["first_token_ms"] for r in mine], "o-", color=color, label=mode)
    axes[0].set_ylabel("pages in use after the fork")
    axes[1].set_ylabel("fork + first token, ms (median)")
    for ax in axes:
        ax.set_xlabel("n (choices)")
        ax.legend()
    fig.suptitle(f"n choices of a {args.prompt}-token prompt, {P}-slot pages (CPU)")
    harness.save_png(fig, out, "n_sharing")


if __name__ == "__main__":
    main()
