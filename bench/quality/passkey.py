"""Pass-key retrieval per retention policy at matched cell budgets, on real weights, streamed through omnijax's
chunk_step.

The Landmark-attention haystack ("The grass is green. The sky is blue. ..." repeated, "The pass key is NNNNN.
Remember it." at a depth of the filler, the question last) in two shapes: `single`, one user message streamed as
units of `--chunk` tokens behind the chat template's system prefix, and `multi`, a conversation whose turn 1
states the key, filler turns follow (each acknowledged by a scripted assistant turn) and the question comes last.
Each session runs in an `omnijax.Session` (one jitted `chunk_step` per chunk) under each policy of `--policies` at
each budget of `--budgets` (see `bench/quality/_stream.py` for how each policy is set to a budget), and the greedy
answer is right when it contains the key. A policy that cannot hold the budget on a text-only model (InfiniPot-V
compresses visual spans only) still runs and is reported with the reason and the cells it held.

Prints a table per shape, writes `passkey.json` (one row per session) and `passkey.png` (accuracy against budget per
policy) under `--out`.

    .venv/bin/python -m bench.quality.passkey --gguf SmolLM2-135M-Instruct.Q4_1.gguf
    .venv/bin/python -m bench.quality.passkey --checkpoint DIR --lengths 1024 2048 4096 8192 --budgets 512 1024 2048
    .venv/bin/python -m bench.quality.passkey --smoke   # the tiny random Llama (bench/quality/_tiny.py), seconds
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

from bench import harness
from bench.quality import _common as common

SMOKE = dict(lengths=[256], budgets=[160], depths=[0.5], keys=1, chunk=64, modes=["single", "multi"],
             policies=["omnipick", "sink_window"])
"""Both prompt shapes under two bounded policies: each policy's step compiles once (both shapes pad their chunks to
`--chunk` and hold the same pool), four sessions."""


def build_parser():
    p = harness.parser(__doc__)
    common.add_model_args(p)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048], help="prompt lengths in tokens")
    p.add_argument("--budgets", type=int, nargs="+", default=[512], help="cell budgets")
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9], help="key depths (single prompt)")
    p.add_argument("--keys", type=int, default=2, help="keys per (length, depth) cell")
    p.add_argument("--modes", nargs="+", default=["single", "multi"], choices=["single", "multi"])
    p.add_argument("--policies", nargs="+", default=None, help="policy names (default: all ten)")
    p.add_argument("--chunk", type=int, default=128, help="tokens per streamed chunk")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recall", type=int, default=0, metavar="CELLS",
                   help="also run each policy with question-time recall of evicted units "
                        "(StreamConfig(recall=Recall(budget=CELLS))), as policy 'NAME+recall'; its pool grows by "
                        "CELLS, so its device cells are the budget plus CELLS at the question (0: off)")
    p.add_argument("--recall-units", type=int, default=8, help="most units one question recalls (--recall)")
    p.add_argument("--resume", action="store_true",
                   help="keep every row of --out's passkey.json (same --chunk) and run only the sessions it lacks")
    return p


def session_key(row: dict) -> tuple:
    """What names one session: (mode, policy, budget, length, depth, key index)."""
    return row["mode"], row["policy"], row["budget"], row["length"], row["depth"], row.get("key_index", 0)


def resumed_rows(out, args) -> list[dict]:
    """Every row of an earlier run's `passkey.json` under `out` (none when there is none): this run skips the
    sessions they name and writes them back with its own, so runs of other lengths, budgets or policies add up in
    one file.

    Raises:
        SystemExit: the earlier run used another chunk size (its rows are not comparable).
    """
    import json

    path = out / "passkey.json"
    if not path.is_file():
        return []
    old = json.loads(path.read_text())
    if old.get("chunk") != args.chunk:
        raise SystemExit(f"--resume: {path} was run with --chunk {old.get('chunk')}, this run asks {args.chunk}; "
                         "pass the same --chunk or another --out")
    return list(old["rows"])


def prompts(model, args):
    """Every session's prompt: (mode, length, depth, key index) -> `_stream.Prompt`."""
    from bench.quality import _stream

    out = {}
    for mode in args.modes:
        for length in args.lengths:
            depths = args.depths if mode == "single" else [0.0]
            for d, depth in enumerate(depths):
                for i, key in enumerate(common.pass_keys(args.keys, args.seed + 1000 * length + 10 * d)):
                    out[mode, length, depth, i] = (_stream.single_prompt(model, length, depth, key, args.chunk)
                                                   if mode == "single" else
                                                   _stream.multi_turn(model, length, key, args.chunk))
    return out


