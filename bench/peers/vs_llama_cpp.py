"""omnijax against llama.cpp on the same weights: decode time per token, time to the first token and resident memory,
each measurement a fresh process, the sides interleaved round by round (issue 38 items 3 and 7).

Weights: the SmolLM2-135M-Instruct Q4_1 GGUF `make smollm2` installs. omnijax runs its float32 conversion
(`omnijax convert`, every tensor dequantised); llama.cpp runs three GGUFs of the same weights: the Q4_1 file itself,
and F32 / F16 files this script writes from the dequantised tensors (the `gguf` package: the file's metadata copied,
every tensor dequantised to float32; F16 casts the matrices and keeps the 1-D norms float32, as llama.cpp's own
converter does). The F32 file holds exactly the values omnijax computes with.

Each side answers one chat-templated prompt greedily with `--tokens` tokens, through end-of-turn tokens:

    omnijax     a `Session` as `Chat` runs one (OmniPick 512 / 384, 16-token pages, 68 pages, answer blocks of
                `--block` tokens, the prompt chunk carrying the first block), its compiled steps read from a
                persistent compilation cache a priming run filled; its first token arrives with the first block;
    omnijax_stacked  the same with the decoder's layers kept stacked (`omnijax.load` splits them per layer on CPU
                since issue 38 item 3: `Decoder.split_layers`; this side is the layout before that, for the ratio);
    llama_*     `llama_cpp.Llama(...).generate` (llama-cpp-python, `--llama-python`: a separate interpreter, never
                the project's venv), `--threads` threads, `OMP_WAIT_POLICY=PASSIVE`.

Figures per process: decode ms per token after the first token ((last - first) / (tokens - 1)), wall and the
process's CPU (every thread's: the work done, steadier than the wall on a loaded machine), time to the first
token after the load (prompt prefill + first token) and from process start, resident memory after the load and at
the end, and the process peak. Ratios are omnijax / llama.cpp in the same round, medians over `--rounds`; the load
average is recorded with every process. Without `--llama-python` the llama.cpp rows are skipped, saying so.

`--smoke`: a tiny random llama GGUF, one round, 8 tokens, omnijax's worker inside the script's own process (a check
that the script runs).

    python -m bench.peers.vs_llama_cpp --llama-python /tmp/llvenv2/bin/python --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import harness
from bench.peers._llama_cpp_worker import status_mb  # stdlib only: the llama.cpp side runs it too

SYSTEM = "You are a helpful assistant."
QUESTION = "Write a long story about a dragon who learns to paint."
LLAMA_KINDS = ("F32", "F16", "Q4_1")
WORKER = Path(__file__).with_name("_llama_cpp_worker.py")


def write_gguf(src: Path, dst: Path, kind: str) -> Path:
    """`src`'s metadata and tensors, every tensor dequantised to float32, as an F32, F16 or Q8_0 GGUF (F16: 2-D
    tensors cast to float16; Q8_0: 2-D tensors quantised by the `gguf` package; 1-D tensors stay float32)."""
    import gguf

    file_types = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                  "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
    if kind not in file_types:
        raise ValueError(f"write_gguf writes {sorted(file_types)}, got {kind!r}")

    if dst.exists():
        return dst
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_name(dst.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(file_types[kind])
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        values = values.reshape(tuple(int(d) for d in reversed(t.shape)))
        if kind == "Q8_0" and values.ndim > 1:
            q = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(t.name, gguf.quants.quantize(values, q), raw_dtype=q)
            continue
        if kind == "F16" and values.ndim > 1:
            values = values.astype(np.float16)
        writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    return dst


def prompt_text(tokenizer) -> str:
    """The chat template's rendering of the system prompt and the question, with the generation prompt."""
    return tokenizer.render([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
                            add_generation_prompt=True)


def omnijax_worker(checkpoint: Path, cache: str, tokens: int, block: int, stacked: bool = False) -> dict:
    """One answer through omnijax in this process (the `--worker omnijax` side); `stacked`: the decoder's layers
    stay stacked (the `omnijax_stacked` side)."""
    import omnijax
    from omnijax.decoding import Greedy
    from omnijax.models import model as model_lib
    from omnijax.retention import OmniPick

    if stacked:
        model_lib.SPLIT_LAYER_BACKENDS = ()  # what restore_module reads: no split on load
    omnijax.enable_compilation_cache(cache)
    marks = {"imported": time.time()}
    model = omnijax.load(checkpoint)
    if (type(model.decoder.layers).__name__ == "SplitLayers") == stacked:
        raise SystemExit(f"omnijax worker: layers {type(model.decoder.layers).__name__}, stacked={stacked}")
    marks["loaded"] = time.time()
    rss_loaded = status_mb()
    config = omnijax.StreamConfig(policy=OmniPick(high_watermark=512, low_watermark=384, text_budget=128),
                                  page_size=16, num_pages=68, max_answer_tokens=block,
                                  decoding=Greedy(free_running=True))
    chat = omnijax.Chat(model, config)
    chat.system(SYSTEM)
    marks["prompt"] = time.time()
    ids_before = len(chat.text_ids)
    blocks, cpu = [], []
    for _ in chat.ask(QUESTION, max_tokens=tokens):
        blocks.append(time.time())
        cpu.append(time.process_time())
    ids = chat.text_ids[ids_before:]
    ids = ids[len(ids) - tokens:]
    marks["first_token"], marks["last_token"] = blocks[0], blocks[-1]
    # the first block's tokens all arrive together: decode time is the rest over the tokens after that block
    first_block = min(block, tokens)
    return {"marks": marks, "cpu_marks": {"first_token": cpu[0], "last_token": cpu[-1]}, "ids": [int(i) for i in ids],
            "text": model.tokenizer.decode(ids), "rss_loaded_mb": rss_loaded, "rss_end_mb": status_mb(),
            "peak_mb": status_mb("VmHWM"), "first_block": first_block}


def run_one(side: str, args, files: dict, work: Path) -> dict:
    """`side` in a fresh process: its marks (seconds from the process's start), ids, memory. With `--smoke` (a
    check that the script runs) the `omnijax` side's worker runs in this process (`harness.run_worker`), its command
    line and JSON as ever, sparing an interpreter and the imports; its memory figures are then this process's
    (`omnijax_stacked` changes how the process loads a model, so it keeps its own)."""
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if side.startswith("omnijax"):
        command = harness.module_command(__spec__.name, "--worker", "--checkpoint", files["omnijax"], "--cache",
                                         files["cache"], "--tokens", args.tokens, "--block", args.block,
                                         *(["--stacked"] if side == "omnijax_stacked" else []))
    else:
        command = [args.llama_python, str(WORKER), str(files[side]), str(files["prompt"]), str(args.tokens),
                   str(args.threads), *(["--no-extra-bufts"] if args.no_extra_bufts else [])]
    load = os.getloadavg()[0]
    start = time.time()
    inline = args.smoke and side == "omnijax"
    done = harness.run_worker(command, inline=inline, env=env, timeout=None if inline else 1800)
    if done.returncode != 0:
        raise SystemExit(f"{side} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    marks, cpu = row.pop("marks"), row.pop("cpu_marks")
    first_block = row.pop("first_block", 1)
    # the workers' marks are wall-clock times: from `start` (just before the process started) on
    decoded = args.tokens - first_block
    return {"side": side, "load_avg": load, **row,
            "decode_ms_per_token": 1e3 * (marks["last_token"] - marks["first_token"]) / max(decoded, 1),
            "decode_cpu_ms_per_token": 1e3 * (cpu["last_token"] - cpu["first_token"]) / max(decoded, 1),
            "ttft_after_load_s": marks["first_token"] - marks["prompt"],
            "first_token_from_start_s": marks["first_token"] - start, "load_s": marks["loaded"] - marks["imported"]}


def main(argv=None) -> int:
    p = harness.parser(__doc__)
    p.add_argument("--gguf", help="the GGUF file (default: the installed SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--llama-python", help="an interpreter with llama-cpp-python (a separate venv); without it the "
                                          "llama.cpp rows are skipped")
    p.add_argument("--no-extra-bufts", action="store_true",
                   help="load llama.cpp models without its extra buffer types (repacking, AMX): for a build whose "
                        "AMX kernels this machine refuses")
    p.add_argument("--rounds", type=int, default=5, help="processes per side (interleaved)")
    p.add_argument("--tokens", type=int, default=64, help="answer tokens per process")
    p.add_argument("--block", type=int, default=16, help="omnijax's answer block (max_answer_tokens)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    p.add_argument("--kinds", nargs="+", default=list(LLAMA_KINDS), choices=LLAMA_KINDS, help="llama.cpp GGUFs")
    p.add_argument("--no-stacked", action="store_true", help="skip the omnijax_stacked side (layers kept stacked)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stacked", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    args = harness.parse(p, argv, smoke={"rounds": 1, "tokens": 8, "block": 4, "no_stacked": True})
    if args.worker:
        print(json.dumps(omnijax_worker(Path(args.checkpoint), args.cache, args.tokens, args.block, args.stacked)))
        return 0
    if args.rounds < 1 or args.tokens < 2 or args.block < 1:
        p.error("--rounds and --block must be at least 1, --tokens at least 2")
    from omnijax.demo import smollm2
    from omnijax.models.tokenizer import Tokenizer

    out = harness.output_dir(args)
    with tempfile.TemporaryDirectory(prefix="vs_llama_cpp_") as tmp:
        work = Path(tmp)
        if args.smoke and not args.gguf:
            from bench.peers.convert_gguf import write_tiny_gguf

            src, models = write_tiny_gguf(work / "tiny.gguf"), work
        else:
            src, models = smollm2.find_gguf(args.gguf), out / "vs_llama_cpp_models"
        models.mkdir(parents=True, exist_ok=True)
        checkpoint, _ = smollm2.converted(src, models / "omnijax")
        if args.smoke and not args.gguf:  # the tiny GGUF has no chat template: omnijax's ChatML one
            from omnijax.models.chat_templates import CHATML_TEMPLATE

            (checkpoint / "chat_template.jinja").write_text(CHATML_TEMPLATE)
        tokenizer = Tokenizer.from_directory(checkpoint)
        files = {"omnijax": checkpoint, "cache": str(work / "cache"), "prompt": work / "prompt.txt"}
        if args.smoke:  # the smoke run's own cache (a check, not a measurement)
            files["cache"] = os.environ.get("JAX_COMPILATION_CACHE_DIR") or files["cache"]
        files["prompt"].write_text(prompt_text(tokenizer), encoding="utf-8")
        sides = ["omnijax"] + ([] if args.no_stacked else ["omnijax_stacked"])
        if args.llama_python:
            for kind in args.kinds:
                if kind == "Q4_1":
                    if src.name.lower().find("q4_1") < 0:
                        print(f"llama_Q4_1 skipped: {src.name} is not a Q4_1 file")
                        continue
                    files["llama_Q4_1"] = src
                else:
                    files[f"llama_{kind}"] = write_gguf(src, models / f"{src.stem}.{kind}.gguf", kind)
                sides.append(f"llama_{kind}")
        else:
            print("llama.cpp rows skipped: no --llama-python given (an interpreter with llama-cpp-python)")
        if not args.smoke:
            print("priming omnijax's compilation cache", flush=True)
            for side in sides:
                if side.startswith("omnijax"):
                    run_one(side, args, files, work)
        rows = []
        for r in range(args.rounds):
            for side in (sides if r % 2 == 0 else sides[::-1]):
                row = dict(run_one(side, args, files, work), round=r)
                rows.append(row)
                print(f"  round {r + 1}/{args.rounds} {side:11s} {row['decode_ms_per_token']:7.1f} ms/token "
                      f"({row['decode_cpu_ms_per_token']:.1f} CPU), "
                      f"first token {row['ttft_after_load_s']:.2f} s after load, rss {row['rss_end_mb']:.0f} MB, "
                      f"load avg {row['load_avg']:.1f}", flush=True)
    return report(args, sides, rows, out, src)


def report(args, sides, rows, out: Path, src: Path) -> int:
    keys = ("decode_ms_per_token", "decode_cpu_ms_per_token", "ttft_after_load_s", "first_token_from_start_s",
            "rss_loaded_mb", "rss_end_mb", "peak_mb")
    summary = {s: {k: float(np.median([r[k] for r in rows if r["side"] == s])) for k in keys} for s in sides}
    spread = {s: {k: [float(np.percentile([r[k] for r in rows if r["side"] == s], q)) for q in (10, 90)]
                  for k in keys} for s in sides}
    by = {(r["round"], r["side"]): r for r in rows}
    ratios = {s: {k: float(np.median([by[(i, "omnijax")][k] / by[(i, s)][k] for i in range(args.rounds)]))
                  for k in keys} for s in sides if s != "omnijax"}
    harness.print_table([dict(side=s, **summary[s], ratio=ratios.get(s, {}).get("decode_ms_per_token", 1.0),
                              cpu_ratio=ratios.get(s, {}).get("decode_cpu_ms_per_token", 1.0)) for s in sides],
                        [("side", "side", ""), ("ms / token", "decode_ms_per_token", ".1f"),
                         ("CPU ms / token", "decode_cpu_ms_per_token", ".1f"),
                         ("TTFT after load s", "ttft_after_load_s", ".2f"),
                         ("first token from start s", "first_token_from_start_s", ".2f"),
                         ("RSS loaded MB", "rss_loaded_mb", ".0f"), ("RSS end MB", "rss_end_mb", ".0f"),
                         ("peak MB", "peak_mb", ".0f"), ("omnijax / side (decode)", "ratio", ".2f"),
                         ("(decode CPU)", "cpu_ratio", ".2f")])
    answers = {s: next(r["text"] for r in rows if r["side"] == s) for s in sides}
    ids = {s: next(r["ids"] for r in rows if r["side"] == s) for s in sides}
    agree = {s: int(next((i for i, (a, b) in enumerate(zip(ids["omnijax"], ids[s])) if a != b),
                         min(len(ids["omnijax"]), len(ids[s])))) for s in sides if s != "omnijax"}
    for s in sides:
        print(f"  {s}: {answers[s][:80]!r}")
    print(f"  greedy tokens equal to omnijax's before the first difference: {agree}")
    loads = [r["load_avg"] for r in rows]
    harness.write_json(out, "vs_llama_cpp", {
        "gguf": src.name, "smoke": bool(args.smoke), "rounds": args.rounds, "tokens": args.tokens,
        "block": args.block, "threads": args.threads, "no_extra_bufts": bool(args.no_extra_bufts),
        "load_avg_min_max": [min(loads), max(loads)], "median": summary, "p10_p90": spread,
        "ratio_omnijax_over": ratios, "tokens_agreeing": agree, "rows": rows,
        "llama_system_info": next((r.get("system_info") for r in rows if "system_info" in r), None)})
    plt = harness.pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3))
    a1.bar(sides, [summary[s]["decode_ms_per_token"] for s in sides], color="tab:blue")
    a1.set_ylabel("decode ms / token (median)")
    a2.bar(sides, [summary[s]["rss_end_mb"] for s in sides], color="tab:green")
    a2.set_ylabel("resident MB after the answer")
    for a in (a1, a2):
        a.tick_params(labelsize=7)
    fig.suptitle(f"{src.name}, {args.tokens} tokens, {args.rounds} rounds", fontsize=9)
    fig.tight_layout()
    harness.save_png(fig, out, "vs_llama_cpp")
    return 0


if __name__ == "__main__":
    sys.exit(main())
