"""What text in and text out cost on top of token ids: one conversational turn through `omnijax.Chat` against the
same turn fed to its `Session` as ready-made chunks.

Set-up: a Hugging Face-free `omnijax.Model` (random init, float32): a Qwen2-shaped decoder of `--layers` layers,
hidden 256, 8 query / 2 KV heads of 32, mrope, vocab `--vocab` (151,936 by default, Qwen2.5's), no eos ids, so every
answer runs to its token budget; its tokenizer is a `write_tiny_tokenizer` byte-level BPE with the ChatML template
and Qwen's special ids (moved down with the vocabulary when `--vocab` is smaller). The starting point is a chat
holding one system message. The turn is a user message of about `--prompt` tokens (its rendering, generation prompt
included, tokenizes to at most `--prompt`) asking for `--tokens` answer tokens, decoded greedily in blocks of
`--block` tokens (`StreamConfig.max_answer_tokens`), so both paths make ceil(tokens / block) feeds:

- token ids: `Session.feed` of the turn's chunks built and padded beforehand (the templated ids, then the answer
  continuations), the answer read back as ints after each feed;
- text: `Chat.ask(text, max_tokens=...)` consumed to the end: template rendering, tokenizing, chunk building and
  padding, the per-step cache figures `Chat` records, incremental detokenizing of every block and the final decodes
  of the answer.

Every round starts both paths from the same state: the text path from a fresh `Chat` fed the system message, the
id path from a `Session` given a copy of the state of the first such chat. The two run in interleaved rounds,
alternating which goes first. After timing, one run of each is checked to have fed the same ids, produced the same
answer and left bitwise equal states (cache, positions, keys). Overhead is the median over rounds of text / ids - 1
in the same round. The host-side costs are also timed directly, outside the model steps, over many repetitions
(medians): rendering, encoding, chunk building, decoding; their sum over the id path's time is the overhead without
the machine's noise.

Run: `python -m bench.metronome.text_io [--prompt 64] [--tokens 64] [--block 16] [--rounds 41] [--out bench/out]
[--smoke]`
"""

from __future__ import annotations

import tempfile
import time

import jax
import numpy as np

import omnijax
from bench import harness
from omnijax.chat import Chat
from omnijax.chunks.spans import SpanKind
from omnijax.decoding import Greedy
from omnijax.models.config import DecoderConfig
from omnijax.models.decoder import Decoder
from omnijax.models.tokenizer import CHATML_TEMPLATE, Tokenizer, write_tiny_tokenizer

QWEN_VOCAB = 151_936
QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|AUDIO|>": 151646,
                 "<|audio_bos|>": 151647, "<|audio_eos|>": 151648, "<|vision_bos|>": 151652,
                 "<|vision_eos|>": 151653, "<|IMAGE|>": 151655, "<|VIDEO|>": 151656}
SYSTEM = "You are a concise assistant that watches a live stream and answers questions about it."
WORDS = ("what", "happened", "in", "the", "last", "minute", "of", "stream", "and", "who", "spoke", "first", "after",
         "music", "stopped", "describe", "scene", "briefly", "please", "with", "colours", "people", "objects",
         "then", "say", "whether", "anything", "changed", "since", "earlier", "question", "about", "kitchen")
HOST_REPEATS = 200


def build_model(vocab: int, layers: int):
    """A random Qwen2-shaped decoder with no eos ids and a tiny ChatML tokenizer whose special ids sit where Qwen's do
    (shifted down with a smaller vocabulary)."""
    shift = QWEN_VOCAB - vocab
    specials = {name: i - shift for name, i in QWEN_SPECIALS.items()}
    directory = write_tiny_tokenizer(tempfile.mkdtemp(prefix="text_io_tok_"), vocab_size=vocab,
                                     special_tokens=specials, chat_template=CHATML_TEMPLATE)
    config = DecoderConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_layers=layers, num_heads=8,
                           num_kv_heads=2, head_dim=32, rope_theta=1e6, mrope_section=(4, 6, 6), qkv_bias=True,
                           eos_token_ids=())
    return omnijax.Model(Decoder(config), model_type="qwen2_5_omni", tokenizer=Tokenizer.from_directory(directory))


