"""`bench.peers.vs_transformers`' rows and what it shows of them: the JSON rows of a streaming section from its
workers' results (`stream_rows`, with the last-token logits' agreement where both sides compute the same thing and,
per omnijax row, the same-round ratios' spread, of the wall and of the workers' CPU seconds, and each round's load
average: `rounds_figures`), the tables it prints
and its three-panel figure. Pure functions of the rows: no worker, no torch, no JAX."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench import harness

SIDES = ("omnijax", "transformers")
POLICY_SPECS = {"no_slide": "no_slide", "omnipick": "omnipick", "sink_window": "sink_window:sink=16,window=2048"}


def agreement(mine: list, peer: list) -> dict:
    """Max |omnijax - transformers| over rounds of one set of last-token logits, and transformers' largest |logit|."""
    return {"logits_max_diff": max(float(np.max(np.abs(np.subtract(a, b)))) for a, b in zip(mine, peer)),
            "logits_max_abs": float(np.max(np.abs(peer[0])))}


def rounds_figures(mine, peer, rounds: list[dict], prefix: str = "") -> dict:
    """The same-round ratios of `mine` / `peer` (one value a round): `{prefix}ratio` (their median), `_rounds`,
    `_min`, `_max`, `_p10`, `_p90`; and `load_rounds`, each round's 1 / 5 / 15-minute load averages as each side's
    worker started (`rounds`: `[{side: worker result with "load"}]`)."""
    ratios = np.asarray(mine, float) / np.asarray(peer, float)
    key = f"{prefix}ratio"
    return {key: float(np.median(ratios)), f"{key}_rounds": ratios.tolist(), f"{key}_min": float(ratios.min()),
            f"{key}_max": float(ratios.max()), f"{key}_p10": float(np.percentile(ratios, 10)),
            f"{key}_p90": float(np.percentile(ratios, 90)),
            "load_rounds": [{side: r[side].get("load") for side in SIDES} for r in rounds]}


def stream_rows(section: str, rounds: list[dict], name: str | None) -> list[dict]:
    """JSON rows of a streaming section: transformers' and (policy `name`, or every policy) omnijax's per history."""
    peer = [r["transformers"] for r in rounds]
    histories = peer[0]["histories"]
    assert all(r["omnijax"]["histories"] == histories for r in rounds), "the sides measured different histories"
    mine = {name: [r["omnijax"] for r in rounds]} if name else {
        p: [r["omnijax"]["policies"][p] for r in rounds] for p in POLICY_SPECS}
    rows = []
    for j, h in enumerate(histories):
        peer_ms, peer_cpu = [p["ms"][j] for p in peer], [p["cpu_ms"][j] for p in peer]
        rows.append({"section": section, "history": h, "side": "transformers", "policy": "full",
                     **harness.stats(peer_ms), "ms_rounds": peer_ms, "cpu_ms": float(np.median(peer_cpu)),
                     "cpu_ms_rounds": peer_cpu, "stream_ms": float(np.median([p["stream_ms"][j] for p in peer]))})
        for policy, runs in mine.items():
            ms, cpu = [m["ms"][j] for m in runs], [m["cpu_ms"][j] for m in runs]
            row = {"section": section, "history": h, "side": "omnijax", "policy": policy, **harness.stats(ms),
                   "ms_rounds": ms, "cpu_ms": float(np.median(cpu)), "cpu_ms_rounds": cpu,
                   "stream_ms": float(np.median([m["stream_ms"][j] for m in runs])),
                   **rounds_figures(cpu, peer_cpu, rounds, prefix="cpu_"), **rounds_figures(ms, peer_ms, rounds),
                   "cells": runs[0]["cells"][j],
                   "pool_pages": runs[0].get("pool_pages")}
            if policy == "no_slide":  # the same computation as transformers': the logits must agree
                row.update(agreement([m["logits"][j] for m in runs], [p["logits"][j] for p in peer]))
            rows.append(row)
    return rows


def pick(rows, section, side, policy=None):
    return [r for r in rows if r["section"] == section and r["side"] == side and policy in (None, r["policy"])]


