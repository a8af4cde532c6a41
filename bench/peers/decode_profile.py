"""Where omnijax's per-token decode time goes on a real model (SmolLM2-135M): the answer-block size, a per-op profile
of one decode step, and bfloat16 against float32 (issue 38 item 3).

Three measurements in one process, on the converted SmolLM2-135M-Instruct checkpoint (float32, the GGUF `make
smollm2` installs; `--checkpoint DIR` reuses a conversion), a `Session` as `Chat` runs it (OmniPick 512 / 384,
16-token pages, 68 pages), greedy decoding that runs through end-of-turn tokens (`free_running`) so every step
decodes all the tokens it asks for:

    blocks    ms per answer token, interleaved rounds, every call from the same state (a 40-token prompt fed): a
              continuation chunk (no input token) asking `tau` tokens from a session whose block is `tau` (16, 128),
              one asking 16 tokens from a session whose block is 128 (the block's static size alone), the prompt chunk
              itself carrying the first `tau` answer tokens (how `Chat.ask` feeds a question), and a whole answer of
              `--answer-tokens` tokens as `Chat.ask` decodes it with each block size (the issue's "per request");
    profile   `jax.profiler` trace of continuation steps (block 16): the time of every executed XLA:CPU thunk, grouped
              by what it computes (the tied embedding / lm_head matmul, the layers' matmuls, attention over the pages,
              norms and elementwise fusions, copies, the while loop's own bookkeeping), as ms per token;
    bf16      the same continuation step with the weights loaded as bfloat16 (`omnijax.load(dtype="bfloat16")`)
              against float32, interleaved.

`--smoke`: a tiny random llama GGUF converted on the fly, 1 round, short answers (a check that the script runs).

    python -m bench.peers.decode_profile --rounds 5
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import harness

PROMPT = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWrite a long story about a "
          "dragon who learns to paint, with many details.<|im_end|>\n<|im_start|>assistant\n")
BLOCKS = (16, 128)

# what an XLA:CPU thunk computes, from the HLO it runs (its own instruction and, for a fusion, the computation it
# calls): (group, test(opcodes, op_name metadata, shapes)), checked in this order
GROUPS = (
    ("lm_head (tied embedding) matmul", lambda ops, meta, shapes: "dot" in ops and VOCAB_DIM in shapes),
    ("weights sliced out of the layer stack (copies)", lambda ops, meta, shapes: "dynamic-slice" in ops
     and "dynamic_slice" in meta and "dot" not in ops),
    ("weight matmuls (q/k/v/o, MLP)", lambda ops, meta, shapes: "dot" in ops and _rank(shapes) == 2),
    ("attention over the pages", lambda ops, meta, shapes: "dot" in ops or "exponential" in ops),
    ("retention / paging bookkeeping (sort, cumsum)", lambda ops, meta, shapes: "sort" in ops or "cumsum" in meta
     or "argsort" in meta or "reduce-window" in ops),
    ("cache write (scatter)", lambda ops, meta, shapes: "scatter" in ops),
    ("gathers (embedding, pages)", lambda ops, meta, shapes: "gather" in ops),
    ("copies", lambda ops, meta, shapes: ops <= {"copy", "bitcast", "parameter"}),
)


def _rank(shapes: str) -> int:
    """The rank of an instruction's result (the first shape of `shapes`)."""
    m = re.match(r"\w+\[([^\]]*)\]", shapes)
    return 0 if m is None or not m.group(1) else m.group(1).count(",") + 1


VOCAB_DIM = ",49152]"  # set from the model's vocabulary in main()


def load_model(args, work: Path):
    """The float32 checkpoint to measure (converted once), and its path."""
    import omnijax
    from omnijax.demo import smollm2

    if args.checkpoint:
        path = Path(args.checkpoint)
    elif args.smoke and not args.gguf:
        from bench.peers.convert_gguf import write_tiny_gguf

        path, _ = smollm2.converted(write_tiny_gguf(work / "tiny.gguf"), work / "tiny_omnijax")
    else:
        path, _ = smollm2.converted(smollm2.find_gguf(args.gguf), Path(args.out) / "decode_profile_model")
    return omnijax.load(path), path


def config_for(block: int):
    import omnijax
    from omnijax.decoding import Greedy
    from omnijax.retention import OmniPick

    return omnijax.StreamConfig(policy=OmniPick(high_watermark=512, low_watermark=384, text_budget=128),
                                page_size=16, num_pages=68, max_answer_tokens=block,
                                decoding=Greedy(free_running=True))


