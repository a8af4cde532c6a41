"""omnijax against Hugging Face transformers (and kvpress for prefill compression) on the same weights (a tiny seeded
Qwen2, or with `--model smollm2` the real SmolLM2-135M-Instruct): per-chunk streaming latency with the full context
and with bounded retention policies to 32K, and compressed prefill's time and peak memory, each side in its own
processes.

Set-up. A tiny Qwen2 (vocab 1024, hidden 256, intermediate 512, 4 layers, 8 query / 2 KV heads, head dim 32, RoPE
theta 1e6, float32, weight matrices drawn with std `INIT_STD` = 0.08 after `torch.manual_seed(0)`, sharper attention
than the default 0.02) is saved under `<out>/vs_transformers_ckpt_std0.08/hf` and converted into `.../omnijax`
(both reused when present). `--model smollm2`: the SmolLM2-135M-Instruct Q4_1 GGUF `make smollm2` installs
(`--gguf` another file), converted once into `<out>/vs_transformers_model/` (`omnijax/`, `hf/`, float32, by
`first_token.prepare_models` as first_token and vs_kvpress do; `--smoke`: the peers' tiny random llama GGUF of
`first_token.smoke_models`); writes `<out>/vs_transformers_smollm2.{json,png}`. Its widths (30 layers, hidden 576,
9 query / 3 KV heads of 64) make a chunk many times the tiny model's compute: on the 2-core machine (load ~5) a
`full` round to 8K took ~5 min (each worker streams 8K twice: omnijax ~140 s, transformers ~170 s), so its
`bounded` section runs at `--bounded-max 8192` (the 8K point only: to 32K, ~16x the attention of 8K for
transformers and NoSlide, a round would take over half an hour). Every measurement is a fresh worker process of this
script (`--worker KIND --side SIDE`, one JSON line on stdout): torch and JAX never share a process, the parent
imports neither. torch runs on 2 threads with `attn_implementation="sdpa"`, JAX on the CPU as it comes; both compute
the last token's logits only (transformers: `logits_to_keep=1`). Tokens are random ids (seeded, over the model's
vocabulary) in text chunks of `--chunk` tokens (chunk i is unit i). Each timed feed also records the worker
process's CPU seconds (`time.process_time`, every thread): `cpu_ms` beside `ms`, and the same-round `cpu_ratio` with
its spread, steadier than the wall when other processes share the cores. Rounds alternate the sides (even rounds run
omnijax first); tables give medians over rounds, `ratio` the median of same-round omnijax / transformers (below 1:
omnijax is faster or smaller), each omnijax row with the spread of those ratios (`ratio_min` / `ratio_max`,
`ratio_p10` / `ratio_p90`, every round's in `ratio_rounds`). The transformers / kvpress workers run with
`OMP_WAIT_POLICY=PASSIVE` by default: while another process is busy on the cores, torch's spinning OpenMP threads run
many times slower (`--omp-active` sets `OMP_WAIT_POLICY=ACTIVE` instead, to see that; `--omp-passive`, the default,
is kept for old command lines). `os.getloadavg()` at each worker's start is printed and kept in the JSON: per row and
round in `load_rounds` (1 / 5 / 15-minute averages per side), all of them in `load_averages`; the OpenMP wait policy
in `omp_wait_policy`.

Sections (histories are the tokens before the chunk; those above a section's maximum are dropped, and with none
left it measures at max / 2 and max).
    full      histories 256, 1K, 2K, 4K, 8K (`--full-max`): omnijax `Session(model, page_size=64, num_pages=<stream
              / 64 + 2>)` (NoSlide, impl "xla") against `model(chunk, past_key_values=DynamicCache())` under
              `torch.inference_mode()`; each worker streams twice and times the second pass. `logits diff`: max
              |omnijax - transformers| of the last-token logits; `|logits|`: their scale.
    bounded   histories 8K, 16K, 32K (`--bounded-max`): transformers with its whole history against omnijax NoSlide
              (pool sized to the stream), `OmniPick()` (watermarks 2500 / 1800) and `SinkWindow(sink=16,
              window=2048)`, each with a pool just big enough for its bound plus one chunk (an overflow fails the
              run). One pass per worker; each checkpoint's chunk is re-fed `--inner` times from the state before it
              (omnijax: a `Session` resumed from a copy of it; transformers: the cache cropped back) and timed as
              their median. `cells`: the KV cells the omnijax chunk attended over.
    prefill   a prompt of S tokens compressed to 25 % per KV head: kvpress `SnapKVPress(compression_ratio=0.75,
              window_size=64, kernel_size=5)` around one forward against omnijax `model.prefill(input_ids,
              selector=SnapKV(), budgets=S // 4)` (TideKV: layer-major, compressed at each layer's end). A fresh
              process per side and S (`--prefill-rounds` each) calls twice and times the second call (`cold`: the
              first, with JAX's compilation); peak RSS is `ru_maxrss` after both calls, `delta` its excess over the
              RSS right after loading the model (JAX's compiler memory included). `rss_peak_ratio` and
              `rss_delta_ratio`: same-round omnijax / kvpress of the peak and of the delta, with their spread.

Run: `python -m bench.peers.vs_transformers [--rounds 5] [--prefill-rounds 5] [--out bench/out] [--smoke]` (defaults:
`--chunk 256 --full-max 8192 --bounded-max 32768 --prefill 8192 16384 32768 --inner 3 --rounds 5 --prefill-rounds 5`,
the bench's bar for a headline figure: a median of >= 5 interleaved rounds; `--smoke`: chunk 64, full 256, bounded
512, prefill 512, one round, and each side's measurements in one worker, its checkpoint worker's, run in the script's
own process: `harness.run_worker`); writes `<out>/vs_transformers.{json,png}`. On the real model:
`python -m bench.peers.vs_transformers --model smollm2 --sections full bounded --bounded-max 8192 --rounds 5`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

from bench import harness
from bench.peers._vs_transformers_rows import (
    POLICY_SPECS,
    SIDES,
    agreement,
    plot,
    print_tables,
    rounds_figures,
    stream_rows,
)
from bench.peers._vs_transformers_stream import (
    PAGE_SIZE,
    TORCH_THREADS,
    load_omnijax,
    load_transformers,
    omnijax_stream,
    transformers_stream,
)

HF_CONFIG = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                 tie_word_embeddings=False, max_position_embeddings=65536)
INIT_STD = 0.08  # std of every weight matrix (norm weights stay 1)
CKPT_DIR = f"vs_transformers_ckpt_std{INIT_STD}"  # a changed init builds a new checkpoint
SECTIONS = ("full", "bounded", "prefill")
FULL_HISTORIES = (256, 1024, 2048, 4096, 8192)
BOUNDED_HISTORIES = (8192, 16384, 32768)
SNAPKV = dict(compression_ratio=0.75, window_size=64, kernel_size=5)
MODELS = ("tiny", "smollm2")  # --model: the seeded tiny Qwen2 (the default), or SmolLM2-135M-Instruct from its GGUF
SMOLLM2_DIR = "vs_transformers_model"  # under --out: the GGUF's omnijax/ and hf/ conversions
VERSIONS: dict[str, str] = {}  # package versions the workers ran with
LOADS: list[list[float]] = []  # the 1 / 5 / 15-minute load averages as each worker started
PREFETCHED: dict[str, dict] = {}  # --smoke: side -> kind ("prefill <S>" for a prefill) -> its `every` worker's result


def checkpoints(defaults, longest: int, chunk: int) -> list[int]:
    """The histories (tokens before a chunk) measured: the `defaults` up to `longest`, else `longest / 2, longest`,
    rounded down to whole chunks."""
    kept = [h for h in defaults if h <= longest] or [longest // 2, longest]
    return sorted({h - h % chunk for h in kept})


def stream_ids(tokens: int, seed: int, ckpt: Path) -> np.ndarray:
    """The random token ids both sides stream (the same numpy draw in every worker), over the vocabulary of the
    checkpoint's transformers config."""
    return np.random.default_rng(seed).integers(0, hf_config(ckpt)["vocab_size"], tokens)


