"""What question-time recall (issue 40) costs per question against the device memory it saves: measured on this
CPU for the model loaded, and projected for Qwen2.5-Omni-7B and Qwen3-Omni-30B-A3B from omnijax's model presets.

Measured (the model's own cache shapes, random keys and values: timing does not depend on them):

- scoring: the stored units ranked against a question of `--question-tokens` tokens by each `Recall(scoring=...)`
  ("mass", the default, reads every stored key and turns it back before RoPE; "max" reads every stored key; "mean"
  reads one summary key per layer and kv head per unit; "two_stage" scores the summaries, then "mass" on the
  `--shortlist` best units), for host tiers of `--stored` tokens in units of `--unit`
  tokens (`omnijax.kv.host_tier`);
- transfer: `omnijax.retention.recall.recall_into` of `--recalled` cells (host arrays to the cache, keys re-rotated
  to their new positions, appended as pages) into a cache holding `--cached` tokens. On a CPU the "device" is host
  memory, so this is a copy plus the re-rotation; on a GPU it is a host-to-device copy (projected below).

Timed with `bench.harness.interleaved` (warm: each case runs once untimed, so compiles are outside), medians of
`--rounds` rounds.

Projected (per model preset: layers L, kv heads G, head dim d, query heads Hq; the cache in bf16):

- bytes per cached token `2 * L * G * d * 2`; per text unit (`--unit` tokens) and per audiovisual unit
  (`--av-unit-tokens`: by default a 2 s Qwen-Omni chunk at 2 fps, 448x448 frames: 2 video grids of 16 x 16 merged
  patches = 512 tokens, plus 2 s of audio at 25 tokens/s = 50);
- PCIe time to recall one unit and a whole recall budget (`--recall-budgets`) at `--pcie` effective bandwidths
  (GB/s; by default 25 for gen4 x16 and 50 for gen5 x16, about 80 % of their 32 / 64 GB/s per direction);
- device bytes a session of `--hours` of audiovisual stream saves at `--device-budgets` cells against the full
  context, and the host bytes its tier holds;
- the scoring cost of a question against that tier: "mass"/"max" do `2 * L * Hq * d` flops per stored token and
  question token (T = `--question-tokens`), "mean" `2 * L * Hq * d` per stored unit; seconds at the GFLOP/s this
  CPU's "mass" scorer reached above.

Prints the tables, writes `recall_cost.json` and `recall_cost.png` under `--out`.

    .venv/bin/python -m bench.quality.recall_cost --out bench/quality/results
    .venv/bin/python -m bench.quality.recall_cost --smoke   # the tiny random Llama, seconds
"""

from __future__ import annotations

import os
import sys

import numpy as np

from bench import harness
from bench.quality import _common as common

SMOKE = dict(stored=[256, 512], recalled=[64, 128], cached=128, rounds=2)
PROJECTED = ("qwen2_5_omni_7b", "qwen3_omni_30b_a3b")


def build_parser():
    p = harness.parser(__doc__)
    common.add_model_args(p)
    p.add_argument("--stored", type=int, nargs="+", default=[1024, 4096, 16384], help="host tier sizes, tokens")
    p.add_argument("--unit", type=int, default=128, help="tokens per stored (text) unit")
    p.add_argument("--shortlist", type=int, default=8, help="units \"two_stage\" ranks by mass")
    p.add_argument("--scorings", nargs="+", default=["mass", "max", "mean", "two_stage"],
                   choices=["mass", "max", "mean", "two_stage"], help="scorings timed")
    p.add_argument("--question-tokens", type=int, default=24, help="tokens of the question")
    p.add_argument("--recalled", type=int, nargs="+", default=[128, 512, 2048], help="cells recalled")
    p.add_argument("--cached", type=int, default=256, help="tokens cached when the question comes")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--av-unit-tokens", type=int, default=562, help="tokens of one audiovisual unit (projection)")
    p.add_argument("--pcie", type=float, nargs="+", default=[25.0, 50.0], help="effective PCIe GB/s (projection)")
    p.add_argument("--recall-budgets", type=int, nargs="+", default=[2048, 8192], help="cells (projection)")
    p.add_argument("--device-budgets", type=int, nargs="+", default=[16384, 65536], help="cells (projection)")
    p.add_argument("--hours", type=float, default=1.0, help="audiovisual stream length (projection)")
    p.add_argument("--seed", type=int, default=0)
    return p