class Bench:
    """A session per block size over one model, each call starting from a copy of the state after the prompt."""

    def __init__(self, model, blocks=BLOCKS):
        import jax
        import jax.numpy as jnp

        import omnijax
        from omnijax.chunks.spans import SpanKind
        from omnijax.models.frontend import units_for

        self.jax, self.jnp = jax, jnp
        self.units = units_for(model)
        tokenizer = model.tokenizer
        self.ids = tokenizer.encode(PROMPT) if tokenizer is not None else list(range(1, 41))
        self.ids = [i % model.config.vocab_size for i in self.ids]
        self.sessions, self.base = {}, {}
        for block in blocks:
            session = omnijax.Session(model, config_for(block))
            session.feed(self.units.pad(self.units.text(self.ids, 0, SpanKind.TEXT)))
            self.sessions[block], self.base[block] = session, jax.tree.map(jnp.copy, session.state)
        self.span_text = SpanKind.TEXT

    def reset(self, block: int) -> None:
        self.sessions[block].state = self.jax.tree.map(self.jnp.copy, self.base[block])

    def continuation(self, block: int, tokens: int) -> int:
        """Decodes `tokens` tokens in one continuation step; returns how many it decoded."""
        out = self.sessions[block].feed(self.units.continuation(1, tokens))
        return int((np.asarray(out.tokens[0]) >= 0).sum())

    def prompt_carrying(self, block: int) -> int:
        """Feeds the prompt again (a fresh unit) carrying `block` answer tokens, as `Chat.ask` does."""
        chunk = self.units.pad(self.units.text(self.ids, 1, self.span_text, answer_tokens=block))
        out = self.sessions[block].feed(chunk)
        return int((np.asarray(out.tokens[0]) >= 0).sum())

    def request(self, block: int, answer_tokens: int) -> int:
        """A whole answer as `Chat.ask` decodes it: the prompt chunk with the first block, continuations after."""
        chunk = self.units.pad(self.units.text(self.ids, 1, self.span_text,
                                               answer_tokens=min(block, answer_tokens)))
        out = self.sessions[block].feed(chunk)
        done = int((np.asarray(out.tokens[0]) >= 0).sum())
        while done < answer_tokens:
            out = self.sessions[block].feed(self.units.continuation(1, min(block, answer_tokens - done)))
            done += int((np.asarray(out.tokens[0]) >= 0).sum())
        return done


def time_cases(bench: Bench, cases: dict, rounds: int) -> dict:
    """`cases`: name -> (block, fn() -> tokens decoded); ms per token of each, interleaved, after one warm-up."""
    tokens = {}

    def case(name, block, fn):
        def prepare():
            bench.reset(block)
            return ()

        def run():
            tokens[name] = fn()
            return None

        return harness.Case(run, prepare)

    ms = harness.interleaved({n: case(n, b, f) for n, (b, f) in cases.items()}, rounds, label="blocks")
    return {n: {"tokens": tokens[n], "ms": ms[n].tolist(), "ms_per_token": (ms[n] / tokens[n]).tolist(),
                **{k: v / tokens[n] for k, v in harness.stats(ms[n]).items()}} for n in cases}