def hf_config(ckpt: Path) -> dict:
    """The transformers checkpoint's `config.json` (`ckpt/hf/`)."""
    return json.loads((ckpt / "hf" / "config.json").read_text())


# ------------------------------------------------------------------------------------------------ worker side
def build_checkpoint(args, side: str, ckpt: Path) -> dict:
    """transformers: saves the seeded Qwen2 under `ckpt/hf`; omnijax: converts that into `ckpt/omnijax`."""
    if side == "omnijax":
        from omnijax.convert import convert_checkpoint

        return {"converted": str(convert_checkpoint(ckpt / "hf", ckpt / "omnijax", progress=False, force=True))}
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**HF_CONFIG)).to(torch.float32).eval()
    with torch.no_grad():  # wider than the default init (0.02): sharper attention, so a masking mistake would show
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0.0, INIT_STD)
    model.save_pretrained(ckpt / "hf", safe_serialization=True)
    return {"saved": str(ckpt / "hf")}


def full_worker(args, side: str, ckpt: Path) -> dict:
    """Full context: two passes of the stream, the second one's checkpoints."""
    histories = checkpoints(FULL_HISTORIES, args.full_max, args.chunk)
    ids = stream_ids(histories[-1] + args.chunk, args.seed, ckpt)
    if side == "omnijax":
        model, chunks = load_omnijax(ckpt / "omnijax", ids, args.chunk)
        pages = len(ids) // PAGE_SIZE + 2
        passes = [omnijax_stream(model, chunks, histories, args.chunk, num_pages=pages) for _ in range(2)]
    else:
        torch, cache_cls, model = load_transformers(ckpt / "hf")
        passes = [transformers_stream(torch, cache_cls(), model, ids, histories, args.chunk) for _ in range(2)]
    return {"histories": histories, **passes[-1], "first_pass_ms": passes[0]["ms"]}


