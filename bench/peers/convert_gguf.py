"""Conversion against its peers, two pairs on the same model:

- GGUF: `omnijax convert MODEL.gguf DST` beside transformers' GGUF loader followed by `save_pretrained` (the route a
  transformers user takes from a llama.cpp file to a checkpoint), on the same file;
- safetensors: `omnijax convert HF_DIR DST` of the float32 safetensors checkpoint transformers wrote from that file
  beside `safetensors.torch.load_file` + `torch.save` of the same tensors (reading and writing them once: the floor
  a converter is held to).

Each conversion runs in a fresh process (`--worker TOOL`), the tools of a pair alternating round by round, so a drift
of the shared machine hits them alike. Per run: the process's wall time from start to exit (imports included: what a
user waits for), the imports' time, the conversion's own time after them, the process's peak resident memory
(`ru_maxrss`) and its growth over the resident memory after the imports (the conversion's own peak, compared with the
largest tensor). All write float32. torch runs with `OMP_WAIT_POLICY=PASSIVE` (its spinning threads otherwise slow
the other process on a shared machine). Default: the SmolLM2-135M-Instruct Q4_1 GGUF `make smollm2` installs;
`--smoke` converts a tiny random llama GGUF (two layers, byte-level tokenizer), one round: the peers' shared one
(`first_token.smoke_models`), whose GGUF pair of conversions, made once by this script's `run_one` for the peers
scripts' smoke runs into the same `--out`, are that round's rows; a smoke run's conversions run their `--worker`
inside its own process (`run_one(inline=True)`), not a fresh one.

    python -m bench.peers.convert_gguf --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import harness

PAIRS = {"gguf": ("omnijax", "transformers"), "safetensors": ("omnijax-safetensors", "torch-save")}
TOOLS = tuple(t for pair in PAIRS.values() for t in pair)


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kilobytes


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def worker(tool: str, src: Path, dst: Path) -> dict:
    """One conversion of `src` (the GGUF file, or the safetensors directory for the safetensors pair) in this
    process; returns its import and conversion seconds and this process's peak memory."""
    start = time.perf_counter()
    if tool.startswith("omnijax"):
        from omnijax.convert import convert_checkpoint
    else:
        import safetensors.torch
        import torch
        import transformers
    imported, base, cpu = time.perf_counter(), _rss_mb(), time.process_time()
    if tool.startswith("omnijax"):
        convert_checkpoint(src, dst, dtype="float32", progress=False, log=lambda line: None)
    elif tool == "transformers":
        model = transformers.AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                                  dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model.save_pretrained(dst)
        tokenizer.save_pretrained(dst)
    else:
        dst.mkdir(parents=True)
        torch.save(safetensors.torch.load_file(src / "model.safetensors"), dst / "model.pt")
    peak = _peak_mb()
    return {"import_s": imported - start, "convert_s": time.perf_counter() - imported,
            "convert_cpu_s": time.process_time() - cpu, "peak_rss_mb": peak, "peak_growth_mb": peak - base}


