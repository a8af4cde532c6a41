"""Quantised weights on the real model (issue 41 item 1): perplexity, weight bytes and decode time of SmolLM2 with
float32, int8 and int4 linear weights, and with the GGUF's own Q4_1 blocks kept quantised.

The GGUF (`--gguf`, default SmolLM2-135M-Instruct.Q4_1) is converted once per variant into `--work`:

    float32     every tensor dequantised (`omnijax convert`, the default): the reference
    int8        `--quantize int8`: symmetric int8, one scale per output channel, from the dequantised weights
    int4_g32    `--quantize int4 --group-size 32`: asymmetric int4 per 32 input rows, from the dequantised weights
    gguf_kept   `--keep-quantized`: the GGUF's Q8_0 / Q4_0 / Q4_1 weights repacked without a float round trip

(SmolLM2's GGUF stores every linear weight in Q4_1, so `float32` is Q4_1 dequantised: int8 adds its own rounding on
top, and int4 g32's min/max grid finds Q4_1's blocks again up to float rounding. The embedding, tied to the head,
stays float in every variant.)

Perplexity: the first `--length` tokens of the vendored Alice streamed with full context in chunks of `--chunk`
(`bench/quality/_score.py`, as `perplexity.py` scores). Bytes: the decoder's parameters as loaded (codes, scales and
offsets for a quantised weight) and the linear weights alone. Decode time: one `Session.feed` of a `--prompt`-token
text unit answering `--decode-tokens` greedy tokens, minus the same feed answering none, per answered token; the
variants interleaved round by round (`harness.interleaved`) and each reported as the median of the same-round
ratios to float32, since the machine's speed drifts (also the whole answering feed's ratio, which noise cannot make
negative as it can the difference). Writes `quantized.json` and `quantized.png`.

`--kv` measures the int8 KV pool (`StreamConfig(kv_dtype="int8")`) against the float pool instead, on the float32
checkpoint, under each policy of `--kv-policies` (`bench/quality/_stream.policy_at` at `--kv-budget` cells): the
perplexity of the first `--kv-lengths` tokens of Alice (one scored stream of the longest length per policy and pool:
a streamed token is scored before any later one is fed, so a prefix's perplexity is the shorter run's), and the
multi-turn pass key (`_stream.multi_turn`, `--kv-keys` keys per length, the pass-key bench's keys) with each pool.
Writes `quantized_kv.json`.

`--accuracy` measures perplexity and pass-key accuracy of int8 / int4 (groups of 32, 64, 128) weights and the kept
Q4_1 blocks against float32, and llama.cpp's own perplexity on the Q4_1 GGUF and on Q8_0 / F16 GGUFs written from
the same weights, over the same tokens (`bench/quality/_quant_accuracy.py`). Writes `quantized_accuracy.json` and
`quantized_accuracy.png`.

`--capacity` runs no model: weight bytes of the 7B and 30B-A3B thinkers with bf16 / int8 / int4 weights and the
sessions the rest of a 141 GB GPU holds with bf16 or int8 KV (`bench/quality/_quant_capacity.py`). Writes
`quantized_capacity.json`.

`--matmul` runs no model either: the CPU time of the quantised matmul against float32's on a layer's projection
shapes, at decode and prefill row counts (`bench/quality/_quant_matmul.py`). Writes `quantized_matmul.json`.

`--omni` runs a tiny random Qwen3-Omni thinker instead of SmolLM2: top-1 agreement and KL against float32 of int8 /
int4 g32 / int4 g128 weights and the int8 KV pool over a synthetic audiovisual session, and its greedy answers
(`bench/quality/_quant_omni.py`). Writes `quantized_omni.json` and `quantized_omni.png`.

`--serve` asks each variant a few questions through `omnijax.Chat` and through the official openai SDK against the
variant served by `omnijax.serve` (whole and streamed), and records whether the answers agree with each other and
with float32's (`bench/quality/_quant_serve.py`). Writes `quantized_serve.json` and `quantized_serve.png`.

    .venv/bin/python -m bench.quality.quantized --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out bench/quality/results
    .venv/bin/python -m bench.quality.quantized --kv --out bench/quality/results
    .venv/bin/python -m bench.quality.quantized --accuracy --llama-python /tmp/llvenv/bin/python --no-extra-bufts \
        --out bench/quality/results
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

import numpy as np

from bench import harness
from bench.quality import _common as common
from bench.quality import _quant_accuracy, _quant_capacity, _quant_matmul, _quant_omni, _quant_serve

VARIANTS = ("float32", "int8", "int4_g32", "gguf_kept")  # the default set of the timed run
ALL_VARIANTS = VARIANTS + ("int4_g64", "int4_g128")
SMOKE = dict(length=128, chunk=32, decode_tokens=4, prompt=16, rounds=2, kv_lengths=[128, 256], kv_budget=160,
             kv_keys=1, kv_chunk=64, matmul_rows=[1, 8], matmul_layers=1, omni_units=3, omni_budget=64,
             omni_policies=["no_slide"])
KV_POLICIES = ("no_slide", "omnipick", "sink_window", "unit_fifo", "streaming_llm")


def build_parser():
    p = harness.parser(__doc__)
    common.add_model_args(p)
    p.add_argument("--length", type=int, default=1024, help="tokens of Alice scored for the perplexity")
    p.add_argument("--chunk", type=int, default=64, help="tokens per streamed chunk while scoring")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens of each timed feed")
    p.add_argument("--decode-tokens", type=int, default=32, help="greedy tokens each timed feed answers")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=ALL_VARIANTS)
    p.add_argument("--kv", action="store_true", help="measure the int8 KV pool against the float pool instead")
    p.add_argument("--kv-lengths", type=int, nargs="+", default=[1024, 2048], help="--kv: tokens scored / fed")
    p.add_argument("--kv-budget", type=int, default=512, help="--kv: cells a bounded policy holds")
    p.add_argument("--kv-keys", type=int, default=3, help="--kv: pass keys per length")
    p.add_argument("--kv-chunk", type=int, default=128, help="--kv: tokens per pass-key chunk")
    p.add_argument("--kv-policies", nargs="+", default=["no_slide", "omnipick"], choices=KV_POLICIES)
    _quant_accuracy.add_args(p)
    _quant_capacity.add_args(p)
    _quant_matmul.add_args(p)
    _quant_omni.add_args(p)
    _quant_serve.add_args(p)
    return p


def check_args(args) -> None:
    for flag in ("length", "chunk", "page_size", "prompt", "decode_tokens", "rounds"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if "float32" not in args.variants:
        raise SystemExit("--variants must include float32 (the reference of every ratio)")
    for flag in ("kv_lengths", "kv_budget", "kv_keys", "kv_chunk"):
        value = getattr(args, flag)
        if min(value if isinstance(value, list) else [value]) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1, got {value}")


def convert_variant(source: common.ModelSource, name: str, work: Path, *, src: Path | None = None) -> Path | None:
    """The checkpoint of variant `name` (converted once into `work`) from `src` (default: the source's GGUF or
    Hugging Face folder), or None where it does not apply (kept GGUF blocks of a `--smoke` model, which has no GGUF).
    `q8_0_kept` and `f16` are `--accuracy`'s conversions of the Q8_0 / F16 GGUFs it writes (`src`)."""
    from omnijax.convert import QuantizeOptions, convert_checkpoint

    if name == "float32":
        return source.checkpoint
    kept = QuantizeOptions(keep_quantized=True)
    options = {"int8": QuantizeOptions("int8"), "int4_g32": QuantizeOptions("int4", 32),
               "int4_g64": QuantizeOptions("int4", 64), "int4_g128": QuantizeOptions("int4", 128),
               "gguf_kept": kept, "q8_0_kept": kept, "f16": QuantizeOptions()}[name]
    src = src or source.gguf or source.hf
    if src is None or (name == "gguf_kept" and source.gguf is None):
        return None
    stat = Path(src).stat()
    tag = hashlib.sha256(f"{Path(src).resolve()}:{stat.st_mtime_ns}:{name}".encode()).hexdigest()[:12]
    dst = work / f"{Path(src).stem}-{name}-{tag}"
    if not (dst / "omnijax.json").is_file():
        print(f"converting {src} -> {dst} ({name})", flush=True)
        convert_checkpoint(src, dst, progress=False, quantize=options, log=lambda _: None)
    return dst


