"""Markdown tables and the summary PNGs of the quality runs, from their JSON rows (no model, no JAX).

Reads what `passkey`, `selectors` and `perplexity` wrote under a results folder (`bench/quality/results/` by
default: `passkey.json`, `selectors.json`, `perplexity_*.json`), prints the markdown tables of
`bench/quality/RESULTS.md`, and writes `passkey_budget.png` (pass-key accuracy against the budget as a share of the
prompt, per policy) and `perplexity_length.png` (perplexity of the first N tokens against N, per configuration, from
the longest perplexity run). A run stopped early (`complete: false`) is reported with the rows it has.

    .venv/bin/python -m bench.quality._report [--results bench/quality/results]
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from bench import harness

RESULTS = Path(__file__).resolve().parent / "results"
POLICY_ORDER = ("no_slide", "omnipick", "unit_fifo", "token_sliding", "streaming_llm", "h2o", "sink_window",
                "streaming_vlm", "infinipot_v", "streammem")


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def passkey_tables(data: dict) -> str:
    """Per prompt shape: one row per (policy, budget), one column per (length, depth) with the answer's verdict,
    accuracy per length, peak cells and the key's cells held at the question."""
    rows = data["rows"]
    lengths = sorted({r["length"] for r in rows})
    out = []
    for mode in ("single", "multi"):
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue
        depths = sorted({r["depth"] for r in mine})
        cols = [(n, d) for n in lengths for d in depths]
        head = ["policy", "budget"] + [f"{n // 1024}K" + (f" d{d:.1f}" if mode == "single" else "") for n, d in cols]
        head += ["right", "peak cells", "key held"]
        out.append(f"**{mode}** ({'one user message' if mode == 'single' else 'key in turn 1, filler turns'}): "
                   "R right, w wrong, n/m right of m keys (key's cells held at the question in brackets when not all), "
                   "- not run\n")
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        groups: dict = defaultdict(lambda: defaultdict(list))
        for r in mine:
            groups[r["policy"], r["budget"]][r["length"], r["depth"]].append(r)
        order = sorted(groups, key=lambda k: (POLICY_ORDER.index(k[0]) if k[0] in POLICY_ORDER else 99, k[1]))
        for policy, budget in order:
            cells = groups[policy, budget]
            line = [policy, str(budget) if policy != "no_slide" else "all"]
            for key in cols:
                runs = cells.get(key, [])
                if not runs:
                    line.append("-")
                    continue
                kept, whole = sum(r["key_cells_kept"] for r in runs), sum(r["key_cells"] for r in runs)
                held = "" if kept == whole else f" ({kept}/{whole})"
                right = sum(r["correct"] for r in runs)
                verdict = ("R" if right else "w") if len(runs) == 1 else f"{right}/{len(runs)}"
                line.append(verdict + held)
            done = [r for runs in cells.values() for r in runs]
            line.append(f"{sum(r['correct'] for r in done)}/{len(done)}")
            line.append(f"{max(r['peak_cells'] for r in done):,}")
            line.append(f"{sum(r['key_cells_kept'] for r in done) / max(1, sum(r['key_cells'] for r in done)):.2f}")
            out.append("| " + " | ".join(line) + " |")
        out.append("")
    return "\n".join(out)


