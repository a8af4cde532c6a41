"""Per-token cost of answering with sampling against greedy decoding, inside the same jitted stream step.

A session (a 4-layer decoder, hidden 256, 8 query / 2 KV heads of 32, vocab `--vocab`, random init, float32) is fed
a prompt chunk, then the timed chunk: `--prompt` tokens asking for `--tokens` answer tokens. The same step runs with
`Greedy()`, `Sampling()` (temperature only) and `Sampling` with every warp on (repetition penalty, temperature,
top-k, top-p, min-p), each from a copy of the same state, side by side in interleaved rounds. The answer loop stops
at no eos (the config has none), so every case decodes exactly `--tokens` tokens; ms per token is the chunk's time
minus the same chunk asking for no answer, divided by the tokens.

Run: `python -m bench.metronome.decoding [--tokens 32] [--vocab 32768] [--rounds 7] [--out bench/out] [--smoke]`
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import omnijax
from bench import harness
from omnijax.chunks.chunk import text_chunk
from omnijax.decoding import Greedy, Sampling
from omnijax.models.config import DecoderConfig
from omnijax.models.decoder import Decoder

STRATEGIES = {"greedy": Greedy(), "sampling": Sampling(temperature=0.8, seed=1),
              "sampling, all warps": Sampling(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02,
                                              repetition_penalty=1.1, seed=1)}


def main(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument("--tokens", type=int, default=32, help="answer tokens of the timed chunk")
    parser.add_argument("--prompt", type=int, default=64, help="tokens of the prompt and of the timed chunk")
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary size (the warps' cost follows it)")
    parser.add_argument("--rounds", type=int, default=7)
    args = harness.parse(parser, argv, smoke=dict(tokens=4, prompt=8, vocab=512, rounds=1))
    out = harness.output_dir(args)
    config = DecoderConfig(vocab_size=args.vocab, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
                           num_kv_heads=2, head_dim=32, rope_theta=1e6, mrope_section=None)
    model = Decoder(config)
    rng = np.random.default_rng(0)
    prompt = text_chunk(rng.integers(0, args.vocab, args.prompt), unit=0)
    timed_ids = rng.integers(0, args.vocab, args.prompt)
    pages = -(-(2 * args.prompt + args.tokens) // 64) + 1

    def session(decoding):
        s = omnijax.Session(model, decoding=decoding, max_answer_tokens=args.tokens, num_pages=pages, page_size=64)
        s.feed(prompt)
        return s

    cases, answers = {}, {}
    for name, decoding in STRATEGIES.items():
        start = session(decoding).state
        for asked in (0, args.tokens):
            chunk = text_chunk(timed_ids, unit=1, answer_tokens=asked)

            def prepare(decoding=decoding, start=start):
                return (omnijax.Session(model, decoding=decoding, max_answer_tokens=args.tokens, num_pages=pages,
                                        page_size=64, state=jax.tree.map(jnp.copy, start)),)

            cases[(name, asked)] = harness.Case(lambda s, chunk=chunk: s.feed(chunk).tokens, prepare)
    ms = harness.interleaved(cases, args.rounds, label="decoding")
    for name, decoding in STRATEGIES.items():
        answers[name] = np.asarray(cases[(name, args.tokens)].fn(*cases[(name, args.tokens)].prepare()))[0]
    rows = []
    greedy_per_token = None
    for name in STRATEGIES:
        extra = ms[(name, args.tokens)] - ms[(name, 0)]
        per_token = float(np.median(extra)) / args.tokens
        greedy_per_token = greedy_per_token or per_token
        rows.append({"strategy": name, "chunk_ms": float(np.median(ms[(name, 0)])),
                     "answer_ms": float(np.median(ms[(name, args.tokens)])), "ms_per_token": per_token,
                     "vs_greedy": per_token / greedy_per_token,
                     "decoded": int((answers[name] >= 0).sum())})
    harness.print_table(rows, [("strategy", "strategy", ""), ("chunk ms", "chunk_ms", ".2f"),
                               ("with answer ms", "answer_ms", ".2f"), ("ms/token", "ms_per_token", ".3f"),
                               ("vs greedy", "vs_greedy", ".2f"), ("decoded", "decoded", "d")])
    harness.write_json(out, "decoding", {"vocab": args.vocab, "tokens": args.tokens, "prompt": args.prompt,
                                         "rounds": args.rounds, "rows": rows}, indent=2)
    fig, ax = harness.pyplot().subplots(figsize=(6, 3.5))
    ax.bar([r["strategy"] for r in rows], [r["ms_per_token"] for r in rows], color=["gray", "tab:blue", "tab:green"])
    ax.set_ylabel("ms per answer token")
    ax.set_title(f"answer decoding inside the stream step (vocab {args.vocab}, CPU)")
    harness.save_png(fig, out, "decoding")


if __name__ == "__main__":
    main()
