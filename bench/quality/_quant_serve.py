"""`quantized --serve`: SmolLM2 with quantised weights chatted with in process and served (issue 41, done-when).

Each variant of `--serve-variants` (the conversions `quantized` makes: float32, int8, int4 g32, the kept Q4_1
blocks) is loaded, asked every question of `--serve-questions` through `omnijax.Chat` (greedy, `--serve-tokens`
tokens, one fresh conversation a question), then served by `omnijax.serve.app.build_context` + `BackgroundServer`
and asked the same questions through the official openai SDK, whole and streamed. Recorded: each answer, whether the
served answers equal the in-process one, and whether the quantised answer equals float32's. Writes
`quantized_serve.json` and `quantized_serve.png`.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench import harness

QUESTIONS = ("What is the capital of France?", "Name three colours of the rainbow.",
             "Write one sentence about the sea.")
VARIANTS = ("float32", "int8", "int4_g32", "gguf_kept")


def add_args(p) -> None:
    p.add_argument("--serve", action="store_true",
                   help="chat with and serve each quantised variant; served answers vs in-process Chat")
    p.add_argument("--serve-variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--serve-tokens", type=int, default=24, help="--serve: greedy tokens an answer")
    p.add_argument("--serve-questions", nargs="+", default=list(QUESTIONS))


def _config():
    import omnijax
    from omnijax.retention import SinkWindow

    return omnijax.StreamConfig(policy=SinkWindow(sink=16, window=1024), num_pages=48, page_size=32,
                                max_answer_tokens=8)


def run(args, source, out: Path, convert_variant) -> None:
    """`--serve` (module docstring)."""
    if args.serve_tokens < 1:
        raise SystemExit(f"--serve-tokens must be >= 1, got {args.serve_tokens}")
    if "float32" not in args.serve_variants:
        raise SystemExit("--serve-variants must include float32 (the reference of 'answer = float32')")
    try:
        import openai
    except ImportError:
        raise SystemExit("--serve needs the openai SDK (pip install 'omnijax[test]')") from None
    import omnijax
    from omnijax.serve.app import BackgroundServer, build_context
    from omnijax.serve.context import ServeOptions

    rows, results = [], {}
    for name in args.serve_variants:
        path = convert_variant(source, name, Path(args.work))
        if path is None:
            print(f"  {name}: skipped (no GGUF blocks to keep: a --smoke model)", flush=True)
            continue
        model = omnijax.load(path)
        if model.tokenizer is None:
            raise SystemExit(f"{path} has no tokenizer: --serve asks questions in text")
        started = time.perf_counter()
        chat = []
        for question in args.serve_questions:
            conversation = omnijax.Chat(model, _config())
            chat.append("".join(conversation.ask(question, max_tokens=args.serve_tokens)))
        chat_s = time.perf_counter() - started
        context = build_context(model, options=ServeOptions(port=0, frame_ms=1000,
                                                            max_output_tokens=args.serve_tokens),
                                stream=_config(), chunk_tokens=64, buckets=(1,), aimd_target=0)
        whole, streamed = [], []
        started = time.perf_counter()
        with BackgroundServer(context) as server:
            client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600.0)
            for question in args.serve_questions:
                messages = [{"role": "user", "content": question}]
                reply = client.chat.completions.create(model="omnijax", messages=messages,
                                                       max_tokens=args.serve_tokens, temperature=0)
                whole.append(reply.choices[0].message.content)
                parts = client.chat.completions.create(model="omnijax", messages=messages,
                                                       max_tokens=args.serve_tokens, temperature=0, stream=True)
                streamed.append("".join(c.choices[0].delta.content or "" for c in parts if c.choices))
        serve_s = time.perf_counter() - started
        results[name] = dict(checkpoint=str(path), chat=chat, served=whole, streamed=streamed, chat_seconds=chat_s,
                             serve_seconds=serve_s)
        base = results["float32"]["chat"]
        row = dict(variant=name, questions=len(chat),
                   served_equal=sum(a == b for a, b in zip(whole, chat)),
                   streamed_equal=sum(a == b for a, b in zip(streamed, chat)),
                   float_equal=sum(a == b for a, b in zip(chat, base)))
        rows.append(row)
        print(f"  {name}: served = Chat {row['served_equal']}/{row['questions']}, streamed = Chat "
              f"{row['streamed_equal']}/{row['questions']}, Chat = float32's {row['float_equal']}/{row['questions']}",
              flush=True)
        for question, answer in zip(args.serve_questions, chat):
            print(f"    {question!r} -> {answer!r}", flush=True)
        harness.write_json(out, "quantized_serve", dict(model=str(source.gguf or source.checkpoint),
                                                        tokens=args.serve_tokens, table=rows, variants=results))
    harness.print_table(rows, [("variant", "variant", ""), ("served = Chat", "served_equal", "d"),
                               ("streamed = Chat", "streamed_equal", "d"), ("= float32", "float_equal", "d"),
                               ("of", "questions", "d")])
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    names = [r["variant"] for r in rows]
    for i, key in enumerate(("served_equal", "streamed_equal", "float_equal")):
        ax.bar([j + 0.27 * i for j in range(len(rows))], [r[key] for r in rows], 0.27, label=key)
    ax.set_xticks([j + 0.27 for j in range(len(rows))], names)
    ax.set_ylabel(f"answers of {len(args.serve_questions)}")
    ax.set_title("quantised SmolLM2: served and in-process answers")
    ax.legend(fontsize=7)
    harness.save_png(fig, out, "quantized_serve")
