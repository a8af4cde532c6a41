"""Question-time recall (issue 40) on real weights: the multi-turn pass key per bounded policy, without and with
recall of evicted units from the host tier, at one device budget and one recall budget.

Each session is the multi-turn pass key of `bench/quality/passkey.py` (turn 1 states the key, filler turns follow,
the question comes last), streamed through an `omnijax.Session` under SinkWindow, StreamingLLM and OmniPick set to
`--budget` cells (`bench/quality/_stream.py`), each plain and with `StreamConfig(recall=Recall(budget=--recall))`
(its pool grown by the recall budget), plus the full context (NoSlide) as the reference. Per session it records
whether the greedy answer holds the key, the device cells the question attends (the cells cached when it arrives
plus those recalled), as a share of the tokens fed before it, the host tier's bytes, the units and cells recalled,
and the question's latency: its `feed` (recall's scoring, transfer and re-layout included) timed warm, by
resuming a snapshot taken before the question (`Session.snapshot` / `Session.resume`: the programs are compiled by
then) and feeding it again; both runs must answer the same.

Prints a table, writes `recall.json` (one row per session) under `--out`.

    .venv/bin/python -m bench.quality.recall                  # SmolLM2 (the GGUF `make demo` installs)
    .venv/bin/python -m bench.quality.recall --keys 4 --lengths 1024 2048
    .venv/bin/python -m bench.quality.recall --smoke          # the tiny random Llama, seconds; figures meaningless
"""

from __future__ import annotations

import sys
import time

import numpy as np

from bench import harness
from bench.quality import _common as common

POLICIES = ("sink_window", "streaming_llm", "omnipick")
SMOKE = dict(lengths=[256], budget=96, recall=64, keys=1, chunk=64)


def build_parser():
    p = harness.parser(__doc__)
    common.add_model_args(p)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024], help="prompt lengths in tokens")
    p.add_argument("--budget", type=int, default=256, help="device cell budget of each bounded policy")
    p.add_argument("--recall", type=int, default=128, help="recall budget in cells (Recall(budget=...))")
    p.add_argument("--recall-units", type=int, default=8, help="most units one question recalls")
    p.add_argument("--scoring", default="mass", help="Recall(scoring=...)")
    p.add_argument("--keys", type=int, default=2, help="pass keys (sessions) per length")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    p.add_argument("--chunk", type=int, default=128, help="tokens per streamed chunk")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    return p


def _live(session) -> int:
    return int(np.asarray(session.state.kv.valid).sum())


def _answer(model, out) -> str:
    return model.tokenizer.decode([int(t) for t in np.asarray(out.tokens[0]) if t >= 0], skip_special_tokens=True)


def run_one(model, prompt, config, chunk: int) -> dict:
    """One session: feeds the context, snapshots, asks (cold), resumes the snapshot and asks again (warm)."""
    from omnijax.chunks.chunk import pad_chunk
    from omnijax.streaming.session import Session

    length = max([chunk] + [p.length for p in prompt.parts])
    parts = [pad_chunk(p, length) for p in prompt.parts]
    session = Session(model, config)
    for part in parts[:-1]:
        session.feed(part)
    cached = _live(session)
    a, b = prompt.key_orders
    kv = session.state.kv
    key_held = int(np.sum(np.asarray(kv.valid) & (np.asarray(kv.order) >= a) & (np.asarray(kv.order) < b)))
    snap = session.snapshot()
    cold = session.feed(parts[-1])
    answer = _answer(model, cold).strip()
    warm_session = Session.resume(model, snap, config)
    started = time.perf_counter()
    warm = warm_session.feed(parts[-1])
    np.asarray(warm.tokens)  # waits for the step
    seconds = time.perf_counter() - started
    if _answer(model, warm).strip() != answer:
        raise SystemExit("the resumed session answered otherwise than the uninterrupted one")
    row = dict(answer=answer, correct=common.contains_key(answer, prompt.key), cached=cached, key_held=key_held,
               key_cells=b - a, question_s=seconds, fed=prompt.tokens - (int(np.asarray(prompt.parts[-1].valid).sum())))
    if config.recall is not None:
        report, stats = warm_session._recall.last, warm_session.recall_stats()
        row.update(recalled_units=len(report.units), recalled_cells=report.cells, host_bytes=stats.stored_bytes,
                   host_units=stats.stored_units, dropped_units=stats.dropped_units, lost_cells=stats.lost_cells)
    else:
        row.update(recalled_units=0, recalled_cells=0, host_bytes=0, host_units=0, dropped_units=0, lost_cells=0)
    row["device_cells"] = cached + row["recalled_cells"]
    row["device_share"] = row["device_cells"] / row["fed"]
    return row


