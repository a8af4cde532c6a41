"""TideKV prefill against kvpress on the real model: time and memory of compressing a prompt's KV cache to half.

Both sides compress a prompt of S seeded random token ids on SmolLM2-135M-Instruct (float32, the GGUF `make smollm2`
installs, converted once for each side by `bench.peers.first_token.prepare_models`) to half its tokens per KV head:
    kvpress   `SnapKVPress(compression_ratio=0.5, window_size=64, kernel_size=5)` around one transformers forward
              (sdpa, `logits_to_keep=1`, torch on 2 threads, `OMP_WAIT_POLICY=PASSIVE`);
    omnijax   `model.prefill(ids, selector=SnapKV(window=64, pool_kernel=5), budgets=S // 2)` (TideKV: layer-major,
              each layer compressed at its end).
Each measurement is a fresh process of one side (torch and JAX never share one); the sides' order rotates from
round to round. A process loads the model, calls the prefill once (cold: JAX compiles, torch warms up), then
`--calls` more times (warm); it reports the warm calls' median wall time and CPU seconds (`getrusage`, both
threads), its resident memory after loading, its peak (`ru_maxrss`, the cold call included), and the warm calls'
own peak growth: freed heap is handed back (`malloc_trim`) and the kernel's peak RSS mark reset
(`/proc/self/clear_refs`) before each warm call, and the mark is read after it, minus the RSS before it (what the
prefill itself holds at its peak, its output cache included, compiler memory excluded); `transient`: that growth
minus the kept keys' and values' bytes (the same on both sides). Both sides' kept cells per KV
head and the last token's top-5 are printed (they pick the same tokens: same weights, same selector).
`ratio` columns: the median over rounds of same-round omnijax / kvpress (below 1: omnijax faster or smaller).

    python -m bench.tidekv.vs_kvpress --lengths 4096 8192 16384 --rounds 3

`--base DIR`: a third side, `omnijax_base`, the same omnijax worker run with `DIR` as its working directory, so
it imports `DIR/omnijax` (an older version, e.g. `git archive <commit> omnijax | tar -x -C DIR`; no `bench/` there:
this repository's comes through `PYTHONPATH`), interleaved with the other two: before / after figures of a change.

`--smoke`: the tiny random llama GGUF of `bench.peers.first_token.smoke_models`, S = 256, one round, one warm call
(a check that the script runs, not a measurement: each worker runs in the script's own process). `--models DIR`: a
folder holding `omnijax/` and `hf/` checkpoints already converted (each with a `.complete` marker) instead of
converting.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import time
from pathlib import Path

import numpy as np

from bench import harness

SIDES = ("omnijax", "kvpress")
BASE = "omnijax_base"
WINDOW, KERNEL = 64, 5
TORCH_THREADS = 2


def _rss_kib(key: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _prefill_call(side: str, models: Path, ratio: float):
    """Loads `side`'s model; returns `call(ids) -> (top-5 ids of the last logits, kept cells per KV head, MiB of
    the kept keys and values)`."""
    if side != "kvpress":
        import jax

        import omnijax
        from omnijax.prefill import SnapKV

        model = omnijax.load(models / "omnijax")
        per_head = model.config.num_layers * model.config.num_kv_heads

        def call(ids):
            S = ids.shape[1]
            r = model.prefill(ids, selector=SnapKV(window=WINDOW, pool_kernel=KERNEL), budgets=int(S * (1 - ratio)))
            jax.block_until_ready((r.logits, r.cache))
            kv_mib = sum(layer.k.nbytes + layer.v.nbytes for layer in r.cache.layers) / 2**20
            return np.argsort(-np.asarray(r.logits[0]))[:5], int(r.cache.cells()[0]) / per_head, kv_mib
        return call
    import torch
    import transformers
    from kvpress import SnapKVPress

    torch.set_num_threads(TORCH_THREADS)
    model = transformers.AutoModelForCausalLM.from_pretrained(models / "hf", dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    press = SnapKVPress(compression_ratio=ratio, window_size=WINDOW, kernel_size=KERNEL)

    def call(ids):
        cache = transformers.DynamicCache()
        with torch.inference_mode(), press(model):
            logits = model(input_ids=torch.as_tensor(ids), past_key_values=cache, use_cache=True,
                           logits_to_keep=1).logits
        kept = sum(layer.keys.shape[2] for layer in cache.layers) / len(cache.layers)
        kv_mib = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers) / 2**20
        return np.argsort(-logits[0, -1].numpy())[:5], kept, kv_mib
    return call


def worker(side: str, models: Path, S: int, ratio: float, calls: int, seed: int) -> dict:
    """One process of one side: load, a cold call, `calls` warm calls; times and memory (module docstring)."""
    import ctypes

    cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])  # noqa: E731  user + system seconds
    trim = ctypes.CDLL("libc.so.6").malloc_trim  # hand freed heap back first: the growth is then the call's own
    call = _prefill_call(side, models, ratio)
    vocab = json.loads((models / "hf" / "config.json").read_text())["vocab_size"]
    ids = np.random.default_rng(seed).integers(0, vocab, (1, S))
    got = {"side": side, "length": S, "rss_loaded_mib": _rss_kib() / 1024}
    start = time.perf_counter()
    top5, kept, kv_mib = call(ids)
    got["cold_s"] = time.perf_counter() - start
    wall, cpus, growth = [], [], []
    for _ in range(calls):
        trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS mark (VmHWM) to the current RSS
        before, c0, start = _rss_kib(), cpu(), time.perf_counter()
        top5, kept, kv_mib = call(ids)
        wall.append(time.perf_counter() - start)
        cpus.append(cpu() - c0)
        growth.append((_rss_kib("VmHWM") - before) / 1024)
    return {**got, "wall_s": float(np.median(wall)), "cpu_s": float(np.median(cpus)),
            "call_growth_mib": float(np.median(growth)), "cache_kv_mib": kv_mib,
            "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "kept_per_head": kept, "top5": [int(t) for t in top5]}


def run_one(side: str, args, models: Path, S: int) -> dict:
    """`side`'s worker in a fresh process (torch with passive OpenMP waiting; `omnijax_base` in `--base`)."""
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    cwd = harness.ROOT
    if side == BASE:
        env, cwd = harness.checkout_env(env), Path(args.base).resolve()
    load = os.getloadavg()[0]
    command = harness.module_command(__spec__.name, "--worker", side, "--models", Path(models).resolve(), "--length",
                                     S, "--ratio", args.ratio, "--calls", args.calls, "--seed", args.seed)
    if args.smoke and side != BASE:  # a check that measures nothing: the worker runs in this process
        done = harness.run_worker(command, inline=True)
    else:
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{side} S={S} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "load_avg": load}


def checkpoints(args, out: Path) -> Path:
    """The models folder (`omnijax/`, `hf/`) the TideKV scripts read: `--models`, `--smoke`'s tiny GGUF (without
    `--gguf`), or the GGUF converted once into `<out>/vs_kvpress_model/`."""
    from bench.peers.first_token import prepare_models, smoke_models

    if args.models:
        return Path(args.models)
    if args.smoke and not args.gguf:
        return smoke_models(out)[1]
    from omnijax.demo.smollm2 import find_gguf

    models = out / "vs_kvpress_model"
    prepare_models(find_gguf(args.gguf), models)
    return models


def main(argv=None) -> int:
    p = harness.parser(__doc__)
    p.add_argument("--gguf", help="the GGUF file (default: the installed SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--models", help="a folder with already converted omnijax/ and hf/ checkpoints")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384], help="prompt lengths S")
    p.add_argument("--rounds", type=int, default=3, help="processes per side and length (alternating order)")
    p.add_argument("--calls", type=int, default=2, help="warm calls per process (their median is its figure)")
    p.add_argument("--ratio", type=float, default=0.5, help="the share of each KV head's tokens dropped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base", help="a folder holding an older omnijax/ to run as a third side, omnijax_base")
    p.add_argument("--worker", choices=SIDES + (BASE,), help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = harness.parse(p, argv, smoke={"lengths": [256], "rounds": 1, "calls": 1})
    if not 0 < args.ratio < 1:
        p.error(f"--ratio must lie strictly between 0 and 1, got {args.ratio}")
    if args.rounds < 1 or args.calls < 1:
        p.error(f"--rounds and --calls must be at least 1, got {args.rounds} and {args.calls}")
    if args.worker:
        print(json.dumps(worker(args.worker, Path(args.models), args.length, args.ratio, args.calls, args.seed)))
        return 0
    out = harness.output_dir(args)
    models = checkpoints(args, out)
    if args.base and not (Path(args.base) / "omnijax" / "__init__.py").exists():
        p.error(f"--base {args.base} holds no omnijax/ package")
    sides = SIDES + ((BASE,) if args.base else ())
    rows = []
    for S in args.lengths:
        for r in range(args.rounds):
            for side in sides[r % len(sides):] + sides[:r % len(sides)]:  # the order rotates round by round
                row = dict(run_one(side, args, models, S), round=r)
                rows.append(row)
                print(f"  S={S} round {r + 1}/{args.rounds} {side:8s} warm {row['wall_s']:.2f} s (cpu "
                      f"{row['cpu_s']:.1f} s, cold {row['cold_s']:.1f} s), call growth {row['call_growth_mib']:.0f}"
                      f" MiB, peak {row['peak_mib']:.0f} MiB, kept {row['kept_per_head']:.0f}/head, top5 "
                      f"{row['top5']}, load {row['load_avg']:.1f}", flush=True)
    for row in rows:  # what the call held beyond the cache it returns (the same bytes on both sides)
        row["transient_mib"] = row["call_growth_mib"] - row["cache_kv_mib"]
    table = []
    for S in args.lengths:
        of = {side: [x for x in rows if x["length"] == S and x["side"] == side] for side in sides}
        med = lambda side, key: float(np.median([x[key] for x in of[side]]))  # noqa: E731
        ratio = lambda key: harness.same_round_ratio([x[key] for x in of["omnijax"]],  # noqa: E731
                                                     [x[key] for x in of["kvpress"]])
        base = {} if not args.base else {
            "base_wall_ratio": harness.same_round_ratio([x["wall_s"] for x in of[BASE]],
                                                        [x["wall_s"] for x in of["kvpress"]]),
            "base_cpu_ratio": harness.same_round_ratio([x["cpu_s"] for x in of[BASE]],
                                                       [x["cpu_s"] for x in of["kvpress"]]),
            "base_growth_ratio": harness.same_round_ratio([x["call_growth_mib"] for x in of[BASE]],
                                                          [x["call_growth_mib"] for x in of["kvpress"]])}
        table.append({"length": S, **base, **{f"{s}_{k}": med(s, k) for s in sides for k in
                                      ("wall_s", "cpu_s", "call_growth_mib", "transient_mib", "peak_mib",
                                       "rss_loaded_mib")},
                      "wall_ratio": ratio("wall_s"), "cpu_ratio": ratio("cpu_s"),
                      "growth_ratio": ratio("call_growth_mib"), "transient_ratio": ratio("transient_mib"),
                      "wall_spread_s": {s: [min(x["wall_s"] for x in of[s]), max(x["wall_s"] for x in of[s])]
                                        for s in sides},
                      "same_top1": all(a["top5"][0] == b["top5"][0] for a, b in zip(of["omnijax"], of["kvpress"])),
                      "load_avg": [min(x["load_avg"] for x in rows if x["length"] == S),
                                   max(x["load_avg"] for x in rows if x["length"] == S)]})
    harness.print_table(table, [
        ("S", "length", "d"), ("kvpress s", "kvpress_wall_s", ".2f"), ("TideKV s", "omnijax_wall_s", ".2f"),
        ("time ratio", "wall_ratio", ".2f"), ("cpu ratio", "cpu_ratio", ".2f"),
        ("kvpress growth MiB", "kvpress_call_growth_mib", ".0f"),
        ("TideKV growth MiB", "omnijax_call_growth_mib", ".0f"),
        ("growth ratio", "growth_ratio", ".2f"), ("kvpress transient", "kvpress_transient_mib", ".0f"),
        ("TideKV transient", "omnijax_transient_mib", ".0f"), ("transient ratio", "transient_ratio", ".2f"),
        ("kvpress peak", "kvpress_peak_mib", ".0f"),
        ("TideKV peak", "omnijax_peak_mib", ".0f"), ("same top-1", "same_top1", "")]
        + ([("base time ratio", "base_wall_ratio", ".2f"), ("base cpu ratio", "base_cpu_ratio", ".2f"),
            ("base growth ratio", "base_growth_ratio", ".2f")] if args.base else []))
    harness.write_json(out, "vs_kvpress", {"smoke": bool(args.smoke), "rounds": args.rounds, "calls": args.calls,
                                           "base": args.base,
                                           "ratio": args.ratio, "rows": rows, "table": table})
    plot(table, out)
    return 0


def plot(table: list[dict], out: Path) -> None:
    """`vs_kvpress.png`: TideKV / kvpress time (wall and CPU) and memory growth of the call per prompt length, with
    the issue's targets (time <= 1, growth <= 0.5) drawn."""
    plt = harness.pyplot()
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(9, 3.5))
    x = [r["length"] for r in table]
    ax_time.plot(x, [r["wall_ratio"] for r in table], marker="o", label="wall")
    ax_time.plot(x, [r["cpu_ratio"] for r in table], marker="s", label="CPU")
    ax_time.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="target <= 1")
    ax_time.set_title("TideKV / kvpress SnapKV: time of the call", fontsize=9)
    ax_mem.plot(x, [r["growth_ratio"] for r in table], marker="o", label="call growth")
    ax_mem.plot(x, [r["transient_ratio"] for r in table], marker="s", label="growth without the kept K/V")
    ax_mem.axhline(0.5, color="gray", linestyle="--", linewidth=1, label="target <= 0.5")
    ax_mem.set_title("TideKV / kvpress SnapKV: memory growth", fontsize=9)
    for ax in (ax_time, ax_mem):
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(s) for s in x])
        ax.minorticks_off()
        ax.set_xlabel("prompt tokens S")
        ax.set_ylabel("ratio")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    harness.save_png(fig, out, "vs_kvpress")


if __name__ == "__main__":
    raise SystemExit(main())