def bounded_worker(args, side: str, ckpt: Path) -> dict:
    """Bounded: one pass per omnijax policy (transformers: its full history), checkpoints re-fed `--inner` times."""
    histories = checkpoints(BOUNDED_HISTORIES, args.bounded_max, args.chunk)
    ids = stream_ids(histories[-1] + args.chunk, args.seed, ckpt)
    if side == "transformers":
        torch, cache_cls, model = load_transformers(ckpt / "hf")
        return {"histories": histories, **transformers_stream(torch, cache_cls(), model, ids, histories, args.chunk,
                                                              inner=args.inner)}
    from omnijax.retention import get_policy

    model, chunks = load_omnijax(ckpt / "omnijax", ids, args.chunk)
    stream_pages = -(-len(ids) // PAGE_SIZE)
    policies = {}
    for name, spec in POLICY_SPECS.items():
        policy = get_policy(spec)
        bound = getattr(policy, "high_watermark", None) or getattr(policy, "budget", None)  # most cells kept
        pages = stream_pages if bound is None else min(stream_pages, -(-(bound + args.chunk) // PAGE_SIZE))
        got = omnijax_stream(model, chunks, histories, args.chunk, inner=args.inner, policy=policy, num_pages=pages)
        policies[name] = {"policy": repr(policy), "pool_pages": pages, **got}
    return {"histories": histories, "policies": policies}


def prefill_worker(args, side: str, ckpt: Path) -> dict:
    """Prefill of `--length` tokens compressed to 25 % per KV head, called twice: times, peak RSS, logits."""
    S = args.length
    ids = stream_ids(S, args.seed + 1, ckpt)[None]
    if side == "omnijax":
        import jax

        from omnijax.prefill import SnapKV

        model, _ = load_omnijax(ckpt / "omnijax")
        per_head = model.config.num_layers * model.config.num_kv_heads

        def call():
            result = model.prefill(ids, selector=SnapKV(window=SNAPKV["window_size"],
                                                        pool_kernel=SNAPKV["kernel_size"]), budgets=S // 4)
            jax.block_until_ready((result.logits, result.cache))
            return np.asarray(result.logits[0]), int(result.cache.cells()[0]) / per_head
    else:
        from kvpress import SnapKVPress

        torch, cache_cls, model = load_transformers(ckpt / "hf")
        press, input_ids = SnapKVPress(**SNAPKV), torch.as_tensor(ids)

        def call():
            cache = cache_cls()
            with torch.inference_mode(), press(model):
                logits = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            kept = sum(layer.keys.shape[2] for layer in cache.layers) / len(cache.layers)
            return logits[0, -1].numpy(), kept
    peak_rss_kib = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # noqa: E731
    rss_kib = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                   if line.startswith("VmRSS:"))
    got = {"length": S, "rss_loaded_kib": rss_kib, "maxrss_loaded_kib": peak_rss_kib()}
    for call_name in ("cold", "warm"):  # the warm call's figures are the plain keys
        start = time.perf_counter()
        logits, kept = call()
        got["ms" if call_name == "warm" else "cold_ms"] = 1e3 * (time.perf_counter() - start)
        got["rss_peak_kib" if call_name == "warm" else "rss_peak_cold_kib"] = peak_rss_kib()
    got["rss_delta_kib"] = got["rss_peak_kib"] - got["rss_loaded_kib"]
    return {**got, "kept_per_head": kept, "logits": logits.tolist()}


def every_worker(args, side: str, ckpt: Path) -> dict:
    """`--smoke`: every measurement of one side in this one process (`--build`: its checkpoint first), each once:
    `{kind: result}`, the prefill results under `prefill <S>`."""
    result = {"checkpoint": build_checkpoint(args, side, ckpt)} if args.build else {}
    for kind in args.sections:
        if kind != "prefill":
            result[kind] = {"full": full_worker, "bounded": bounded_worker}[kind](args, side, ckpt)
            continue
        for S in args.prefill:
            args.length = S
            result[f"prefill {S}"] = prefill_worker(args, side, ckpt)
    return result


def worker(args) -> None:
    """Runs one measurement (`every`: all of a side's) and prints its result as one JSON line."""
    ckpt = Path(args.models)
    run = {"checkpoint": build_checkpoint, "full": full_worker, "bounded": bounded_worker, "prefill": prefill_worker,
           "every": every_worker}
    result = run[args.worker](args, args.side, ckpt)
    packages = ("jax", "torch", "transformers", "kvpress")
    result["versions"] = {name: importlib.metadata.version(name) for name in packages if name in sys.modules}
    print(json.dumps(result), flush=True)


# ------------------------------------------------------------------------------------------------ parent side
def run_worker(args, kind: str, side: str, length: int = 0, note: str = "", extra=()) -> dict:
    """Runs `kind` for `side` in a fresh process of this script and returns its JSON result (`--smoke`: the result
    the side's one `every` worker left, if it has one)."""
    key = f"{kind} {length}" if length else kind
    if key in PREFETCHED.get(side, {}):
        return PREFETCHED[side].pop(key)  # its "load": its `every` worker's
    cmd = harness.module_command(__spec__.name, "--worker", kind, "--side", side, "--out", Path(args.out).resolve(),
                                 "--models", Path(args.models).resolve(),
                                 "--chunk", args.chunk, "--full-max", args.full_max, "--bounded-max", args.bounded_max,
                                 "--inner", args.inner, "--seed", args.seed, "--length", length, *extra)
    env = dict(os.environ, **({"OMP_WAIT_POLICY": omp_wait_policy(args)} if side == "transformers" else {}))
    load = [round(v, 2) for v in os.getloadavg()]  # other processes competing for the cores show here
    LOADS.append(load)
    start = time.perf_counter()
    # --smoke (a check that measures nothing): the worker runs in this process, its command line and JSON as ever
    done = harness.run_worker(cmd, inline=args.smoke, env=env)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        raise RuntimeError(f"worker {kind} {side} failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                           f"{done.stderr[-6000:]}")
    print(f"  {kind} {side}{f' S={length}' if length else ''}{note}: {time.perf_counter() - start:.1f} s "
          f"(load average {load[0]:.2f} before)", flush=True)
    result = json.loads(lines[-1])
    VERSIONS.update(result.pop("versions"))
    result["load"] = load
    if kind == "every":  # --smoke: its measurements' rows show the load it started at
        for got in result.values():
            if isinstance(got, dict):
                got["load"] = load
    return result


def machine() -> dict:
    """The CPU the figures were taken on: its model name (`/proc/cpuinfo`) and the cores this process may use."""
    info = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (info.read_text().splitlines() if info.exists() else [])
             if line.startswith("model name")]
    return {"cpu": names[0] if names else None, "cores": len(os.sched_getaffinity(0))}


def omp_wait_policy(args) -> str:
    """`OMP_WAIT_POLICY` for the transformers / kvpress workers: PASSIVE unless `--omp-active`."""
    return "ACTIVE" if args.omp_active else "PASSIVE"


def ensure_checkpoint(args) -> dict:
    """Builds the transformers checkpoint and its omnijax conversion unless both are there already (`--model
    smollm2`: converts the GGUF, `first_token.prepare_models`) and sets `args.models` to their folder; with
    `--smoke`, one `every` worker per side (transformers first) then also runs all of that side's measurements
    (`PREFETCHED`). Returns what the JSON says of the model."""
    if args.model == "smollm2":
        from bench.peers.first_token import prepare_models, smoke_models

        if args.smoke and not args.gguf:
            gguf_path, ckpt = smoke_models(Path(args.out))
        else:
            from omnijax.demo.smollm2 import find_gguf

            gguf_path, ckpt = find_gguf(args.gguf), Path(args.out) / SMOLLM2_DIR
            prepare_models(gguf_path, ckpt)
        build = {side: False for side in SIDES}
        model = {"gguf": str(gguf_path), "hf_config": hf_config(ckpt)}
    else:
        ckpt = Path(args.out) / CKPT_DIR
        built = not (ckpt / "hf" / "model.safetensors").exists()
        build = {"transformers": built, "omnijax": built or not (ckpt / "omnijax" / "omnijax.json").exists()}
        model = {"tiny": HF_CONFIG}
    args.models = str(ckpt)
    model["checkpoint"] = str(ckpt)
    if args.smoke:
        for side in SIDES[::-1]:
            extra = ["--sections", *args.sections, "--prefill", *args.prefill] + (["--build"] if build[side] else [])
            PREFETCHED[side] = run_worker(args, "every", side, note=" (every measurement, --smoke)", extra=extra)
        return model
    if build["transformers"]:
        run_worker(args, "checkpoint", "transformers")
    if build["omnijax"]:
        run_worker(args, "checkpoint", "omnijax")
    return model


def alternating_rounds(args, kind: str) -> list[dict]:
    """`args.rounds` rounds of both sides, the order reversed every other round: `[{side: result}]`."""
    return [{side: run_worker(args, kind, side, note=f" (round {r + 1}/{args.rounds})")
             for side in (SIDES if r % 2 == 0 else SIDES[::-1])} for r in range(args.rounds)]


def prefill_rows(args) -> list[dict]:
    """Runs the prefill workers (the side order alternating over lengths and rounds) and returns their JSON rows."""
    rows = []
    for i, S in enumerate(args.prefill):
        runs = []
        for r in range(args.prefill_rounds):
            order = SIDES if (i + r) % 2 == 0 else SIDES[::-1]
            runs.append({side: run_worker(args, "prefill", side, S) for side in order})
        for side in SIDES:
            got = [run[side] for run in runs]
            ms = [g["ms"] for g in got]
            row = {"section": "prefill", "length": S, "side": side,
                   "policy": "snapkv (kvpress)" if side == "transformers" else "snapkv (TideKV)", **harness.stats(ms),
                   "ms_rounds": ms, "cold_ms": float(np.median([g["cold_ms"] for g in got])),
                   "kept_per_head": got[0]["kept_per_head"]}
            for key in ("rss_loaded_kib", "rss_peak_cold_kib", "rss_peak_kib", "rss_delta_kib"):
                row[key.replace("_kib", "_mib")] = float(np.median([g[key] for g in got])) / 1024
            if side == "omnijax":
                peer = [run["transformers"] for run in runs]
                row.update(rounds_figures(ms, [p["ms"] for p in peer], runs))
                for key in ("rss_peak", "rss_delta"):
                    row.update(rounds_figures([g[f"{key}_kib"] for g in got], [p[f"{key}_kib"] for p in peer], runs,
                                              prefix=f"{key}_"))
                row.update(agreement([g["logits"] for g in got], [p["logits"] for p in peer]))
            rows.append(row)
    return rows


def main(argv=None):
    """Runs every section (parent), or one measurement with `--worker`."""
    parser = harness.parser(__doc__)
    parser.add_argument("--chunk", type=int, default=256, help="tokens per streamed chunk")
    parser.add_argument("--full-max", type=int, default=8192, help="longest history of the full-context section")
    parser.add_argument("--bounded-max", type=int, default=32768, help="longest history of the bounded section")
    parser.add_argument("--prefill", type=int, nargs="+", default=[8192, 16384, 32768], help="prompt lengths")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="what to run")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the streaming sections")
    parser.add_argument("--prefill-rounds", type=int, default=5, help="fresh processes per side and prompt length")
    parser.add_argument("--inner", type=int, default=3, help="re-feeds of each bounded checkpoint chunk")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    parser.add_argument("--model", choices=MODELS, default="tiny",
                        help="tiny: the seeded tiny Qwen2 (the default); smollm2: SmolLM2-135M-Instruct from its GGUF")
    parser.add_argument("--gguf", help="--model smollm2: the GGUF file (default: the installed Q4_1)")
    omp = parser.add_mutually_exclusive_group()
    omp.add_argument("--omp-active", action="store_true",
                     help="OMP_WAIT_POLICY=ACTIVE for the transformers / kvpress workers instead of the default "
                          "PASSIVE: torch's spinning OpenMP threads run many times slower while another process "
                          "competes for the cores")
    omp.add_argument("--omp-passive", action="store_true",
                     help="OMP_WAIT_POLICY=PASSIVE for the transformers / kvpress workers (the default; kept for "
                          "old command lines)")
    parser.add_argument("--worker", choices=["checkpoint", "full", "bounded", "prefill", "every"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--build", action="store_true", help=argparse.SUPPRESS)  # `every`: build the checkpoint
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--models", help=argparse.SUPPRESS)  # a worker's checkpoint folder (omnijax/, hf/)
    parser.add_argument("--length", type=int, default=0, help=argparse.SUPPRESS)
    args = harness.parse(parser, argv, smoke=dict(chunk=64, full_max=256, bounded_max=512, prefill=[512], rounds=1,
                                                  prefill_rounds=1, inner=1))
    if args.gguf and args.model != "smollm2":
        parser.error("--gguf goes with --model smollm2")
    if args.worker:
        return worker(args)
    out = harness.output_dir(args)
    start = time.perf_counter()
    print("checkpoint", flush=True)
    model = ensure_checkpoint(args)
    rows = []
    if "full" in args.sections:
        print(f"full context to {args.full_max} ({args.rounds} rounds)", flush=True)
        rows += stream_rows("full", alternating_rounds(args, "full"), "no_slide")
    if "bounded" in args.sections:
        print(f"bounded policies to {args.bounded_max} ({args.rounds} rounds)", flush=True)
        rows += stream_rows("bounded", alternating_rounds(args, "bounded"), None)
    if "prefill" in args.sections:
        print(f"prefill at {args.prefill}", flush=True)
        rows += prefill_rows(args)
    print_tables(rows)
    runtime = time.perf_counter() - start
    print(f"total runtime {runtime:.0f} s")
    settings = {k: v for k, v in vars(args).items() if k not in ("worker", "side", "length", "build", "models")}
    name = "vs_transformers" if args.model == "tiny" else f"vs_transformers_{args.model}"
    harness.write_json(out, name, {
        "model": model, "checkpoint": model["checkpoint"], "page_size": PAGE_SIZE, "torch_threads": TORCH_THREADS,
        "policies": POLICY_SPECS, "kvpress": SNAPKV, "versions": VERSIONS, "load_averages": LOADS,
        "omp_wait_policy": omp_wait_policy(args), "machine": machine(),
        "settings": settings, "runtime_s": runtime, "rows": rows})
    plot(rows, out, name)


if __name__ == "__main__":
    main()