def random_tier(config, stored: int, unit: int, rng):
    """A host tier of `stored` tokens in units of `unit` tokens with random keys and values of `config`'s shapes."""
    from omnijax.kv.host_tier import HostTier, make_unit

    L, G, d, A = config.num_layers, config.num_kv_heads, config.head_dim, config.position_axes
    units, at = [], 0
    while at < stored:
        n = min(unit, stored - at)
        k = rng.standard_normal((L, G, n, d), np.float32)
        pos = np.broadcast_to(np.arange(at, at + n, dtype=np.int32), (A, n))
        units.append(make_unit(len(units), k, k[::-1].copy(), pos, np.zeros(n, np.int8), np.arange(n),
                               np.arange(at, at + n)))
        at += n
    tier, _ = HostTier(budget_bytes=1 << 40).add(*units)
    return tier


def rope_of(config) -> tuple:
    return config.rope_base, config.mrope_section, config.mrope_interleaved


def measure_scoring(config, args, rng) -> list[dict]:
    """Milliseconds per question of each scoring against host tiers of each `--stored` size."""
    from omnijax.kv import host_tier_scoring
    from omnijax.kv.host_tier_two_stage import score_units_two_stage

    rows = []
    L, Hq, d, T = config.num_layers, config.num_heads, config.head_dim, args.question_tokens
    queries = rng.standard_normal((L, T, Hq, d), np.float32)
    rope = rope_of(config)
    for stored in args.stored:
        tier = random_tier(config, stored, args.unit, rng)
        cases = {"mass": lambda t=tier: host_tier_scoring.score_units_mass(t, queries, rope),
                 "max": lambda t=tier: host_tier_scoring.score_units(t, queries.mean(axis=1), "max"),
                 "mean": lambda t=tier: host_tier_scoring.score_units(t, queries.mean(axis=1), "mean"),
                 "two_stage": lambda t=tier: score_units_two_stage(t, queries, queries.mean(axis=1), rope,
                                                                   args.shortlist)}
        cases = {name: run for name, run in cases.items() if name in args.scorings}
        ms = harness.interleaved(cases, args.rounds)
        listed = sum(u.size for u in tier.units[:args.shortlist])  # tokens the shortlist reads (equal-size units)
        for name, col in ms.items():
            flops = 2 * L * Hq * d * {"mass": stored * T, "max": stored, "mean": len(tier.units),
                                      "two_stage": len(tier.units) + listed * T}[name]
            med = float(np.median(col))
            rows.append(dict(scoring=name, stored=stored, units=len(tier.units), host_bytes=tier.nbytes, ms=med,
                             gflops=flops / med / 1e6))
            print(f"  scoring {name:>9} over {stored:>6} stored tokens ({len(tier.units)} units, "
                  f"{tier.nbytes / 1e6:.0f} MB): {med:8.1f} ms ({flops / med / 1e6:.2f} GFLOP/s)", flush=True)
    return rows