def main(argv=None):
    args = harness.parse(build_parser(), sys.argv[1:] if argv is None else argv, smoke=SMOKE)
    common.quiet_threads()
    out = harness.output_dir(args)
    source = common.model_source(args)
    import omnijax
    from bench.quality import _stream
    from bench.quality.passkey import with_recall
    from omnijax.retention.recall import Recall

    model = omnijax.load(source.checkpoint)
    rows = []
    names = ["no_slide"] + [f"{p}{s}" for p in args.policies for s in ("", "+recall")]
    for length in args.lengths:
        prompts = [_stream.multi_turn(model, length, key, args.chunk)
                   for key in common.pass_keys(args.keys, args.seed + 1000 * length)]
        for name in names:
            base, recall = name.removesuffix("+recall"), name.endswith("+recall")
            for i, prompt in enumerate(prompts):
                policy = _stream.policy_at(base, args.budget)
                config = _stream.stream_config(policy, tokens=prompt.tokens, budget=args.budget, chunk=args.chunk,
                                               page_size=args.page_size)
                if recall:
                    config = with_recall(config, args.recall, args.recall_units)
                    config = config.replace(recall=Recall(budget=args.recall, top_units=args.recall_units,
                                                          scoring=args.scoring))
                row = dict(policy=name, length=length, key_index=i, key=prompt.key, **run_one(model, prompt, config,
                                                                                               args.chunk))
                rows.append(row)
                print(f"  {name} L={prompt.tokens} key {i}: {'right' if row['correct'] else 'wrong'} "
                      f"({row['answer'][:32]!r}), cells at the question {row['device_cells']} "
                      f"({row['device_share']:.0%}), recalled {row['recalled_cells']}, host "
                      f"{row['host_bytes'] / 1e6:.1f} MB, question {row['question_s']:.2f} s", flush=True)
                harness.write_json(out, "recall", dict(model=str(source.gguf or source.checkpoint),
                                                        random_weights=source.tiny, budget=args.budget,
                                                        recall=args.recall, scoring=args.scoring, chunk=args.chunk,
                                                        complete=False, rows=rows))
    harness.write_json(out, "recall", dict(model=str(source.gguf or source.checkpoint), random_weights=source.tiny,
                                           budget=args.budget, recall=args.recall, scoring=args.scoring,
                                           chunk=args.chunk, complete=True, rows=rows))
    print_table(rows)
    plot(rows, out, tiny=source.tiny)


def report(path) -> None:
    """Prints the table of a `recall.json` written earlier."""
    import json

    print_table(json.loads(open(path).read())["rows"])


def summary(rows) -> list[dict]:
    """One line per (policy, length): accuracy, mean device cells and share, host MB, mean warm question s."""
    out = []
    for key in dict.fromkeys((r["policy"], r["length"]) for r in rows):
        group = [r for r in rows if (r["policy"], r["length"]) == key]
        out.append(dict(policy=key[0], length=key[1], acc=f"{sum(r['correct'] for r in group)}/{len(group)}",
                        cells=float(np.mean([r["device_cells"] for r in group])),
                        share=float(np.mean([r["device_share"] for r in group])),
                        recalled=float(np.mean([r["recalled_cells"] for r in group])),
                        host_mb=float(np.mean([r["host_bytes"] for r in group])) / 1e6,
                        question_s=float(np.mean([r["question_s"] for r in group]))))
    return out


def plot(rows, out, *, tiny: bool) -> None:
    """`recall.png`: per policy and length, pass-key accuracy (left) and the device cells held at the question as a
    share of the full context (right), each policy without recall beside itself with recall."""
    plt = harness.pyplot()
    table = summary(rows)
    fig, (acc, share) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['policy']}\n{r['length']}" for r in table]
    colours = ["tab:orange" if r["policy"].endswith("+recall") else "tab:blue" for r in table]
    right = [int(r["acc"].split("/")[0]) / max(1, int(r["acc"].split("/")[1])) for r in table]
    acc.bar(range(len(table)), right, color=colours)
    acc.set_ylabel("pass keys answered")
    acc.set_ylim(0, 1.05)
    share.bar(range(len(table)), [r["share"] for r in table], color=colours)
    share.set_ylabel("cells at the question / context")
    for ax in (acc, share):
        ax.set_xticks(range(len(table)), labels, rotation=60, ha="right", fontsize=7)
    fig.suptitle("Recall of evicted units" + (" (tiny RANDOM weights: the pipeline, not the numbers)" if tiny else "")
                 + ": blue without, orange with recall")
    harness.save_png(fig, out, "recall")


def print_table(rows) -> None:
    harness.print_table(summary(rows), [("retention policy (+recall)", "policy", ""), ("length", "length", "d"),
                                        ("right", "acc", ""),
                                        ("cells at question", "cells", ".0f"), ("of context", "share", ".0%"),
                                        ("recalled cells", "recalled", ".0f"), ("host MB", "host_mb", ".1f"),
                                        ("question s (warm)", "question_s", ".2f")])


if __name__ == "__main__":
    main()