def print_tables(rows) -> None:
    """One table per section, a line per history or prompt length."""
    def peer(key, field="median", section="full"):  # transformers' figure beside an omnijax row
        return lambda r: {t.get(key): t[field] for t in pick(rows, section, "transformers")}[r[key]]

    ms, ratio, diff = ".1f", ".3f", ".2e"

    def spread(prefix=""):  # the same-round ratios' min-max
        return lambda r: f"{r[f'{prefix}ratio_min']:.3f}-{r[f'{prefix}ratio_max']:.3f}"

    def load(r):  # the 1-minute load averages the row's workers started at, lowest-highest
        got = [side[0] for rnd in r["load_rounds"] for side in rnd.values() if side]
        return f"{min(got):.1f}-{max(got):.1f}" if got else None
    print("\nfull context: per-chunk ms (median over rounds); ratio = omnijax / transformers (same-round median)")
    harness.print_table(pick(rows, "full", "omnijax"), [
        ("history", "history", "d"), ("omnijax ms", "median", ms), ("transformers ms", peer("history"), ms),
        ("ratio", "ratio", ratio), ("min-max", spread(), "s"), ("CPU ms", "cpu_ms", ms),
        ("transformers CPU", peer("history", "cpu_ms"), ms), ("CPU ratio", "cpu_ratio", ratio),
        ("min-max", spread("cpu_"), "s"), ("logits diff", "logits_max_diff", diff),
        ("|logits|", "logits_max_abs", diff), ("load", load, "s")])
    print("\nbounded: per-chunk ms; ratio = omnijax policy / transformers with its full history; cells attended")
    columns = [("history", "history", "d"), ("transformers ms", peer("history", section="bounded"), ms)]
    for name in POLICY_SPECS:
        def of(field, name=name):
            return lambda r: next(o[field] for o in pick(rows, "bounded", "omnijax", name)
                                  if o["history"] == r["history"])
        columns += [(f"{name} ms", of("median"), ms), ("ratio", of("ratio"), ratio),
                    ("min-max", lambda r, of=of: f"{of('ratio_min')(r):.3f}-{of('ratio_max')(r):.3f}", "s"),
                    ("CPU ratio", of("cpu_ratio"), ratio), ("cells", of("cells"), "d")]
    harness.print_table(pick(rows, "bounded", "omnijax", "no_slide"), columns + [
        ("no_slide logits diff", "logits_max_diff", diff), ("load", load, "s")])
    print("\nprefill to 25 % per KV head: ms of the warm call (cold: the first); RSS MiB, delta = peak - after load")
    harness.print_table(pick(rows, "prefill", "omnijax"), [
        ("S", "length", "d"), ("kvpress ms", peer("length", section="prefill"), ".0f"), ("omnijax ms", "median", ".0f"),
        ("ratio", "ratio", ratio), ("min-max", spread(), "s"),
        ("kvpress cold", peer("length", "cold_ms", "prefill"), ".0f"),
        ("omnijax cold", "cold_ms", ".0f"), ("kvpress RSS", peer("length", "rss_peak_mib", "prefill"), ".0f"),
        ("delta", peer("length", "rss_delta_mib", "prefill"), ".0f"), ("omnijax RSS", "rss_peak_mib", ".0f"),
        ("delta", "rss_delta_mib", ".0f"), ("delta ratio", "rss_delta_ratio", ratio),
        ("peak ratio", "rss_peak_ratio", ratio), ("min-max", spread("rss_peak_"), "s"),
        ("logits diff", "logits_max_diff", diff), ("kept/head", "kept_per_head", ".0f"), ("load", load, "s")])


def plot(rows, out: Path, name: str = "vs_transformers") -> None:
    """Three panels: full-context and bounded per-chunk ms against history, prefill time and RSS delta against S;
    saved as `out/<name>.png`."""
    fig, (full_ax, bounded_ax, prefill_ax) = harness.pyplot().subplots(1, 3, figsize=(16, 4.5))
    colors = {"omnijax": "tab:blue", "transformers": "tab:orange"}
    lines = [(full_ax, pick(rows, "full", side), side, "os"[i], colors[side]) for i, side in enumerate(SIDES)]
    lines.append((bounded_ax, pick(rows, "bounded", "transformers"), "transformers (full history)", "s", "black"))
    lines += [(bounded_ax, pick(rows, "bounded", "omnijax", name), f"omnijax {spec}", marker, color)
              for (name, spec), marker, color in zip(POLICY_SPECS.items(), "o^v", ("tab:blue", "tab:green", "tab:red"))]
    for ax, got, label, marker, color in lines:
        ax.plot([r["history"] for r in got], [r["median"] for r in got], marker=marker, color=color, label=label)
    memory_ax = prefill_ax.twinx()
    for side, label in zip(SIDES, ("omnijax TideKV", "kvpress SnapKV")):
        got = pick(rows, "prefill", side)
        x = [r["length"] for r in got]
        prefill_ax.plot(x, [r["median"] / 1e3 for r in got], marker="o", color=colors[side], label=f"{label}: time")
        memory_ax.plot(x, [r["rss_delta_mib"] for r in got], marker="s", markerfacecolor="none", linestyle="--",
                       color=colors[side], label=f"{label}: RSS delta")
    for ax, title in ((full_ax, "full context"), (bounded_ax, "bounded policies vs transformers' full history")):
        ax.set(title=title, xlabel="history before the chunk (tokens)", ylabel="ms per chunk")
        ax.legend(fontsize=8)
    prefill_ax.set(title="prefill to 25 % per KV head", xlabel="prompt tokens S", ylabel="warm call (s)")
    memory_ax.set_ylabel("peak RSS - RSS after load (MiB)")
    for ax in (prefill_ax, memory_ax):
        ax.set_ylim(bottom=0)
    for ax in (full_ax, bounded_ax, prefill_ax):
        x = sorted({int(v) for line in ax.get_lines() for v in line.get_xdata()})
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [f"{v // 1024}K" if v >= 1024 else str(v) for v in x])
        ax.minorticks_off()
    (h1, l1), (h2, l2) = prefill_ax.get_legend_handles_labels(), memory_ax.get_legend_handles_labels()
    prefill_ax.legend(h1 + h2, l1 + l2, fontsize=7)
    harness.save_png(fig, out, name)