def hlo_ops(compiled_text: str) -> dict:
    """Instruction name -> (opcodes, op_name metadata, shapes) of a compiled HLO module's text; a fusion's or a
    call's include those of the computation it calls."""
    inst = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
    comps: dict = {}  # computation -> (opcodes, op_names, shapes)
    own = {}
    current = None
    for line in compiled_text.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{$", line)
        if head:
            current = comps.setdefault(head.group(1), (set(), [], []))
            continue
        m = inst.match(line)
        if m is None or current is None:
            continue
        name, shape, opcode, rest = m.groups()
        meta = re.search(r'op_name="([^"]*)"', rest)
        called = re.search(r"calls=%([\w.\-]+)", rest)
        current[0].add(opcode)
        current[1].append(meta.group(1) if meta else "")
        current[2].append(shape + " " + rest.split("),")[0])
        own[name] = (opcode, meta.group(1) if meta else "", shape + " " + rest.split("),")[0],
                     called.group(1) if called else None)
    ops = {}
    for name, (opcode, meta, shape, called) in own.items():
        inner = comps.get(called, (set(), [], [])) if called else (set(), [], [])
        ops[name] = ({opcode} | inner[0] if opcode not in ("fusion", "call") else set(inner[0]) or {opcode},
                     " ".join([meta, *inner[1]]), " ".join([shape, *inner[2]]), opcode)
    return ops


def group_of(ops: set, meta: str, shapes: str) -> str:
    for name, test in GROUPS:
        if test(ops, meta, shapes):
            return name
    return "norms, rope, sampling, elementwise"


def profile(bench: Bench, block: int, steps: int, work: Path) -> dict:
    """Per-thunk times of `steps` continuation steps of `block` tokens under `jax.profiler`, grouped; before the
    trace, the same steps untraced: wall and the process's CPU seconds (every thread's) per token, and the rate the
    weights stream at (every parameter is read once per token: the layers' products and the tied lm_head)."""
    import jax

    from omnijax.streaming import session as session_lib

    session = bench.sessions[block]
    bench.reset(block)
    chunk = session._checked(bench.units.continuation(1, block), session._step_config)
    compiled = session_lib._step.lower(session._graphdef, session._params, session.state, chunk,
                                       config=session._step_config).compile()
    ops = hlo_ops(compiled.as_text())
    bench.continuation(block, block)  # warm
    bench.reset(block)
    untraced, cpu_started, started = 0, time.process_time(), time.perf_counter()
    for _ in range(steps):
        untraced += bench.continuation(block, block)
    untraced_wall, untraced_cpu = time.perf_counter() - started, time.process_time() - cpu_started
    weights = sum(int(leaf.nbytes) for leaf in jax.tree.leaves(session._params))
    trace_dir = work / "trace"
    decoded = 0
    bench.reset(block)
    jax.profiler.start_trace(str(trace_dir), create_perfetto_trace=True)
    started = time.perf_counter()
    for _ in range(steps):
        decoded += bench.continuation(block, block)
    wall = time.perf_counter() - started
    jax.profiler.stop_trace()
    (path,) = glob.glob(str(trace_dir / "**" / "*.trace.json.gz"), recursive=True)
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    per_op: collections.Counter = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e["name"] in ops:
            per_op[e["name"]] += e.get("dur", 0.0) / 1e3  # ms
    # thunks nest (a while loop's time holds its body's): count only leaves, i.e. ops that are not loops / calls
    leaves = {n: ms for n, ms in per_op.items() if ops[n][3] not in ("while", "conditional", "call")}
    groups: collections.Counter = collections.Counter()
    for n, ms in leaves.items():
        groups[group_of(*ops[n][:3])] += ms
    top = [{"op": n, "opcode": ops[n][3], "group": group_of(*ops[n][:3]), "shape": ops[n][2].split()[0][:60],
            "source": ops[n][1].split()[0][-90:] if ops[n][1].split() else "",
            "ms_per_token": ms / decoded} for n, ms in sorted(leaves.items(), key=lambda kv: -kv[1])[:25]]
    return {"block": block, "steps": steps, "tokens": decoded, "wall_ms_per_token": 1e3 * wall / decoded,
            "untraced": {"wall_ms_per_token": 1e3 * untraced_wall / untraced,
                         "cpu_ms_per_token": 1e3 * untraced_cpu / untraced, "weights_mb": weights / 1e6,
                         "weights_gb_per_wall_s": weights * untraced / untraced_wall / 1e9,
                         "weights_gb_per_cpu_s": weights * untraced / untraced_cpu / 1e9},
            "thunk_ms_per_token": sum(leaves.values()) / decoded,
            "groups_ms_per_token": {g: ms / decoded for g, ms in groups.most_common()}, "top_ops": top,
            "cost_analysis": _cost(compiled)}


def _cost(compiled) -> dict:
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        return {k: float(cost[k]) for k in ("flops", "bytes accessed") if k in cost}
    except Exception as e:  # noqa: BLE001 - the figure is informative only; say why it is missing
        return {"error": f"{type(e).__name__}: {e}"}


def main(argv=None) -> int:
    p = harness.parser(__doc__)
    p.add_argument("--gguf", help="the GGUF file (default: the installed SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--checkpoint", help="an omnijax checkpoint to measure instead (already converted)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the block cases")
    p.add_argument("--answer-tokens", type=int, default=128, help="tokens of the whole-answer cases")
    p.add_argument("--profile-steps", type=int, default=4, help="continuation steps traced by the profiler")
    p.add_argument("--cache", default=None,
                   help="persistent compilation cache directory (default omnijax's; --smoke: the smoke run's)")
    p.add_argument("--skip-bf16", action="store_true", help="leave out the bfloat16 comparison")
    args = harness.parse(p, argv, smoke={"rounds": 1, "answer_tokens": 32, "profile_steps": 1})
    if args.rounds < 1 or args.answer_tokens < 1 or args.profile_steps < 1:
        p.error("--rounds, --answer-tokens and --profile-steps must be at least 1")
    out = harness.output_dir(args)
    import os

    import omnijax

    if not args.smoke:  # compile times are not measured here: reuse programs across runs
        omnijax.enable_compilation_cache(args.cache)
    load = os.getloadavg()
    result = {"smoke": bool(args.smoke), "rounds": args.rounds, "load_avg_before": load}
    with tempfile.TemporaryDirectory(prefix="decode_profile_") as tmp:
        work = Path(tmp)
        model, path = load_model(args, work)
        global VOCAB_DIM
        VOCAB_DIM = f",{model.config.vocab_size}]"
        bench = Bench(model)
        n = args.answer_tokens
        cases = {
            "continuation, block 16": (16, lambda: bench.continuation(16, 16)),
            "continuation, block 128": (128, lambda: bench.continuation(128, 128)),
            "16 tokens, block 128": (128, lambda: bench.continuation(128, 16)),
            "prompt + 16, block 16": (16, lambda: bench.prompt_carrying(16)),
            "prompt + 128, block 128": (128, lambda: bench.prompt_carrying(128)),
            f"answer of {n}, block 16": (16, lambda: bench.request(16, n)),
            f"answer of {n}, block 128": (128, lambda: bench.request(128, n)),
        }
        blocks = time_cases(bench, cases, args.rounds)
        result.update(checkpoint=str(path), blocks=blocks, load_avg_after_blocks=os.getloadavg())
        harness.write_json(out, "decode_profile", result)  # each part is kept as soon as it is measured
        harness.print_table([dict(case=k, **v) for k, v in blocks.items()],
                            [("case", "case", ""), ("tokens", "tokens", "d"), ("ms / token", "median", ".1f"),
                             ("p10", "p10", ".1f"), ("p90", "p90", ".1f")])
        prof = profile(bench, 16, args.profile_steps, work)
        result.update(profile=prof)
        harness.write_json(out, "decode_profile", result)
        bf16 = None
        if not args.skip_bf16:
            model16 = omnijax.load(path, dtype="bfloat16")
            bench16 = Bench(model16, blocks=(16,))
            both = {"float32": (bench, 16), "bfloat16": (bench16, 16)}
            ms = harness.interleaved({k: harness.Case(lambda b=b: b.continuation(16, 16),
                                                      lambda b=b: (b.reset(16), ())[1])
                                      for k, (b, _) in both.items()}, args.rounds, label="bf16")
            bf16 = {k: {**{s: v / 16 for s, v in harness.stats(ms[k]).items()}} for k in both}
            bf16["ratio_bf16_over_f32"] = harness.same_round_ratio(ms["bfloat16"], ms["float32"])
    load_after = os.getloadavg()
    print(f"profile of block-16 continuation steps: {prof['wall_ms_per_token']:.1f} ms / token wall, "
          f"{prof['thunk_ms_per_token']:.1f} in thunks")
    u = prof["untraced"]
    print(f"untraced: {u['wall_ms_per_token']:.1f} ms / token wall, {u['cpu_ms_per_token']:.1f} CPU ms; "
          f"{u['weights_mb']:.0f} MB of weights a token at {u['weights_gb_per_wall_s']:.1f} GB / s of wall, "
          f"{u['weights_gb_per_cpu_s']:.1f} GB / CPU s")
    for g, ms in prof["groups_ms_per_token"].items():
        print(f"  {g:45s} {ms:7.2f} ms / token")
    for row in prof["top_ops"][:10]:
        print(f"    {row['op']:32s} {row['ms_per_token']:6.2f}  {row['group'][:30]:30s} {row['shape']}")
    if bf16:
        print(f"bf16 / f32 per token (same round): {bf16['ratio_bf16_over_f32']:.2f} "
              f"({bf16['bfloat16']['median']:.1f} vs {bf16['float32']['median']:.1f} ms)")
    result.update(load_avg_after=load_after, bf16=bf16)
    harness.write_json(out, "decode_profile", result)
    plt = harness.pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.4))
    names = list(blocks)
    a1.barh(names, [blocks[k]["median"] for k in names], color="tab:blue")
    a1.set_xlabel("ms per answer token (median)")
    a1.tick_params(labelsize=7)
    groups = prof["groups_ms_per_token"]
    a2.barh(list(groups), list(groups.values()), color="tab:green")
    a2.set_xlabel("ms per token, block-16 decode step")
    a2.tick_params(labelsize=7)
    fig.tight_layout()
    harness.save_png(fig, out, "decode_profile")
    return 0


if __name__ == "__main__":
    sys.exit(main())