def weight_bytes(model) -> tuple[int, int]:
    """`(all decoder parameter bytes, linear-weight bytes)` as loaded (stacked or per-layer storage alike)."""
    import jax
    from flax import nnx

    from omnijax.kernels.quant import QuantizedWeight
    from omnijax.models.decoder import DENSE_MLP

    pure = nnx.to_pure_dict(nnx.state(model.decoder))
    linear = {"q_proj", "k_proj", "v_proj", "o_proj", *DENSE_MLP}

    def size(a):
        return a.nbytes if isinstance(a, QuantizedWeight) else int(a.size) * a.dtype.itemsize

    flat = jax.tree_util.tree_flatten_with_path(pure, is_leaf=lambda a: isinstance(a, QuantizedWeight))[0]
    total = sum(size(a) for _, a in flat)
    lin = sum(size(a) for path, a in flat if linear & {getattr(k, "key", None) for k in path})
    return total, lin


def decode_cases(model, ids: list[int], args):
    """Two timed feeds of one session: a prompt answering `--decode-tokens` tokens, and the same prompt answering
    none. Returns `(cases, answered)`: name -> callable, and the answered token counts seen."""
    import omnijax
    from omnijax.chunks.spans import SpanKind
    from omnijax.models.frontend import units_for
    from omnijax.retention import NoSlide
    from omnijax.streaming.config import StreamConfig

    n = args.prompt + args.decode_tokens
    pages = -(-(n * (args.rounds + 2) * 2) // 16) + 4
    session = omnijax.Session(model, StreamConfig(policy=NoSlide(), num_pages=pages, page_size=16,
                                                  max_answer_tokens=args.decode_tokens))
    units = units_for(model)
    prompt = ids[:args.prompt]
    counter = iter(range(10 ** 6))
    answered: list[int] = []

    def feed(answer):
        out = session.feed(units.pad(units.text(prompt, next(counter), SpanKind.TEXT, answer_tokens=answer)))
        if answer:
            answered.append(int((np.asarray(out.tokens) >= 0).sum()))
        return out.logits

    return {"answer": lambda: feed(args.decode_tokens), "prompt": lambda: feed(0)}, answered


def main(argv=None):
    args = harness.parse(build_parser(), sys.argv[1:] if argv is None else argv, smoke=SMOKE)
    common.quiet_threads()
    out = harness.output_dir(args)
    check_args(args)
    if sum((args.kv, args.accuracy, args.capacity, args.matmul, args.omni, args.serve)) > 1:
        raise SystemExit("--kv, --accuracy, --capacity, --matmul, --omni and --serve are separate runs: give one")
    if args.capacity:
        return _quant_capacity.run(args, out)
    if args.matmul:
        return _quant_matmul.run(args, out)
    if args.omni:
        return _quant_omni.run(args, out)
    source = common.model_source(args)
    if args.serve:
        return _quant_serve.run(args, source, out, convert_variant)
    from bench.quality.perplexity import ppl, text_ids

    ids = text_ids(source.checkpoint, "alice29.txt", args.length)
    import omnijax
    from bench.quality._score import score_stream
    from omnijax.retention import NoSlide

    if args.kv:
        return kv_section(args, source, out)
    if args.accuracy:
        return _quant_accuracy.run(args, source, out, convert_variant, weight_bytes, _device())
    work = Path(args.work)
    results, models, cases = {}, {}, {}
    for name in args.variants:
        path = convert_variant(source, name, work)
        if path is None:
            print(f"  {name}: skipped (no GGUF blocks to keep: a --smoke model)", flush=True)
            continue
        model = omnijax.load(path)
        started = time.perf_counter()
        nll, _ = score_stream(model, np.asarray(ids), NoSlide(), chunk=args.chunk, cells=None,
                              page_size=args.page_size)
        total, lin = weight_bytes(model)
        results[name] = dict(checkpoint=str(path), ppl=ppl(nll), nll=nll.tolist(), bytes=total, linear_bytes=lin,
                             score_seconds=time.perf_counter() - started)
        print(f"  {name}: perplexity {ppl(nll):.4f} over {len(nll)} tokens, decoder {total / 1e6:.1f} MB "
              f"(linear weights {lin / 1e6:.1f} MB)", flush=True)
        models[name] = model
        feeds, answered = decode_cases(model, ids, args)
        cases[name + "/answer"], cases[name + "/prompt"] = feeds["answer"], feeds["prompt"]
        results[name]["answered"] = answered
    ms = harness.interleaved(cases, args.rounds, label="decode")
    base = None
    for name in results:
        answered = results[name]["answered"]
        per = (ms[name + "/answer"] - ms[name + "/prompt"]) / max(1, int(np.median(answered)))
        results[name]["decode_ms_per_token"] = per.tolist()
        results[name]["feed_ms"] = {k: ms[f"{name}/{k}"].tolist() for k in ("answer", "prompt")}
        if name == "float32":
            base = per
        results[name]["decode_ratio_vs_float32"] = harness.same_round_ratio(per, base) if base is not None else None
        # the whole answering feed (prompt + answers): never negative, unlike the difference on a noisy machine
        results[name]["feed_ratio_vs_float32"] = harness.same_round_ratio(ms[name + "/answer"], ms["float32/answer"])
    f32 = results["float32"]
    table = [dict(variant=n, ppl=r["ppl"], dppl=r["ppl"] - f32["ppl"], mb=r["bytes"] / 1e6,
                  lin=r["linear_bytes"] / 1e6, lin_ratio=r["linear_bytes"] / f32["linear_bytes"],
                  ms=float(np.median(r["decode_ms_per_token"])), ratio=r["decode_ratio_vs_float32"],
                  feed_ratio=r["feed_ratio_vs_float32"])
             for n, r in results.items()]
    print(f"\n{args.length} tokens of Alice, full context; decode: {args.decode_tokens} greedy tokens after a "
          f"{args.prompt}-token prompt, median of {args.rounds} interleaved rounds")
    harness.print_table(table, [("variant", "variant", ""), ("ppl", "ppl", ".4f"), ("d ppl", "dppl", "+.4f"),
                                ("decoder MB", "mb", ".1f"), ("linear MB", "lin", ".1f"),
                                ("linear / f32", "lin_ratio", ".3f"), ("ms/token", "ms", ".2f"),
                                ("time / f32", "ratio", ".2f"), ("feed / f32", "feed_ratio", ".2f")])
    header = dict(model=str(source.gguf or source.checkpoint), random_weights=source.tiny, text="alice29.txt",
                  length=args.length, chunk=args.chunk, prompt=args.prompt, decode_tokens=args.decode_tokens,
                  rounds=args.rounds, device=_device())
    harness.write_json(out, "quantized", dict(header, table=table, variants=results))
    plot(table, out)


def kv_section(args, source: common.ModelSource, out: Path) -> None:
    """`--kv`: perplexity and multi-turn pass key with a float and an int8 KV pool (module docstring)."""
    import omnijax
    from bench.quality import _stream
    from bench.quality._score import score_stream
    from bench.quality.perplexity import ppl, text_ids

    model = omnijax.load(source.checkpoint)
    longest = max(args.kv_lengths)
    ids = np.asarray(text_ids(source.checkpoint, "alice29.txt", longest))
    prompts = {(length, i): _stream.multi_turn(model, length, key, args.kv_chunk)
               for length in args.kv_lengths
               for i, key in enumerate(common.pass_keys(args.kv_keys, 1000 * length))}  # passkey.py's seed 0 keys
    rows = []
    for name in args.kv_policies:
        policy = _stream.policy_at(name, args.kv_budget)
        cells = None if name == "no_slide" else args.kv_budget
        for kv in ("float", "int8"):
            started = time.perf_counter()
            nll, _ = score_stream(model, ids, policy, chunk=args.chunk, cells=cells, page_size=args.page_size,
                                  kv_dtype=kv)
            row = dict(policy=name, kv_dtype=kv, nll=nll.tolist(), score_seconds=time.perf_counter() - started,
                       ppl={n: ppl(nll[:n]) for n in args.kv_lengths}, passkey=[])
            for (length, i), prompt in prompts.items():
                config = _stream.stream_config(policy, tokens=prompt.tokens, budget=args.kv_budget,
                                               chunk=args.kv_chunk, page_size=args.page_size).replace(kv_dtype=kv)
                o = _stream.run_session(model, prompt, config, pad_to=args.kv_chunk)
                row["passkey"].append(dict(length=length, key_index=i, key=prompt.key, tokens=prompt.tokens,
                                           answer=o.answer, correct=o.correct, key_cells_kept=o.key_cells_kept,
                                           key_cells=o.key_cells, peak_cells=o.peak_cells, seconds=o.seconds))
                print(f"  {name} {kv} pass key L={prompt.tokens} #{i}: {'right' if o.correct else 'wrong'} "
                      f"({o.answer[:30]!r}), key {o.key_cells_kept}/{o.key_cells} cells", flush=True)
            print(f"  {name} {kv}: perplexity " + ", ".join(f"{n}: {p:.4f}" for n, p in row["ppl"].items()),
                  flush=True)
            rows.append(row)
    table = kv_table(rows, args.kv_lengths)
    print(f"\nint8 vs float KV pool, {source.gguf or source.checkpoint}; bounded policies at {args.kv_budget} cells")
    cols = [("policy", "policy", ""), ("kv", "kv_dtype", "")]
    for n in args.kv_lengths:
        cols += [(f"ppl {n}", f"ppl_{n}", ".4f"), (f"d ppl {n}", f"dppl_{n}", "+.4f"),
                 (f"pass key {n}", f"passkey_{n}", "")]
    harness.print_table(table, cols + [("answers = float", "same_answers", ""),
                                       ("max |d nll|", "max_dnll", ".4f")])
    header = dict(model=str(source.gguf or source.checkpoint), random_weights=source.tiny, text="alice29.txt",
                  lengths=args.kv_lengths, budget=args.kv_budget, chunk=args.chunk, passkey_chunk=args.kv_chunk,
                  keys=args.kv_keys, device=_device())
    harness.write_json(out, "quantized_kv", dict(header, table=table, rows=rows))


def kv_table(rows: list[dict], lengths: list[int]) -> list[dict]:
    """One line per (policy, pool): perplexity per length and its change from the float pool, pass keys right per
    length, answers equal to the float pool's, and the largest per-token NLL change."""
    base = {r["policy"]: r for r in rows if r["kv_dtype"] == "float"}
    table = []
    for r in rows:
        f = base[r["policy"]]
        line = dict(policy=r["policy"], kv_dtype=r["kv_dtype"])
        for n in lengths:
            keys = [k for k in r["passkey"] if k["length"] == n]
            line.update({f"ppl_{n}": r["ppl"][n], f"dppl_{n}": r["ppl"][n] - f["ppl"][n],
                         f"passkey_{n}": f"{sum(k['correct'] for k in keys)}/{len(keys)}"})
        same = sum(a["answer"] == b["answer"] for a, b in zip(r["passkey"], f["passkey"]))
        line["same_answers"] = f"{same}/{len(r['passkey'])}"
        line["max_dnll"] = float(np.max(np.abs(np.asarray(r["nll"]) - np.asarray(f["nll"]))))
        table.append(line)
    return table


def _device() -> str:
    import jax

    return f"{jax.default_backend()}: {jax.devices()[0].device_kind}"


def plot(table: list[dict], out: Path) -> None:
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    names = [r["variant"] for r in table]
    for ax, key, label in zip(axes, ("ppl", "lin", "ratio"), ("perplexity (1K tokens)", "linear weights (MB)",
                                                              "decode time / float32")):
        ax.bar(names, [r[key] for r in table], color=[f"C{i}" for i in range(len(names))])
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    harness.save_png(fig, out, "quantized")


if __name__ == "__main__":
    main()