def user_message(tokenizer, history: list[dict], budget: int) -> tuple[str, list[int]]:
    """The longest message of `WORDS` whose turn (rendered after `history`, generation prompt included) tokenizes to
    at most `budget` ids; returns it and those ids."""
    before = tokenizer.render(history, add_generation_prompt=False)
    text, ids = "", None
    for i in range(10 * budget):
        longer = (text + " " + WORDS[i % len(WORDS)]).strip()
        rendered = tokenizer.render(history + [{"role": "user", "content": longer}], add_generation_prompt=True)
        assert rendered.startswith(before)
        longer_ids = tokenizer.encode(rendered[len(before):])
        if len(longer_ids) > budget:
            break
        text, ids = longer, longer_ids
    if ids is None:
        raise SystemExit(f"--prompt {budget} is below the template's own tokens for a one-word turn")
    return text, ids


def median_us(fn, repeats: int = HOST_REPEATS) -> float:
    times = np.empty(repeats)
    for r in range(repeats):
        start = time.perf_counter()
        fn()
        times[r] = time.perf_counter() - start
    return 1e6 * float(np.median(times))


def main(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument("--prompt", type=int, default=64, help="most tokens of the user turn as the template renders "
                                                               "it")
    parser.add_argument("--tokens", type=int, default=64, help="answer tokens of the turn")
    parser.add_argument("--block", type=int, default=16, help="answer tokens per step (max_answer_tokens)")
    parser.add_argument("--vocab", type=int, default=QWEN_VOCAB, help="vocabulary of the model and tokenizer")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=41)
    args = harness.parse(parser, argv, smoke=dict(prompt=24, tokens=4, block=2, vocab=1024, layers=1, rounds=2))
    out = harness.output_dir(args)
    model = build_model(args.vocab, args.layers)
    tokenizer = model.tokenizer
    greedy = Greedy()
    feeds = -(-args.tokens // args.block)
    pages = -(-(64 + 2 * args.prompt + args.tokens + args.block) // 64) + 1  # system and user buckets, answer, slack
    config = omnijax.StreamConfig(max_answer_tokens=args.block, num_pages=pages, page_size=64, decoding=greedy)

    def start_chat() -> Chat:
        chat = Chat(model, config)
        chat.system(SYSTEM)
        return chat

    start = start_chat()
    text, prompt_ids = user_message(tokenizer, start.messages, args.prompt)
    units = start.units_builder
    unit = 1 + max(u.unit for u in start.units)
    first = units.pad(units.text(prompt_ids, unit, SpanKind.TEXT, answer_tokens=min(args.block, args.tokens)))
    answer_unit = int(np.asarray(first.answer_unit)[0])
    chunks = [first] + [units.pad(units.continuation(answer_unit, min(args.block, args.tokens - done)))
                        for done in range(args.block, args.tokens, args.block)]
    assert len(chunks) == feeds

    def ids_turn(session) -> list[int]:
        answer = []
        for chunk in chunks:
            out = session.feed(chunk, decoding=greedy)
            answer += [int(t) for t in np.asarray(out.tokens[0]) if t >= 0]
        return answer

    def text_turn(chat) -> str:
        return "".join(chat.ask(text, max_tokens=args.tokens))

    def start_session() -> omnijax.Session:
        session = omnijax.Session(model, config, state=start.session.state)
        jax.block_until_ready(session.state)  # the copy is not timed
        return session

    cases = {"token ids": harness.Case(ids_turn, lambda: (start_session(),)),
             "text": harness.Case(text_turn, lambda: (start_chat(),))}
    print(f"vocab {args.vocab}, {args.layers} layers; turn: {len(prompt_ids)} prompt ids (bucket {first.length}), "
          f"{args.tokens} answer tokens in {feeds} feeds of {args.block}", flush=True)
    ms = harness.interleaved(cases, args.rounds, label="text_io")

    # Both paths fed the same ids, decoded the same answer and left bitwise equal states.
    session = start_session()
    answer_ids = ids_turn(session)
    chat = start_chat()
    answer_text = text_turn(chat)
    user_record, answer_record = chat.units[-2], chat.units[-1]
    ids_leaves, text_leaves = jax.tree.leaves(session.state), jax.tree.leaves(chat.session.state)
    checks = {"prompt_ids": sum(user_record.fed.values()) == len(prompt_ids),
              "answer_tokens": len(answer_ids) == args.tokens == answer_record.fed[int(SpanKind.RESPONSE)],
              "answer_text": answer_text == tokenizer.decode(answer_ids, skip_special_tokens=True),
              "feeds": len(chat.steps) - 1 == feeds,
              "same_state": len(ids_leaves) == len(text_leaves) and all(
                  np.array_equal(a, b) for a, b in zip(ids_leaves, text_leaves))}
    if not all(checks.values()):
        raise SystemExit(f"the two paths did not do the same work: {checks}")

    # Host-side costs, timed directly (what Chat.ask does around the model steps).
    messages = start.messages + [{"role": "user", "content": text}]
    before = tokenizer.render(start.messages, add_generation_prompt=False)
    rendered = tokenizer.render(messages, add_generation_prompt=True)
    blocks = [answer_ids[i:i + args.block] for i in range(0, len(answer_ids), args.block)]

    def build():
        chunk = units.pad(units.text(prompt_ids, unit, SpanKind.TEXT, answer_tokens=min(args.block, args.tokens)))
        return [chunk] + [units.pad(units.continuation(answer_unit, min(args.block, args.tokens - done)))
                          for done in range(args.block, args.tokens, args.block)]

    def decode():
        decoder = tokenizer.stream_decoder(skip_special_tokens=True)
        pieces = [decoder.push(b) for b in blocks] + [decoder.flush()]
        tokenizer.decode(answer_ids, skip_special_tokens=True)  # the assistant message Chat keeps
        tokenizer.decode(answer_ids)  # the rendering Chat records as fed
        return pieces

    host_us = {"render": median_us(lambda: tokenizer.render(messages, add_generation_prompt=True)),
               "encode": median_us(lambda: tokenizer.encode(rendered[len(before):])),
               "build chunks": median_us(build),
               "decode": median_us(decode)}
    host_ms = sum(host_us.values()) / 1e3
    ids_ms, text_ms = float(np.median(ms["token ids"])), float(np.median(ms["text"]))
    overhead = 100 * (harness.same_round_ratio(ms["text"], ms["token ids"]) - 1)
    # The first chunk carries the rendering, encoding and building; every chunk one block's decoding.
    first_share = 100 * (host_us["render"] + host_us["encode"] + host_us["build chunks"] + host_us["decode"] / feeds
                         ) / 1e3 / (ids_ms / feeds)
    rows = [{"path": "token ids", "turn_ms": ids_ms, "per_chunk_ms": ids_ms / feeds, **harness.stats(ms["token ids"])},
            {"path": "text", "turn_ms": text_ms, "per_chunk_ms": text_ms / feeds, **harness.stats(ms["text"])}]
    harness.print_table(rows, [("path", "path", ""), ("ms / turn", "turn_ms", ".1f"),
                               ("ms / chunk", "per_chunk_ms", ".2f"), ("p10", "p10", ".1f"), ("p90", "p90", ".1f")])
    print(f"overhead, same-round median: {overhead:+.2f} % per turn (and per chunk: the same feeds); the answer "
          f"decodes to {len(answer_text)} characters")
    print("host-side costs per turn, timed directly: " + ", ".join(f"{k} {v:.0f} us" for k, v in host_us.items())
          + f"; total {host_ms:.3f} ms = {100 * host_ms / ids_ms:.3f} % of the id path's turn; first chunk "
          f"(render + encode + build + one block's decode) {first_share:.3f} % of a mean chunk")
    harness.write_json(out, "text_io", {
        "vocab": args.vocab, "layers": args.layers, "prompt_ids": len(prompt_ids), "bucket": first.length,
        "tokens": args.tokens, "block": args.block, "feeds": feeds, "rounds": args.rounds, "rows": rows,
        "overhead_pct": overhead, "host_us": host_us, "host_pct": 100 * host_ms / ids_ms,
        "first_chunk_host_pct": first_share, "answer_chars": len(answer_text), "checks": checks,
        "round_ms": {name: [float(x) for x in v] for name, v in ms.items()}}, indent=2)

    plt = harness.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5), gridspec_kw={"width_ratios": [1, 1.4]})
    left.bar([r["path"] for r in rows], [r["turn_ms"] for r in rows], color=["gray", "tab:blue"],
             yerr=[[r["turn_ms"] - r["p10"] for r in rows], [r["p90"] - r["turn_ms"] for r in rows]], capsize=4)
    left.set_ylabel("ms per turn (median, p10-p90)")
    left.set_title(f"one turn, {feeds} feeds: {overhead:+.2f} %")
    right.barh(list(host_us), list(host_us.values()), color="tab:orange")
    right.set_xlabel("µs per turn (timed directly)")
    right.set_title(f"host side: {100 * host_ms / ids_ms:.3f} % of the id path")
    fig.suptitle(f"Chat text I/O over token ids (vocab {args.vocab}, {len(prompt_ids)} + {args.tokens} tokens, CPU)",
                 fontsize=10)
    harness.save_png(fig, out, "text_io")


if __name__ == "__main__":
    main()