def passkey_plot(data: dict, out: Path) -> None:
    """Accuracy (both shapes pooled) against budget / prompt tokens, one line per policy; NoSlide at 1."""
    plt = harness.pyplot()
    acc = defaultdict(list)
    for r in data["rows"]:
        share = 1.0 if r["policy"] == "no_slide" else r["budget"] / r["length"]
        acc[r["policy"], share].append(r["correct"])
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    policies = [p for p in POLICY_ORDER if any(k[0] == p for k in acc)]
    for i, policy in enumerate(policies):
        xs = sorted(s for p, s in acc if p == policy)
        ys = [np.mean(acc[policy, s]) for s in xs]
        ax.plot(xs, ys, marker="os^v<>Dph*"[i % 10], label=policy, alpha=0.85,
                ls="--" if policy in ("no_slide", "infinipot_v") else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cell budget / prompt tokens (NoSlide: 1)")
    ax.set_ylabel("pass-key accuracy (single + multi)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("SmolLM2-135M: pass key against budget share, per retention policy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    harness.save_png(fig, out, "passkey_budget")


def selectors_table(data: dict) -> str:
    """One row per (selector, ratio): both sides' accuracy, identical kept sets, mean Jaccard, equal answers."""
    groups = defaultdict(list)
    for r in data["rows"]:
        groups[r["selector"], r["ratio"]].append(r)
    out = ["| selector | ratio | n | omnijax right | kvpress right | kept sets identical | mean Jaccard | "
           "answers equal |", "|---|---|---|---|---|---|---|---|"]
    names = list(dict.fromkeys(r["selector"] for r in data["rows"]))
    for (sel, ratio), g in sorted(groups.items(), key=lambda kv: (names.index(kv[0][0]), kv[0][1])):
        out.append(f"| {sel} | {ratio:.2f} | {len(g)} | {sum(r['omnijax_right'] for r in g)}/{len(g)} | "
                   f"{sum(r['kvpress_right'] for r in g)}/{len(g)} | {np.mean([r['sets_identical'] for r in g]):.3f} | "
                   f"{np.mean([r['jaccard'] for r in g]):.3f} | {sum(r['answers_equal'] for r in g)}/{len(g)} |")
    return "\n".join(out)


def selectors_cases_table(data: dict) -> str:
    """One row per (selector, ratio), one column per prompt (length, key depth): omnijax's and kvpress's verdicts
    (R right, w wrong), the share of identical (layer, KV head) kept sets, and "≠" where the answers differ."""
    prompts = sorted({(r["length"], r["depth"], r["key"], r["tokens"]) for r in data["rows"]})
    names = list(dict.fromkeys(r["selector"] for r in data["rows"]))
    cell = {(r["selector"], r["ratio"], r["length"], r["depth"], r["key"], r["tokens"]): r for r in data["rows"]}
    head = ["selector", "ratio"] + [f"{n // 1024}K d{d:.1f} ({t:,} tok)" for n, d, _, t in prompts]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for sel, ratio in sorted({(r["selector"], r["ratio"]) for r in data["rows"]},
                             key=lambda k: (names.index(k[0]), k[1])):
        line = [sel, f"{ratio:.2f}"]
        for n, d, key, t in prompts:
            r = cell.get((sel, ratio, n, d, key, t))
            if r is None:
                line.append("-")
                continue
            verdict = f"{'R' if r['omnijax_right'] else 'w'}/{'R' if r['kvpress_right'] else 'w'}"
            line.append(f"{verdict} {r['sets_identical']:.2f}" + ("" if r["answers_equal"] else " ≠"))
        out.append("| " + " | ".join(line) + " |")
    return "\n".join(out)


def perplexity_runs(results: Path) -> list[dict]:
    return [d for p in sorted(results.glob("perplexity_*.json")) if (d := _load(p)) and "configs" in d]


def perplexity_table(runs: list[dict], marks: tuple[int, ...] = (1024, 2048, 4096, 8192)) -> str:
    """Perplexity of the first N tokens, per run and configuration, at each N of `marks` the run reaches."""
    out = ["| text, tokens | config | cells | " + " | ".join(f"first {m:,}" for m in marks) + " | past window |",
           "|---|---|---|" + "---|" * (len(marks) + 1)]
    for d in runs:
        for name, c in d["configs"].items():
            nll = np.asarray(c["nll"])
            vals = [f"{math.exp(nll[:m].mean()):.2f}" if len(nll) >= m else "-" for m in marks]
            past = math.exp(nll[d["window"]:].mean())
            run = f"{d['text'].split('.')[0]}, {d['length']:,}"
            out.append(f"| {run} | {name} | {c['max_attended']:,} | " + " | ".join(vals) + f" | {past:.2f} |")
    return "\n".join(out)


def perplexity_plot(runs: list[dict], out: Path) -> None:
    """Perplexity of the first N tokens against N (the longest run of each configuration)."""
    plt = harness.pyplot()
    longest: dict[str, tuple[dict, dict]] = {}
    text = max(runs, key=lambda d: d["length"])["text"]
    for d in (d for d in runs if d["text"] == text):
        for name, c in d["configs"].items():
            if name not in longest or len(c["nll"]) > len(longest[name][1]["nll"]):
                longest[name] = (d, c)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for name, (d, c) in longest.items():
        nll = np.asarray(c["nll"])
        n = np.arange(64, len(nll) + 1, 64)
        cum = np.cumsum(nll)
        ax.plot(n, np.exp(cum[n - 1] / n), label=f"{name} ({c['max_attended']:,} cells at most)",
                ls="--" if name.endswith("_abs") else "-")
    window = next(iter(longest.values()))[0]["window"]
    ax.axvline(window, color="grey", ls=":", lw=1, label=f"window ({window} cells)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens N")
    ax.set_ylabel("perplexity of the first N tokens")
    ax.set_title(f"SmolLM2-135M on {text}: perplexity against length, sink ablation")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    harness.save_png(fig, out, "perplexity_length")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=str(RESULTS), help="the folder of the quality runs' JSON")
    args = p.parse_args(argv)
    results = Path(args.results)
    if not results.is_dir():
        raise SystemExit(f"--results {results}: no such folder (run the quality scripts with --out there first)")
    if (pk := _load(results / "passkey.json")) is not None:
        print(f"## pass key ({len(pk['rows'])} sessions, complete: {pk.get('complete', True)})\n")
        print(passkey_tables(pk))
        passkey_plot(pk, results)
    if (sel := _load(results / "selectors.json")) is not None:
        print(f"## selectors ({len(sel['rows'])} cases)\n")
        print(selectors_table(sel))
        print("\nper prompt: omnijax / kvpress verdict (R right, w wrong), share of identical kept sets, "
              "≠ where the answers differ, - not run\n")
        print(selectors_cases_table(sel))
    if runs := perplexity_runs(results):
        print("\n## perplexity\n")
        print(perplexity_table(runs))
        perplexity_plot(runs, results)


if __name__ == "__main__":
    main()