def write_tiny_gguf(path: Path) -> Path:
    """A tiny random llama GGUF (F32, 2 layers, hidden 64, a 300-token byte-level BPE with ChatML) for `--smoke`."""
    import gguf

    from omnijax.models.tokenizer import write_tiny_tokenizer

    vocab_size, hidden, inter, layers, heads, kv_heads = 300, 64, 128, 2, 4, 2
    specials = {"<|endoftext|>": vocab_size - 3, "<|im_start|>": vocab_size - 2, "<|im_end|>": vocab_size - 1}
    tok_dir = path.parent / "tiny_tokenizer"
    write_tiny_tokenizer(tok_dir, vocab_size=vocab_size, special_tokens=specials, chat_template=None)
    model = json.loads((tok_dir / "tokenizer.json").read_text())["model"]
    vocab = {**model["vocab"], **specials}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_bos_token_id(specials["<|im_start|>"])
    w.add_eos_token_id(specials["<|im_end|>"])
    w.add_pad_token_id(specials["<|endoftext|>"])
    w.add_add_bos_token(False)
    head_dim = hidden // heads

    def mat(*shape):
        return (rng.normal(size=shape) * 0.1).astype(np.float32)

    w.add_tensor("token_embd.weight", mat(vocab_size, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        b = f"blk.{i}."
        for name, shape in (("attn_q.weight", (heads * head_dim, hidden)),
                            ("attn_k.weight", (kv_heads * head_dim, hidden)),
                            ("attn_v.weight", (kv_heads * head_dim, hidden)),
                            ("attn_output.weight", (hidden, heads * head_dim)),
                            ("ffn_gate.weight", (inter, hidden)), ("ffn_up.weight", (inter, hidden)),
                            ("ffn_down.weight", (hidden, inter))):
            w.add_tensor(b + name, mat(*shape))
        w.add_tensor(b + "attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(b + "ffn_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def run_one(tool: str, gguf_path: Path, work: Path, keep: Path | None = None, hf: Path | None = None, *,
            inline: bool = False) -> dict:
    """`tool`'s conversion in a fresh process (of `gguf_path`, or for the safetensors pair of `hf`, default
    `work/hf`); its output is removed afterwards, or moved to `keep` when given.

    `inline` (`--smoke`, a check that the script runs): the worker runs in this process (`harness.run_worker`), its
    command line and JSON row as ever, so a smoke run's four conversions do not each pay an interpreter and the
    imports (~2.5 CPU s for omnijax's, ~6 for torch and transformers'); its import seconds and peak memory are then
    this process's, not a conversion's."""
    dst = work / f"{tool}-out"
    shutil.rmtree(dst, ignore_errors=True)
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    start = time.perf_counter()
    src = (hf or work / "hf") if tool in PAIRS["safetensors"] else gguf_path
    done = harness.run_worker(harness.module_command(__spec__.name, "--worker", tool, "--gguf", src, "--dst", dst),
                              inline=inline, env=env, timeout=None if inline else 1800)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{tool} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    size = sum(f.stat().st_size for f in dst.rglob("*") if f.is_file())
    if keep is not None:
        dst.rename(keep)
    else:
        shutil.rmtree(dst, ignore_errors=True)
    return {"tool": tool, "wall_s": wall, "output_mb": size / 2 ** 20, **row}


def smoke_conversions(out: Path) -> tuple[Path, dict[str, dict], Path]:
    """`--smoke` without `--gguf`: the peers' shared tiny GGUF (`first_token.smoke_models`, made once under `out`),
    the rows of the two conversions its smoke models were made by (`run_one`, inline as this script's own smoke
    round runs; a tool is absent when its row is not there) and transformers' conversion of it (the safetensors
    pair's source). A smoke run then converts that file once for all the peers scripts."""
    from bench.peers.first_token import CONVERSION_ROW, smoke_models

    gguf_path, models = smoke_models(out)
    made = {tool: json.loads((models / CONVERSION_ROW.format(name)).read_text())
            for name, tool in (("omnijax", "omnijax"), ("hf", "transformers"))
            if (models / CONVERSION_ROW.format(name)).is_file()}
    return gguf_path, made, models / "hf"


def main(argv=None) -> int:
    p = harness.parser(__doc__)
    p.add_argument("--gguf", help="the GGUF file (default: the installed SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--rounds", type=int, default=3, help="conversions per tool (alternating)")
    p.add_argument("--pairs", nargs="+", choices=tuple(PAIRS), default=tuple(PAIRS),
                   help="which pairs to run (the safetensors pair alone needs --hf)")
    p.add_argument("--hf", help="transformers' float32 checkpoint of the GGUF file, for the safetensors pair "
                                "(default: the first round's transformers conversion)")
    p.add_argument("--worker", choices=TOOLS, help=argparse.SUPPRESS)  # one conversion in this process
    p.add_argument("--dst", help=argparse.SUPPRESS)
    args = harness.parse(p, argv, smoke={"rounds": 1})
    if args.worker:
        print(json.dumps(worker(args.worker, Path(args.gguf), Path(args.dst))))
        return 0
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if "gguf" not in args.pairs and not args.hf:
        p.error("--pairs without gguf needs --hf (the safetensors pair's source is the transformers conversion)")
    if args.hf and not (Path(args.hf) / "model.safetensors").is_file():
        p.error(f"--hf {args.hf}: no model.safetensors there")
    pairs = {pair: PAIRS[pair] for pair in args.pairs}
    tools = tuple(t for pair in pairs.values() for t in pair)
    out = harness.output_dir(args)
    with tempfile.TemporaryDirectory(prefix="convert_gguf_") as tmp:
        work = Path(tmp)
        made: dict[str, dict] = {}  # --smoke: tool -> the row of a conversion the peers' smoke models were made by
        first_hf = work / "hf"
        if args.smoke and not args.gguf:
            gguf_path, made, smoke_hf = smoke_conversions(out)
            first_hf = smoke_hf if "transformers" in made else first_hf
        else:
            from omnijax.demo.smollm2 import find_gguf

            gguf_path = find_gguf(args.gguf)
        print(f"{gguf_path.name}: {gguf_path.stat().st_size / 2 ** 20:.1f} MB, {args.rounds} rounds", flush=True)
        # the safetensors pair's source: transformers' float32 checkpoint of the same file, the output of the first
        # round's transformers conversion (the GGUF pair runs first in every round), kept rather than removed
        hf = Path(args.hf).expanduser() if args.hf else first_hf
        rows = []
        for r in range(args.rounds):
            for pair, both in pairs.items():
                for tool in (both if r % 2 == 0 else both[::-1]):
                    keep = hf if tool == "transformers" and not hf.exists() else None
                    row = (made.pop(tool) if tool in made
                           else run_one(tool, gguf_path, work, keep, hf, inline=args.smoke))
                    row = dict(row, round=r, pair=pair)
                    rows.append(row)
                    print(f"  round {r + 1}/{args.rounds} {tool}: {row['wall_s']:.1f} s wall, {row['convert_s']:.2f} "
                          f"s converting ({row['convert_cpu_s']:.2f} s CPU), peak {row['peak_rss_mb']:.0f} MB "
                          f"(+{row['peak_growth_mb']:.0f} MB)", flush=True)
        from safetensors import safe_open

        with safe_open(hf / "model.safetensors", framework="numpy") as f:
            largest_mb = max(np.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys()) / 2 ** 20
    keys = ("wall_s", "import_s", "convert_s", "convert_cpu_s", "peak_rss_mb", "peak_growth_mb", "output_mb")
    summary = {}
    for tool in tools:
        mine = [r for r in rows if r["tool"] == tool]
        summary[tool] = {k: float(np.median([r[k] for r in mine])) for k in keys}
        summary[tool].update(convert_s_p10=float(np.percentile([r["convert_s"] for r in mine], 10)),
                             convert_s_p90=float(np.percentile([r["convert_s"] for r in mine], 90)))
    ratios = {}
    for pair, (mine, peer) in pairs.items():
        # same-round ratios: robust to the machine's speed drifting between rounds
        ratios[pair] = {k: harness.same_round_ratio([r[k] for r in rows if r["tool"] == mine],
                                                    [r[k] for r in rows if r["tool"] == peer])
                        for k in ("wall_s", "convert_s", "convert_cpu_s", "peak_rss_mb")}
    if "safetensors" in pairs:
        ratios["safetensors"]["peak_growth_over_largest_tensor"] = \
            summary["omnijax-safetensors"]["peak_growth_mb"] / largest_mb
    harness.print_table([dict(tool=t, **summary[t]) for t in tools]
                        + [dict(tool=f"{pairs[p][0]} / {pairs[p][1]}", import_s=None, peak_growth_mb=None,
                                **ratios[p]) for p in pairs],
                        [("tool", "tool", ""), ("wall s", "wall_s", ".2f"), ("import s", "import_s", ".2f"),
                         ("convert s", "convert_s", ".2f"), ("convert CPU s", "convert_cpu_s", ".2f"),
                         ("peak MB", "peak_rss_mb", ".2f"),
                         ("peak growth MB", "peak_growth_mb", ".0f")])
    growth = ratios.get("safetensors", {}).get("peak_growth_over_largest_tensor")
    print(f"largest tensor {largest_mb:.0f} MB; omnijax's peak growth converting safetensors: "
          + ("not run" if growth is None else f"{growth:.2f}x it") + f"; load average {os.getloadavg()[0]:.1f}")
    harness.write_json(out, "convert_gguf", {"gguf": str(gguf_path.name), "smoke": bool(args.smoke),
                                             "rounds": args.rounds, "rows": rows, "median": summary,
                                             "largest_tensor_mb": largest_mb, "loadavg": os.getloadavg(),
                                             "ratio_omnijax_over_transformers": ratios.get("gguf"),
                                             "ratio_omnijax_over_torch_save": ratios.get("safetensors")})
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    colors = ["tab:blue", "tab:gray", "tab:cyan", "tab:olive"]
    for ax, key, label in ((axes[0], "convert_s", "conversion time after imports (s)"),
                           (axes[1], "peak_growth_mb", "peak memory growth (MB)")):
        ax.bar(range(len(tools)), [summary[t][key] for t in tools], color=colors[:len(tools)])
        ax.set_xticks(range(len(tools)), tools, rotation=15, fontsize=7)
        ax.set_ylabel(label)
    axes[1].axhline(1.5 * largest_mb, color="k", lw=0.8, ls="--", label="1.5x largest tensor")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"conversion, {gguf_path.name} (median of {args.rounds})", fontsize=9)
    fig.tight_layout()
    harness.save_png(fig, out, "convert_gguf")
    return 0


if __name__ == "__main__":
    sys.exit(main())
