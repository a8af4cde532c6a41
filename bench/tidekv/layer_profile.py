"""Where one TideKV layer step's time goes on the real model: per-part thunk times, thunk concurrency, thread shares.

One process, SmolLM2-135M-Instruct float32 (the GGUF `make smollm2` installs, converted as `vs_kvpress` converts it;
`--models DIR` reuses a folder holding `omnijax/`), random prompt embeddings of S tokens, the compiled
`omnijax.prefill.layer_major.layer_step` of layer 0 as `model.prefill(ids, selector=SnapKV(window=64,
pool_kernel=5), budgets=S // 2)` runs it (chunk 2,048, impl "xla"). Three readings of `--steps` warm calls:

    time      wall and CPU seconds per layer step (`getrusage`), and the cores it used (CPU / wall);
    threads   each thread's share of the process's CPU seconds over the steps (`/proc/self/task/*/stat`): how the
              work spreads over XLA:CPU's intra-op pool ("tf_XLAEigen") and the calling thread;
    trace     a `jax.profiler` trace of the steps: every executed XLA:CPU thunk's time, grouped by what it computes
              (from the compiled HLO: a thunk whose ops name the MLP's or the q/k/v/o projections' contraction
              counts there, with what XLA fused beside it: the SwiGLU product, RoPE's rotation of the projected
              rows; the blocked attention is every other thunk inside the loops nested in the chunk loop, SnapKV's
              selection its top-k, the rest norms, residuals, copies), the thunk count per step, and
              the share of the traced span during which 0, 1 or 2+ pool threads were running a thunk at once.

Thunk times are wall times of the thunks, so on a loaded machine they grow with the load; their proportions and the
concurrency are what carry over. `--smoke`: the tiny random llama GGUF of `bench.peers.first_token.smoke_models`,
S = 512, 2 steps (a check that the script runs, not a measurement).

    python -m bench.tidekv.layer_profile --length 4096 --steps 3
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time
from pathlib import Path

from bench import harness

GROUPS = ("MLP matmuls (gate, up, down)", "q / k / v / o projections", "attention (blocked online softmax)",
          "SnapKV selection", "norms, RoPE, residuals, copies")


def hlo_structure(text: str) -> dict:
    """Instruction name -> (opcode, op_name metadata of it and of what it calls, while-loop depth) of a compiled
    HLO module's text: the depth counts the while loops whose body (directly or through calls) holds it."""
    head = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{$")
    inst = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*.*?\s([\w\-]+)\((.*)$")
    comp_of, meta_of, parent, calls_of, own_meta = {}, collections.defaultdict(list), {}, {}, {}
    current = None
    for line in text.splitlines():
        m = head.match(line)
        if m:
            current = m.group(1)
            continue
        m = inst.match(line)
        if m is None or current is None:
            continue
        name, opcode, rest = m.groups()
        comp_of[name] = (current, opcode)
        meta = re.search(r'op_name="([^"]*)"', rest)
        own_meta[name] = meta.group(1) if meta else ""
        meta_of[current].append(own_meta[name])
        called = re.findall(r"(?:calls|body|condition|to_apply|branch_computations)=\{?%([\w.\-]+)", rest)
        calls_of[name] = called
        for c in called:
            parent.setdefault(c, (current, opcode == "while"))

    def depth(comp: str) -> int:
        d = 0
        while comp in parent:
            comp, is_while = parent[comp]
            d += is_while
        return d

    out = {}
    for name, (comp, opcode) in comp_of.items():
        inner = [m for c in calls_of[name] for m in meta_of.get(c, [])]
        out[name] = (opcode, " ".join([own_meta[name], *inner]), depth(comp))
    return out


def group_of(opcode: str, meta: str, depth: int) -> str:
    if "topk" in meta:
        return GROUPS[3]
    if "btd,di->bti" in meta or "bti,id->btd" in meta:
        return GROUPS[0]
    if "btd,de->bte" in meta or "bte,ed->btd" in meta:
        return GROUPS[1]
    if depth >= 2:
        return GROUPS[2]
    return GROUPS[4]


def thread_cpu() -> dict:
    """(thread id, name) -> CPU seconds of every thread of this process."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in glob.glob("/proc/self/task/*"):
        try:
            fields = Path(task, "stat").read_text().rsplit(")", 1)[1].split()
            out[(task.rsplit("/", 1)[1], Path(task, "comm").read_text().strip())] = (int(fields[11])
                                                                                     + int(fields[12])) / tick
        except FileNotFoundError:  # a thread that ended between the listing and the read
            continue
    return out


def profile(models: Path, S: int, steps: int) -> dict:
    import jax
    import jax.numpy as jnp

    import omnijax
    from omnijax.prefill import SnapKV
    from omnijax.prefill import layer_major as lm

    model = omnijax.load(models / "omnijax")
    c = model.config
    chunk = min(2048, -(-S // 512) * 512)
    x = jax.random.normal(jax.random.key(0), (1, S, c.hidden_size), c.jnp_dtype)
    positions = jnp.arange(S, dtype=jnp.int32)[None, None]
    params = lm.layer_params(model.decoder, 0)
    kw = dict(config=c, prompt_len=S, chunk=chunk, page=512, impl="xla", selector=SnapKV(window=64, pool_kernel=5),
              budget=S // 2, window=64, room=0)
    structure = hlo_structure(lm.layer_step.lower(params, x, positions, **kw).compile().as_text())
    bridge = x

    def step():
        nonlocal bridge
        bridge, cache = lm.layer_step(params, bridge, positions, **kw)
        jax.block_until_ready((bridge, cache))

    step()
    step()
    threads0, cpu0, start = thread_cpu(), harness.cpu_seconds(), time.perf_counter()
    for _ in range(steps):
        step()
    wall, cpu, threads1 = time.perf_counter() - start, harness.cpu_seconds() - cpu0, thread_cpu()
    spent = sorted(((threads1[k] - threads0.get(k, 0.0), k[1]) for k in threads1), reverse=True)
    total = sum(s for s, _ in spent) or 1.0
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(steps):
            step()
        jax.profiler.stop_trace()
        (path,) = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
        events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    leaves = [e for e in events if e.get("ph") == "X" and e.get("name") in structure
              and structure[e["name"]][0] not in ("while", "conditional", "call")]
    groups: collections.Counter = collections.Counter()
    for e in leaves:
        groups[group_of(*structure[e["name"]])] += e.get("dur", 0.0) / 1e3
    return {"length": S, "chunk": chunk, "steps": steps, "wall_ms": 1e3 * wall / steps, "cpu_ms": 1e3 * cpu / steps,
            "cores": cpu / wall, "load_avg": os.getloadavg()[0],
            "thread_shares": [{"thread": name, "share": s / total} for s, name in spent[:4] if s > 0],
            "thunks_per_step": len(leaves) / steps, "thunk_ms_per_step": sum(groups.values()) / steps,
            "groups_ms_per_step": {g: groups[g] / steps for g in GROUPS},
            "concurrency": concurrency(leaves)}


def concurrency(leaves: list[dict]) -> dict:
    """Shares of the span from the first thunk's start to the last one's end during which 0, 1 or 2+ threads were
    running a thunk."""
    edges = sorted([(e["ts"], 1, e["tid"]) for e in leaves] + [(e["ts"] + e.get("dur", 0.0), -1, e["tid"])
                                                                 for e in leaves])
    active: collections.Counter = collections.Counter()
    spans: collections.Counter = collections.Counter()
    last = None
    for t, delta, tid in edges:
        if last is not None:
            spans[min(2, sum(1 for n in active.values() if n > 0))] += t - last
        active[tid] += delta
        last = t
    total = sum(spans.values()) or 1.0
    return {"idle": spans[0] / total, "one_thread": spans[1] / total, "two_or_more": spans[2] / total}


def main(argv=None) -> int:
    p = harness.parser(__doc__)
    p.add_argument("--gguf", help="the GGUF file (default: the installed SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--models", help="a folder with an already converted omnijax/ checkpoint")
    p.add_argument("--length", type=int, default=4096, help="prompt length S")
    p.add_argument("--steps", type=int, default=3, help="warm layer steps timed, then traced")
    args = harness.parse(p, argv, smoke={"length": 512, "steps": 2})
    if args.length < 64 or args.steps < 1:
        p.error(f"--length must be at least the observation window (64) and --steps at least 1, got "
                f"{args.length} and {args.steps}")
    from bench.tidekv.vs_kvpress import checkpoints

    out = harness.output_dir(args)
    models = checkpoints(args, out)
    row = profile(models, args.length, args.steps)
    print(f"S={row['length']} layer step: wall {row['wall_ms']:.0f} ms, CPU {row['cpu_ms']:.0f} ms, cores "
          f"{row['cores']:.2f}, load {row['load_avg']:.1f}; {row['thunks_per_step']:.0f} thunks per step")
    print("threads: " + ", ".join(f"{t['thread']} {100 * t['share']:.0f} %" for t in row["thread_shares"]))
    print("thunk concurrency: " + ", ".join(f"{k} {100 * v:.0f} %" for k, v in row["concurrency"].items()))
    harness.print_table([{"group": g, "ms": ms, "share": ms / row["thunk_ms_per_step"]}
                         for g, ms in row["groups_ms_per_step"].items()],
                        [("part of the layer step", "group", "<40"), ("thunk ms", "ms", ".1f"),
                         ("share", "share", ".2f")])
    harness.write_json(out, "layer_profile", {"smoke": bool(args.smoke), **row})
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh(list(row["groups_ms_per_step"]), list(row["groups_ms_per_step"].values()))
    ax.invert_yaxis()
    ax.set_xlabel("thunk ms per layer step")
    ax.set_title(f"TideKV layer step, S = {row['length']}: {row['thunks_per_step']:.0f} thunks, one thread busy "
                 f"{100 * row['concurrency']['one_thread']:.0f} % of the span", fontsize=9)
    harness.save_png(fig, out, "layer_profile")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