def measure_transfer(config, args, rng) -> list[dict]:
    """Milliseconds to write `--recalled` cells into a cache holding `--cached` tokens (re-laid after the cursor,
    keys re-rotated, as a re-indexing policy's recall does)."""
    import jax.numpy as jnp

    from omnijax.kv import paged
    from omnijax.retention.recall import recall_into

    rows = []
    page = 64
    for cells in args.recalled:
        tier = random_tier(config, cells, args.unit, rng)
        pages = -(-(args.cached + cells) // page) + 2
        kv = paged.init(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                        num_pages=pages, page_size=page, batch=1, position_axes=config.position_axes,
                        dtype=jnp.float32)
        n, A = args.cached, config.position_axes
        shape = (config.num_layers, 1, n, config.num_kv_heads, config.head_dim)
        k = jnp.asarray(rng.standard_normal(shape, np.float32))
        pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (A, 1, n))
        meta = paged.SlotMeta(pos=pos, unit=jnp.zeros((1, n), jnp.int32), span=jnp.zeros((1, n), jnp.int8),
                              offset=jnp.zeros((1, n), jnp.int32))
        kv, _ = paged.append(kv, k, k, jnp.ones((1, n), bool), meta)
        next_pos = jnp.asarray([n + 10 * cells], jnp.int32)
        theta, section, interleaved = rope_of(config)

        def run(kv=kv, units=tier.units):
            return recall_into(kv, units, next_pos, rope=(theta, section), interleaved=interleaved)[0]

        med = float(np.median(harness.interleaved({"recall_into": run}, args.rounds)["recall_into"]))
        after = run()
        written = int(np.asarray(after.valid).sum()) - n
        if written != cells or bool(np.asarray(after.exhausted).any()):
            raise SystemExit(f"recall_into wrote {written} of {cells} cells (pool of {pages} pages)")
        moved = sum(u.k.nbytes + u.v.nbytes for u in tier.units)
        rows.append(dict(cells=cells, bytes=moved, written=written, ms=med, gb_s=moved / med / 1e6))
        print(f"  recall_into {cells:>5} cells ({moved / 1e6:.1f} MB of keys and values): {med:7.1f} ms "
              f"({moved / med / 1e6:.2f} GB/s)", flush=True)
    return rows


def project(name: str, config, args, mass_gflops: float) -> dict:
    """One model preset's projected figures (module docstring)."""
    L, G, d, Hq, T = config.num_layers, config.num_kv_heads, config.head_dim, config.num_heads, args.question_tokens
    per_token = 2 * L * G * d * 2
    av_rate = args.av_unit_tokens / 2.0  # tokens per second of stream (a unit is 2 s)
    stream_tokens = int(args.hours * 3600 * av_rate)
    out = dict(model=name, layers=L, kv_heads=G, head_dim=d, query_heads=Hq, bytes_per_token=per_token,
               text_unit_bytes=per_token * args.unit, av_unit_bytes=per_token * args.av_unit_tokens,
               stream_tokens=stream_tokens, host_bytes_stream=per_token * stream_tokens, pcie={}, saved={}, score_s={})
    for bw in args.pcie:
        out["pcie"][str(bw)] = dict(text_unit_ms=per_token * args.unit / bw / 1e6,
                                    av_unit_ms=per_token * args.av_unit_tokens / bw / 1e6,
                                    **{f"budget_{b}_ms": per_token * b / bw / 1e6 for b in args.recall_budgets})
    for b in args.device_budgets:
        out["saved"][str(b)] = per_token * max(0, stream_tokens - b)
    units = stream_tokens / args.av_unit_tokens
    out["score_gflop"] = {s: 2 * L * Hq * d * (stream_tokens * T if s == "mass" else stream_tokens if s == "max"
                                                 else units) / 1e9 for s in ("mass", "max", "mean")}
    out["score_s"] = {s: flop / mass_gflops for s, flop in out["score_gflop"].items()}
    return out


def main(argv=None):
    args = harness.parse(build_parser(), sys.argv[1:] if argv is None else argv, smoke=SMOKE)
    common.quiet_threads()
    out = harness.output_dir(args)
    source = common.model_source(args)
    import omnijax
    from omnijax.models.config import PRESETS
    from omnijax.streaming.session import graphdef_config

    config = graphdef_config(omnijax.load(source.checkpoint))
    rng = np.random.default_rng(args.seed)
    load = os.getloadavg()[0]
    print(f"{source.checkpoint}: L={config.num_layers} G={config.num_kv_heads} d={config.head_dim} "
          f"Hq={config.num_heads}, load {load:.1f}", flush=True)
    scoring = measure_scoring(config, args, rng)
    transfer = measure_transfer(config, args, rng)
    mass = [r["gflops"] for r in scoring if r["scoring"] == "mass"]
    if not mass:
        raise SystemExit("--scorings must include mass (the projection's scoring rate is measured on it)")
    mass_gflops = float(np.median(mass))
    projected = [project(name, PRESETS[name], args, mass_gflops) for name in PROJECTED]
    result = dict(model=str(source.gguf or source.checkpoint), random_weights=source.tiny, load=load,
                  shapes=dict(layers=config.num_layers, kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                              query_heads=config.num_heads),
                  device_bytes_per_token=2 * config.num_layers * config.num_kv_heads * config.head_dim *
                  np.dtype(config.jnp_dtype).itemsize, settings=vars(args),
                  scoring=scoring, transfer=transfer, cpu_mass_gflops=mass_gflops, projected=projected)
    harness.write_json(out, "recall_cost", result)
    print_tables(result, args)
    plot(result, out)