def with_recall(config, cells: int, units: int):
    """`config` with question-time recall of `cells` cells (at most `units` units), its pool grown to hold them."""
    from omnijax.retention.recall import Recall

    extra = -(-cells // config.page_size)
    return config.replace(num_pages=config.num_pages + extra, recall=Recall(budget=cells, top_units=units))


def summarise(rows):
    """Accuracy per (mode, policy, budget, length) and per (mode, policy, budget)."""
    cells = defaultdict(list)
    for r in rows:
        cells[r["mode"], r["policy"], r["budget"], r["length"]].append(r)
        cells[r["mode"], r["policy"], r["budget"], "all"].append(r)
    return {k: dict(acc=sum(r["correct"] for r in v) / len(v), n=len(v),
                    peak=max(r["peak_cells"] for r in v), key_kept=sum(r["key_cells_kept"] for r in v) /
                    max(1, sum(r["key_cells"] for r in v)))
            for k, v in cells.items()}


def print_tables(rows, args, policies):
    summary = summarise(rows)
    for mode in args.modes:
        print(f"\n{mode}: accuracy (sessions right / sessions), peak cells, share of the key's cells held at the "
              "question")
        table = []
        for budget in args.budgets:
            for name in policies:
                if (mode, name, budget, "all") not in summary:
                    continue
                row = {"policy": name, "budget": budget}
                for length in args.lengths + ["all"]:
                    s = summary.get((mode, name, budget, length))
                    row[str(length)] = None if s is None else s["acc"]
                row["peak"] = summary[mode, name, budget, "all"]["peak"]
                row["key held"] = summary[mode, name, budget, "all"]["key_kept"]
                table.append(row)
        harness.print_table(table, [("policy", "policy", ""), ("budget", "budget", "d")] +
                            [(str(n), str(n), ".2f") for n in args.lengths + ["all"]] +
                            [("peak", "peak", "d"), ("key held", "key held", ".2f")])
    for name, why in _limits(policies).items():
        print(f"note: {name} on a text-only model: {why}")


def _limits(policies):
    from bench.quality._stream import TEXT_ONLY_LIMITS

    return {k: v for k, v in TEXT_ONLY_LIMITS.items() if k in {p.removesuffix("+recall") for p in policies}}


def plot(rows, args, policies, out):
    plt = harness.pyplot()
    summary = summarise(rows)
    fig, axes = plt.subplots(1, len(args.modes), figsize=(6 * len(args.modes), 4.2), squeeze=False)
    for ax, mode in zip(axes[0], args.modes):
        for name in policies:
            xs = [b for b in args.budgets if (mode, name, b, "all") in summary]
            ax.plot(xs, [summary[mode, name, b, "all"]["acc"] for b in xs], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cell budget")
        ax.set_ylabel("pass-key accuracy")
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(f"{mode}: lengths {', '.join(map(str, args.lengths))} tokens")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="best")
    harness.save_png(fig, out, "passkey")


def main(argv=None):
    argv = ["--smoke" if a == "--quick" else a for a in (sys.argv[1:] if argv is None else argv)]
    args = harness.parse(build_parser(), argv, smoke=SMOKE)
    common.quiet_threads()
    out = harness.output_dir(args)
    source = common.model_source(args)
    from bench.quality import _stream

    policies = args.policies or list(_stream.POLICIES)
    if args.recall < 0:
        raise SystemExit(f"--recall must be >= 0 cells, got {args.recall}")
    if args.recall:
        policies = policies + [f"{name}+recall" for name in policies if name != "no_slide"]
    import omnijax

    model = omnijax.load(source.checkpoint)
    all_prompts = prompts(model, args)
    total = len(all_prompts) * len(policies) * len(args.budgets)
    print(f"{source.checkpoint}: {len(all_prompts)} prompts x {len(policies)} policies x {len(args.budgets)} "
          f"budgets = {total} sessions", flush=True)
    rows = resumed_rows(out, args) if args.resume else []
    done_keys = {session_key(r) for r in rows}
    todo = sum((mode, name, budget, plen, depth, i) not in done_keys for name in policies for budget in args.budgets
               for mode, plen, depth, i in all_prompts)
    if rows:
        print(f"--resume: {len(rows)} rows kept, {todo} of the {total} sessions to run", flush=True)
    done, started = 0, time.perf_counter()
    header = dict(model=str(source.gguf or source.checkpoint), random_weights=source.tiny, chunk=args.chunk,
                  budgets=sorted({r["budget"] for r in rows} | set(args.budgets)),
                  lengths=sorted({r["length"] for r in rows} | set(args.lengths)))
    for length in args.lengths:  # shortest first: a run stopped early keeps whole short-length tables
        for budget in args.budgets:
            for name in policies:
                base_name, recall = name.removesuffix("+recall"), name.endswith("+recall")
                policy = _stream.policy_at(base_name, budget)
                for (mode, plen, depth, i), prompt in all_prompts.items():
                    if plen != length or (mode, name, budget, length, depth, i) in done_keys:
                        continue
                    config = _stream.stream_config(policy, tokens=prompt.tokens, budget=budget, chunk=args.chunk,
                                                   page_size=args.page_size)
                    if recall:
                        config = with_recall(config, args.recall, args.recall_units)
                    o = _stream.run_session(model, prompt, config, pad_to=args.chunk)
                    done += 1
                    rows.append(dict(mode=mode, policy=name, budget=budget, length=length, tokens=prompt.tokens,
                                     depth=depth, key_index=i, key=prompt.key, answer=o.answer, correct=o.correct,
                                     peak_cells=o.peak_cells, mean_cells=o.mean_cells, final_cells=o.final_cells,
                                     key_cells_kept=o.key_cells_kept, key_cells=o.key_cells, seconds=o.seconds,
                                     note=_stream.TEXT_ONLY_LIMITS.get(base_name)))
                    # every row as it comes: a run stopped early keeps what it measured (`--resume` goes on)
                    harness.write_json(out, "passkey", dict(header, complete=False, rows=rows))
                    print(f"  [{done}/{todo}] {mode} {name}@{budget} L={prompt.tokens} depth={depth:.1f}: "
                          f"{'right' if o.correct else 'wrong'} ({o.answer[:40]!r}), peak {o.peak_cells} cells, key "
                          f"{o.key_cells_kept}/{o.key_cells}, {o.seconds:.1f} s "
                          f"({time.perf_counter() - started:.0f} s)", flush=True)
    harness.write_json(out, "passkey", dict(header, complete=True, rows=rows))
    print_tables(rows, args, policies)
    plot(rows, args, policies, out)


if __name__ == "__main__":
    main()
