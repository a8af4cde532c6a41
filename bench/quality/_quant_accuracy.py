"""`quantized --accuracy` (issue 41 item 3): perplexity and pass-key accuracy of quantised weights against float,
and llama.cpp's own perplexity on the same GGUFs over the same tokens.

omnijax variants (`--acc-variants`; checkpoints converted once into `--work`, as `quantized` does): float32 (the GGUF
dequantised), int8 per channel, int4 with groups of 32 / 64 / 128 (all from the dequantised weights), and the GGUF's
Q4_1 blocks kept (`--keep-quantized`). Each is scored on the first `--length` tokens of Alice at full context
(`_score.score_stream`, as the weights table) and answers the multi-turn pass key (`_stream.multi_turn`,
`--passkey-keys` keys at each of `--passkey-lengths`, the pass-key bench's seed-0 keys, NoSlide, greedy).

llama.cpp (`--llama-python`, an interpreter with llama-cpp-python; `--llama-kinds`): three GGUFs of the same weights,
the Q4_1 file itself and a Q8_0 and an F16 file written here from its dequantised tensors with the `gguf` package
(Q8_0: every 2-D tensor quantised by `gguf.quants.quantize`; 1-D tensors float32). Each is evaluated over the same
token ids (`_llama_ppl_worker.py`: one context, every position's logits), and omnijax scores the same file converted
(Q4_1 and Q8_0 with their blocks kept, F16 dequantised to float32): two engines, one file, one token sequence, so
the per-token NLL difference is the engines' arithmetic (llama.cpp's quantised matmuls also round the activations
to 8 bits; its F16 matmul rounds them to float16).

Writes `quantized_accuracy.json` (rewritten after each stage, so a long run's finished parts are kept) and
`quantized_accuracy.png`.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np

from bench import harness
from bench.quality import _common as common

ACC_VARIANTS = ("float32", "int8", "int4_g32", "int4_g64", "int4_g128", "gguf_kept")
LLAMA_KINDS = ("Q4_1", "Q8_0", "F16")
LLAMA_OMNIJAX = {"Q4_1": "gguf_kept", "Q8_0": "q8_0_kept", "F16": "f16"}  # omnijax's conversion of each file
WORKER = Path(__file__).with_name("_llama_ppl_worker.py")


def add_args(p) -> None:
    """The `--accuracy` options."""
    p.add_argument("--accuracy", action="store_true",
                   help="perplexity + pass key of quantised weights vs float, and llama.cpp on the same GGUFs")
    p.add_argument("--acc-variants", nargs="+", default=list(ACC_VARIANTS), choices=ACC_VARIANTS)
    p.add_argument("--passkey-lengths", type=int, nargs="+", default=[1024, 2048], help="--accuracy: pass-key tokens")
    p.add_argument("--passkey-keys", type=int, default=3, help="--accuracy: keys per length (0: no pass key)")
    p.add_argument("--passkey-chunk", type=int, default=128, help="--accuracy: tokens per pass-key chunk")
    p.add_argument("--llama-python", help="--accuracy: an interpreter with llama-cpp-python (without it the "
                                          "llama.cpp rows are skipped, and said so)")
    p.add_argument("--llama-kinds", nargs="+", default=list(LLAMA_KINDS), choices=LLAMA_KINDS)
    p.add_argument("--llama-threads", type=int, default=2)
    p.add_argument("--no-extra-bufts", action="store_true",
                   help="load llama.cpp models without its extra buffer types (repacking, AMX)")


def check_args(args) -> None:
    for flag in ("passkey_lengths", "passkey_chunk", "llama_threads"):
        value = getattr(args, flag)
        if min(value if isinstance(value, list) else [value]) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.passkey_keys < 0:
        raise SystemExit(f"--passkey-keys must be >= 0, got {args.passkey_keys}")
    if "float32" not in args.acc_variants:
        raise SystemExit("--acc-variants must include float32 (the reference of every delta)")


def llama_gguf(src: Path, kind: str, models: Path) -> Path:
    """The llama.cpp GGUF of `kind` for `src` (written once into `models`)."""
    from bench.peers.vs_llama_cpp import write_gguf

    if kind == "Q4_1":
        return src
    models.mkdir(parents=True, exist_ok=True)
    dst = models / f"{src.stem}.{kind}.gguf"
    return write_gguf(src, dst, kind)


def llama_nll(args, gguf_path: Path, ids: list[int], work: Path) -> dict:
    """llama.cpp's per-token NLL of `ids[1:]` (`_llama_ppl_worker.py` in its own process)."""
    ids_file = work / "accuracy_ids.json"
    ids_file.write_text(json.dumps([int(i) for i in ids]))
    # -P: the script's folder is not put on sys.path (it holds a `selectors.py` that would shadow the standard
    # library's, which subprocess and socket import)
    command = [args.llama_python, "-P", str(WORKER), str(gguf_path), str(ids_file), str(args.llama_threads),
               *(["--no-extra-bufts"] if args.no_extra_bufts else [])]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    done = subprocess.run(command, cwd=harness.ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp on {gguf_path.name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def passkey(model, prompts: dict, args) -> list[dict]:
    """Every pass-key prompt answered at full context (NoSlide), greedy."""
    from bench.quality import _stream
    from omnijax.retention import NoSlide

    rows = []
    for (length, i), prompt in prompts.items():
        config = _stream.stream_config(NoSlide(), tokens=prompt.tokens, budget=prompt.tokens,
                                       chunk=args.passkey_chunk, page_size=args.page_size)
        o = _stream.run_session(model, prompt, config, pad_to=args.passkey_chunk)
        rows.append(dict(length=length, key_index=i, key=prompt.key, tokens=prompt.tokens, answer=o.answer,
                         correct=o.correct, seconds=o.seconds))
        print(f"    pass key L={prompt.tokens} #{i}: {'right' if o.correct else 'wrong'} ({o.answer[:30]!r}) "
              f"{o.seconds:.0f} s", flush=True)
    return rows


def run(args, source, out: Path, convert_variant, weight_bytes, device: str) -> None:
    """The `--accuracy` run (module docstring)."""
    import omnijax
    from bench.quality import _stream
    from bench.quality._score import score_stream
    from bench.quality.perplexity import ppl, text_ids
    from omnijax.retention import NoSlide

    check_args(args)
    work = Path(args.work)
    ids = text_ids(source.checkpoint, "alice29.txt", args.length)
    result = dict(model=str(source.gguf or source.checkpoint), random_weights=source.tiny, text="alice29.txt",
                  length=args.length, chunk=args.chunk, passkey_lengths=args.passkey_lengths,
                  passkey_keys=args.passkey_keys, passkey_chunk=args.passkey_chunk, device=device,
                  variants={}, llama_cpp={})

    def save():
        result["table"] = table(result)
        harness.write_json(out, "quantized_accuracy", result)

    def score(name: str, path: Path) -> dict:
        model = omnijax.load(path)
        started = time.perf_counter()
        nll, _ = score_stream(model, np.asarray(ids), NoSlide(), chunk=args.chunk, cells=None,
                              page_size=args.page_size)
        total, lin = weight_bytes(model)
        row = dict(checkpoint=str(path), ppl=ppl(nll), nll=nll.tolist(), bytes=total, linear_bytes=lin,
                   score_seconds=time.perf_counter() - started)
        print(f"  {name}: perplexity {row['ppl']:.4f} over {len(nll)} tokens, linear weights {lin / 1e6:.1f} MB "
              f"({row['score_seconds']:.0f} s)", flush=True)
        return dict(row, model=model)

    from omnijax.errors import ConvertError

    models = {}
    result["refused"] = {}
    for name in args.acc_variants:
        try:
            path = convert_variant(source, name, work)
        except ConvertError as e:  # e.g. a group size that does not divide a width (SmolLM2's 576 and 128)
            print(f"  {name}: refused by omnijax convert: {e}", flush=True)
            result["refused"][name] = str(e)
            continue
        if path is None:
            print(f"  {name}: skipped (no GGUF blocks to keep: a --smoke model)", flush=True)
            continue
        row = score(name, path)
        models[name] = row.pop("model")
        result["variants"][name] = row
        save()
    if args.llama_python and source.gguf is not None:
        src = Path(source.gguf)
        for kind in args.llama_kinds:
            if kind == "Q4_1" and "q4_1" not in src.name.lower():
                print(f"  llama.cpp Q4_1 skipped: {src.name} is not a Q4_1 file", flush=True)
                continue
            path = llama_gguf(src, kind, work / "accuracy_gguf")
            mine = LLAMA_OMNIJAX[kind]
            if mine in result["variants"]:
                ours = result["variants"][mine]
            else:
                ours = score(mine, convert_variant(source, mine, work, src=path))
                ours.pop("model")
            theirs = llama_nll(args, path, ids, work)
            diff = np.asarray(ours["nll"]) - np.asarray(theirs["nll"])
            result["llama_cpp"][kind] = dict(gguf=str(path), omnijax_variant=mine, omnijax_ppl=ours["ppl"],
                                             omnijax_nll=ours["nll"], ppl=ppl(np.asarray(theirs["nll"])),
                                             nll=theirs["nll"], seconds=theirs["seconds"],
                                             version=theirs["version"], system_info=theirs["system_info"],
                                             max_abs_dnll=float(np.max(np.abs(diff))),
                                             mean_abs_dnll=float(np.mean(np.abs(diff))),
                                             mean_dnll=float(np.mean(diff)))
            print(f"  llama.cpp {kind}: perplexity {result['llama_cpp'][kind]['ppl']:.4f} vs omnijax {mine} "
                  f"{ours['ppl']:.4f}; token NLL max / mean |d| {np.max(np.abs(diff)):.4f} / "
                  f"{np.mean(np.abs(diff)):.4f}", flush=True)
            save()
    elif source.gguf is None:
        print("  llama.cpp rows skipped: the model is not a GGUF file", flush=True)
    else:
        print("  llama.cpp rows skipped: no --llama-python given (an interpreter with llama-cpp-python)", flush=True)
    if args.passkey_keys:
        prompts = {(length, i): _stream.multi_turn(models["float32"], length, key, args.passkey_chunk)
                   for length in args.passkey_lengths
                   for i, key in enumerate(common.pass_keys(args.passkey_keys, 1000 * length))}
        for name, model in models.items():
            print(f"  {name}: pass key", flush=True)
            result["variants"][name]["passkey"] = passkey(model, prompts, args)
            save()
    print_tables(result)
    plot(result, out)


def table(result: dict) -> list[dict]:
    """One line per omnijax variant: perplexity and its change from float32, token-NLL change, linear bytes, pass
    keys right per length, answers equal to float32's."""
    f32 = result["variants"].get("float32")
    rows = []
    for name, r in result["variants"].items():
        d = np.asarray(r["nll"]) - np.asarray(f32["nll"])
        line = dict(variant=name, ppl=r["ppl"], dppl=r["ppl"] - f32["ppl"], mean_abs_dnll=float(np.mean(np.abs(d))),
                    lin_mb=r["linear_bytes"] / 1e6, lin_ratio=r["linear_bytes"] / f32["linear_bytes"])
        keys = r.get("passkey")
        if keys is not None:
            for n in result["passkey_lengths"]:
                mine = [k for k in keys if k["length"] == n]
                line[f"passkey_{n}"] = f"{sum(k['correct'] for k in mine)}/{len(mine)}"
            if f32.get("passkey") is not None:
                same = sum(a["answer"] == b["answer"] for a, b in zip(keys, f32["passkey"]))
                line["same_answers"] = f"{same}/{len(keys)}"
        rows.append(line)
    return rows


def print_tables(result: dict) -> None:
    print(f"\n{result['length']} tokens of Alice, full context; pass key: multi-turn, NoSlide")
    cols = [("variant", "variant", ""), ("ppl", "ppl", ".4f"), ("d ppl", "dppl", "+.4f"),
            ("mean |d nll|", "mean_abs_dnll", ".4f"), ("linear MB", "lin_mb", ".1f"), ("/ f32", "lin_ratio", ".3f")]
    if result["passkey_keys"]:
        cols += [(f"pass key {n}", f"passkey_{n}", "") for n in result["passkey_lengths"]]
        cols += [("answers = f32", "same_answers", "")]
    harness.print_table(result["table"], cols)
    if result["llama_cpp"]:
        print("\nllama.cpp vs omnijax on the same GGUF and token ids")
        rows = [dict(kind=k, ours=v["omnijax_variant"], ppl=v["ppl"], ours_ppl=v["omnijax_ppl"],
                     dppl=v["omnijax_ppl"] - v["ppl"], max=v["max_abs_dnll"], mean=v["mean_abs_dnll"])
                for k, v in result["llama_cpp"].items()]
        harness.print_table(rows, [("GGUF", "kind", ""), ("llama.cpp ppl", "ppl", ".4f"), ("omnijax", "ours", ""),
                                   ("omnijax ppl", "ours_ppl", ".4f"), ("d ppl", "dppl", "+.4f"),
                                   ("max |d nll|", "max", ".4f"), ("mean |d nll|", "mean", ".4f")])


def plot(result: dict, out: Path) -> None:
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    rows = result["table"]
    axes[0].bar([r["variant"] for r in rows], [r["ppl"] for r in rows], color="tab:blue")
    lo = min(r["ppl"] for r in rows)
    axes[0].set_ylim(lo * 0.98, max(r["ppl"] for r in rows) * 1.01)
    axes[0].set_title(f"omnijax perplexity ({result['length']} tokens of Alice)", fontsize=10)
    axes[0].tick_params(axis="x", labelsize=8)
    for i, r in enumerate(rows):
        right = [r.get(f"passkey_{n}") for n in result["passkey_lengths"] if r.get(f"passkey_{n}")]
        if right:
            axes[0].annotate("keys " + " ".join(right), (i, r["ppl"]), ha="center", va="bottom", fontsize=7)
    kinds = list(result["llama_cpp"])
    x = np.arange(len(kinds))
    axes[1].bar(x - 0.2, [result["llama_cpp"][k]["ppl"] for k in kinds], 0.4, label="llama.cpp")
    axes[1].bar(x + 0.2, [result["llama_cpp"][k]["omnijax_ppl"] for k in kinds], 0.4, label="omnijax")
    axes[1].set_xticks(x, kinds)
    if kinds:
        both = [v for k in kinds for v in (result["llama_cpp"][k]["ppl"], result["llama_cpp"][k]["omnijax_ppl"])]
        axes[1].set_ylim(min(both) * 0.98, max(both) * 1.01)
    axes[1].set_title("same GGUF, same tokens", fontsize=10)
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
    harness.save_png(fig, out, "quantized_accuracy")
