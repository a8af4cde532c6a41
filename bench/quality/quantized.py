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

    .venv/bin/python -m bench.quality.quantized --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out bench/quality/results
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

import numpy as np

from bench import harness
from bench.quality import _common as common

VARIANTS = ("float32", "int8", "int4_g32", "gguf_kept")
SMOKE = dict(length=128, chunk=32, decode_tokens=4, prompt=16, rounds=2)


def build_parser():
    p = harness.parser(__doc__)
    common.add_model_args(p)
    p.add_argument("--length", type=int, default=1024, help="tokens of Alice scored for the perplexity")
    p.add_argument("--chunk", type=int, default=64, help="tokens per streamed chunk while scoring")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens of each timed feed")
    p.add_argument("--decode-tokens", type=int, default=32, help="greedy tokens each timed feed answers")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    return p


def check_args(args) -> None:
    for flag in ("length", "chunk", "page_size", "prompt", "decode_tokens", "rounds"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if "float32" not in args.variants:
        raise SystemExit("--variants must include float32 (the reference of every ratio)")


def convert_variant(source: common.ModelSource, name: str, work: Path) -> Path | None:
    """The checkpoint of variant `name` (converted once into `work`), or None where it does not apply (the kept GGUF
    blocks of a `--smoke` model, which has no GGUF)."""
    from omnijax.convert import QuantizeOptions, convert_checkpoint

    if name == "float32":
        return source.checkpoint
    options = {"int8": QuantizeOptions("int8"), "int4_g32": QuantizeOptions("int4", 32),
               "gguf_kept": QuantizeOptions(keep_quantized=True)}[name]
    src = source.gguf or source.hf
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
    """`(all decoder parameter bytes, linear-weight bytes)` as loaded."""
    import jax
    from flax import nnx

    from omnijax.kernels.quant import QuantizedWeight
    from omnijax.models.decoder import DENSE_MLP

    pure = nnx.to_pure_dict(nnx.state(model.decoder))
    linear = ("q_proj", "k_proj", "v_proj", "o_proj", *DENSE_MLP)

    def size(a):
        return a.nbytes if isinstance(a, QuantizedWeight) else int(a.size) * a.dtype.itemsize

    total = sum(size(a) for a in jax.tree.leaves(pure, is_leaf=lambda a: isinstance(a, QuantizedWeight)))
    lin = sum(size(pure["layers"][k]) for k in linear if k in pure["layers"])
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
    source = common.model_source(args)
    from bench.quality.perplexity import ppl, text_ids

    ids = text_ids(source.checkpoint, "alice29.txt", args.length)
    import omnijax
    from bench.quality._score import score_stream
    from omnijax.retention import NoSlide

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


def _device() -> str:
    import jax

    return f"{jax.default_backend()}: {jax.devices()[0].device_kind}"


def plot(table: list[dict], out: Path) -> None:
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    names = [r["variant"] for r in table]
    for ax, key, label in zip(axes, ("ppl", "lin", "ratio"), ("perplexity (1K tokens)", "linear weights (MB)",
                                                              "decode time / float32")):
        ax.bar(names, [r[key] for r in table], color=["grey", "tab:blue", "tab:orange", "tab:green"][:len(names)])
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    harness.save_png(fig, out, "quantized")


if __name__ == "__main__":
    main()