def print_tables(result, args) -> None:
    print("\nprojection (bf16 cache; a unit of text is "
          f"{args.unit} tokens, an audiovisual unit {args.av_unit_tokens}; {args.hours:g} h of audiovisual stream)")
    rows = []
    for p in result["projected"]:
        row = dict(model=p["model"], kb=p["bytes_per_token"] / 1e3, text=p["text_unit_bytes"] / 1e6,
                   av=p["av_unit_bytes"] / 1e6, host=p["host_bytes_stream"] / 1e9)
        for bw, t in p["pcie"].items():
            row[f"av{bw}"] = t["av_unit_ms"]
            for b in args.recall_budgets:
                row[f"b{b}_{bw}"] = t[f"budget_{b}_ms"]
        for b in args.device_budgets:
            row[f"saved{b}"] = p["saved"][str(b)] / 1e9
        for s in ("mass", "mean"):
            row[f"score_{s}"] = p["score_s"][s]
        row["flop_mass"] = p["score_gflop"]["mass"]
        rows.append(row)
    cols = [("model", "model", ""), ("KB/token", "kb", ".1f"), ("MB/text unit", "text", ".1f"),
            ("MB/AV unit", "av", ".1f"), ("host GB/stream", "host", ".1f")]
    for bw in result["projected"][0]["pcie"]:
        cols.append((f"AV unit ms @{float(bw):g}GB/s", f"av{bw}", ".2f"))
        cols += [(f"{b} cells ms @{float(bw):g}", f"b{b}_{bw}", ".1f") for b in args.recall_budgets]
    cols += [(f"saved GB @{b} cells", f"saved{b}", ".1f") for b in args.device_budgets]
    cols += [("mass GFLOP/question", "flop_mass", ".0f"), ("mass score s (this CPU)", "score_mass", ".1f"),
             ("mean score s (this CPU)", "score_mean", ".4f")]
    harness.print_table(rows, cols)


def plot(result, out) -> None:
    """`recall_cost.png`: scoring milliseconds per question against stored tokens (left), recall_into milliseconds
    against recalled cells (right), on this CPU."""
    plt = harness.pyplot()
    fig, (sc, tr) = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("mass", "max", "mean", "two_stage"):
        rs = [r for r in result["scoring"] if r["scoring"] == name]
        sc.plot([r["stored"] for r in rs], [r["ms"] for r in rs], marker="o", label=name)
    sc.set_xscale("log", base=2)
    sc.set_yscale("log")
    sc.set_xlabel("stored tokens in the host tier")
    sc.set_ylabel("scoring ms per question")
    sc.legend(fontsize=8)
    tr.plot([r["cells"] for r in result["transfer"]], [r["ms"] for r in result["transfer"]], marker="o")
    tr.set_xscale("log", base=2)
    tr.set_xlabel("cells recalled")
    tr.set_ylabel("recall_into ms")
    fig.suptitle(f"Recall cost on this CPU ({result['shapes']['layers']} layers, {result['shapes']['kv_heads']} kv "
                 f"heads, head {result['shapes']['head_dim']}; load {result['load']:.1f})"
                 + (" (tiny random model)" if result["random_weights"] else ""), fontsize=9)
    harness.save_png(fig, out, "recall_cost")


if __name__ == "__main__":
    main()
