"""Kernels per call on an NVIDIA H200, counted on a machine without a GPU.

XLA:GPU can compile for a described device with no GPU present (jax's compile-only topology with a
`GpuTargetConfigProto`, `TARGET` below: H200 facts, sm_90). The optimized HLO it returns is what the GPU would run,
after fusion and scheduling, so the launches of a call can be counted here: fusions, custom calls (Triton kernels),
copies, while loops (each iteration launches its body and reads the loop predicate back on the host) and
conditionals (one predicate read-back), and the copies of at least 2**20 elements among them (a dynamic slice in a
loop, such as a layer's weights sliced from a stacked array in a layer scan, is a memcpy on the GPU). Counts are
not timings, but on a GPU a small call's time is mostly its launches and read-backs, so they tell which version of
a migration or of a layer's attention launches less.

Calls counted:
- the paging modes (`omnipage.tile_skip`, `omnipage.ordered_suffix`, `eager.compact`) on a donated 28-layer cache of
  the Qwen2.5-Omni-7B shapes (48 pages of 64 slots, 4 kv heads, head dim 128, float32), as in
  `bench/omnitide/attention_kernel.py`;
- one layer of attention inside a 28-layer loop (`attention_kernel.layered`), bfloat16, prefill (124 queries) and
  decode (1 query), `impl="pallas"` (the Triton kernel) and `impl="xla"`, with the cache view indexed once before
  the loop (as a model does) and without (every layer derives the page index again), and the Triton kernel's 28
  calls unrolled into straight-line code (`attention_kernel.py --unroll`);
- a one-token k projection of the 7B shapes (3,584 -> 512, bfloat16) with the weight `[in, out]` (the decoder's
  layout) and `[out, in]`: XLA:GPU writes the float32 product out between a multiply and a reduction in the first;
- a whole streaming step (`stream.chunk_step`) of Qwen2.5-Omni-7B in bfloat16 with abstract weights on a 124-token
  unit, OmniPick + tile_skip, with the Triton kernel and with impl="xla", its state donated (as `Session` and the
  serving engine do), without and with a 4-token answer;
- the decoder's layer loop alone (`Decoder.run_layers`, 8 layers of the 7B shapes, bfloat16, the Triton kernel),
  scanned and unrolled, on a 124-token chunk and on one token: the GPU run of `bench/omnitide/layer_loop.py`.

Set-up (not part of the test extras: the CUDA plugin wheels take about 5.6 GB), in a separate virtualenv:
    python3.11 -m venv /tmp/census && /tmp/census/bin/pip install "jax[cuda12]==0.10.2" flax==0.12.8 matplotlib
    /tmp/census/bin/python -m bench.omnitide.gpu_census [--root DIR] [--out bench/out]
`--smoke` (`--target cpu --match 'k projection'`) compiles for this machine's CPU instead: a check that the script
runs without the CUDA plugin, not GPU facts.
`--root DIR` compiles the `omnijax` and `omnijax.kernels` of another checkout (e.g. a `git worktree` of an older
commit; calls its library cannot build are reported as such), so versions can be compared side by side: the census
then runs in a child process, this module started with `python -m` in DIR (`harness.checkout_env`). A newer jax (0.11,
Python 3.12; the XLA of the GPU machine this project was timed on) compiles every row as well: it lowers the Pallas
kernel for the H200 named as the abstract device of an abstract mesh.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import math
import os
import re
import subprocess
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host runs nothing on a GPU; the CUDA plugin only compiles
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver to check against

from bench import harness  # noqa: E402

TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024  threads_per_warp: 32  threads_per_core_limit: 2048
  shared_memory_per_block: 49152  shared_memory_per_block_optin: 232448  shared_memory_per_core: 233472
  registers_per_core_limit: 65536  registers_per_block_limit: 65536
  core_count: 132  fpus_per_core: 128  clock_rate_ghz: 1.98
  block_dim_limit_x: 2147483647  block_dim_limit_y: 65535  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000  l2_cache_size: 52428800  device_memory_size: 151397597184
  cuda_compute_capability { major: 9 minor: 0 }
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
device_description_str: "NVIDIA H200"
"""
LAUNCHES = ("fusion", "fusion-start", "custom-call", "copy", "copy-start", "while", "conditional", "sort", "scatter",
            "gather")  # an async op counts once, at its start
_COMPUTATION = re.compile(r"^(ENTRY )?%([\w.\-]+) \(.*\{\s*$")
_OPCODE = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = .*? ([a-z][a-z0-9\-]*)\(")
_LOOP = re.compile(r" while\(.*condition=%([\w.\-]+), body=%([\w.\-]+)")
_SHAPE = re.compile(r"= \(*[a-z0-9]+\[([0-9,]*)\]")
BIG = 1 << 20  # elements: a copy this large moves K/V pages or weights, not bookkeeping


def census(hlo: str) -> dict:
    """Launch-level op counts of optimized HLO: `once` (the entry computation and conditional branches) and
    `per_iteration` (while bodies and conditions), fusion bodies and reducers excluded."""
    bodies, name = {}, None
    for line in hlo.splitlines():
        if (m := _COMPUTATION.match(line)):
            name = "ENTRY" if m.group(1) else m.group(2)
            bodies[name] = []
        elif name is not None and line.strip() == "}":
            name = None
        elif name is not None:
            bodies[name].append(line)
    nested = {called for lines in bodies.values() for line in lines
              for called in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", line)}
    loops = {c for lines in bodies.values() for line in lines for c in (_LOOP.findall(line) or [()])[0]}
    once, per_iteration, big_copies = collections.Counter(), collections.Counter(), 0
    for name, lines in bodies.items():
        if name in nested:
            continue
        counter = per_iteration if name in loops else once
        for line in lines:
            if (m := _OPCODE.match(line)) and m.group(1) in LAUNCHES:
                counter[m.group(1)] += 1
                # A copy, or a fusion that materialises a (dynamic) slice: a memcpy of a layer's weights in a loop,
                # or, unrolled, static slices of a stacked weight (possibly converted) written out before their dot.
                copies = m.group(1) == "copy" or re.search(r"calls=%fused_(dynamic_)?slice", line)
                if copies and (shape := _SHAPE.search(line)) and \
                        math.prod(int(n) for n in shape.group(1).split(",") if n) >= BIG:
                    big_copies += 1
    return {"once": dict(once), "per_iteration": dict(per_iteration), "big_copies": big_copies,
            "launches_once": sum(once.values()), "launches_per_iteration": sum(per_iteration.values())}


def _abstract_h200():
    """A context naming the H200 as the abstract device, where this jax has one (0.11 lowers Pallas GPU kernels only
    for a present GPU or such a device; 0.10 takes the topology's device)."""
    import contextlib
    import inspect

    import jax
    from jax._src import mesh as mesh_lib

    if "abstract_device" not in inspect.signature(jax.sharding.AbstractMesh).parameters:
        return contextlib.nullcontext()
    device = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))


def compile_for_h200(fn, *args, donate: tuple[int, ...] = ()) -> str:
    import jax
    from jax.experimental import topologies

    device = topologies.get_topology_desc("1x1x1", platform="cuda", target_config=TARGET, topology="1x1x1").devices[0]
    on_device = jax.sharding.SingleDeviceSharding(device)
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_device), args)
    jitted = jax.jit(fn, donate_argnums=donate)
    with _abstract_h200():
        return jitted.trace(*args).lower().compile().as_text()


def compile_for_cpu(fn, *args, donate: tuple[int, ...] = ()) -> str:
    """The same count on this machine's CPU backend (`--target cpu`: a check that the script runs; not GPU facts)."""
    import jax

    return jax.jit(fn, donate_argnums=donate).trace(*args).lower().compile().as_text()


def calls(match: str = ""):
    """(name, fn, abstract args, donated argument numbers) of every counted call; the whole steps and layer loops
    (7B abstract models: seconds each to build) only where their name contains `match`."""
    import jax
    import jax.numpy as jnp

    from bench.omnitide.attention_kernel import MODE_FNS, OMNI_POOL, PAGE, D, G, H, layered
    from omnijax.kernels.block_sparse_attention import block_sparse_attention
    from omnijax.kv import attention, paged

    layers, N, P = 28, OMNI_POOL, PAGE
    kv = jax.eval_shape(lambda: paged.init(num_layers=layers, num_kv_heads=G, head_dim=D, num_pages=N, page_size=P))
    out = [(f"migration {m}", fn, (kv,), (0,)) for m, fn in MODE_FNS.items()]

    def pallas(q, k, v, view):  # `attention_kernel.pallas_attend`, without `index=` where an older library lacks it
        indexed = {"index": view.pages} if getattr(view, "pages", None) is not None else {}
        return block_sparse_attention(q, k, v, view.page_table, view.slot_valid, view.slot_order, view.q_order,
                                      interpret=False, **indexed)

    s = lambda shape, dtype=jnp.int32: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    for phase, T in (("prefill", 124), ("decode", 1)):
        view = attention.CacheView(write_slots=s((1, T)), page_table=s((1, N)), slot_valid=s((N, P), jnp.bool_),
                                   slot_order=s((N, P)), q_order=s((1, T)))
        views = {"per layer": view}
        if hasattr(attention, "index_pages"):
            views["once"] = jax.eval_shape(attention.index_pages, view)
        for impl, attend in (("pallas", pallas), ("xla", lambda *a: attention.attend(*a, impl="xla"))):
            for how, v in views.items():
                args = (s((1, T, H, D), jnp.bfloat16), s((N, P, G, D), jnp.bfloat16), s((N, P, G, D), jnp.bfloat16), v)
                out.append((f"attention {impl} {phase}, page index {how}", layered(attend, layers), args, ()))
                if how == "once" and impl == "pallas":  # `attention_kernel.py --unroll`: launches once = 28 layers'
                    out.append((f"attention {impl} {phase}, index once, unrolled", layered(attend, layers, True),
                                args, ()))
    for layout, spec, shape in (("[in, out]", "btd,de->bte", (3584, 512)),  # one token, 3584 -> 512
                                ("[out, in]", "btd,ed->bte", (512, 3584))):
        project = lambda x, w, spec=spec: jnp.einsum(spec, x, w, preferred_element_type=jnp.float32).astype(x.dtype)  # noqa: E731
        out.append((f"decode k projection, weight {layout}", project,
                    (s((1, 1, 3584), jnp.bfloat16), s(shape, jnp.bfloat16)), ()))
    for impl in ("pallas", "xla"):
        for name, answer in ((f"chunk step {impl} (7B bf16, OmniPick, tile_skip)", 0),
                             (f"chunk step {impl}, 4-token answer", 4)):
            if match in name:
                out.append((name,) + chunk_step_call(impl, answer=answer))
    for phase, T in (("prefill", 124), ("decode", 1)):
        for unroll in (False, True):
            name = f"layer loop {'unrolled' if unroll else 'scan'} {phase} (8 layers 7B bf16)"
            if match in name:
                out.append((name,) + layer_loop_call(T, unroll))
    return out


def layer_loop_call(tokens: int, unroll: bool, layers: int = 8):
    """`Decoder.run_layers` (scanned or unrolled) of `layers` Qwen2.5-Omni-7B layers in bfloat16 (abstract weights)
    on `tokens` new tokens over 2,048 cached ones, impl="pallas", the K/V stacks donated:
    `bench/omnitide/layer_loop.py`'s GPU run, compiled here."""
    from unittest import mock

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import omnijax
    from bench.omnitide.layer_loop import reserve_view
    from omnijax.models.config import QWEN2_5_OMNI_7B
    from omnijax.streaming.step import init_state

    cfg = QWEN2_5_OMNI_7B.replace(dtype="bfloat16", num_layers=layers, vocab_size=1024)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: omnijax.Decoder(cfg)))
    kv = init_state(cfg, num_pages=-(-(2048 + tokens) // 64) + 1, page_size=64).kv
    kv, _, _ = reserve_view(kv, 0, 2048, cfg.position_axes)
    _, view, positions = reserve_view(kv, 2048, tokens, cfg.position_axes)

    def run(params, x, k_pages, v_pages):
        model = nnx.merge(graphdef, params)
        with mock.patch.object(jax, "default_backend", lambda: "gpu"):  # the kernel, not its interpreter
            hidden, k_pages, v_pages, _ = model.run_layers(x, positions, view, k_pages, v_pages, impl="pallas",
                                                           unroll=unroll)
        return hidden, k_pages, v_pages

    x = jax.ShapeDtypeStruct((1, tokens, cfg.hidden_size), jnp.bfloat16)
    return run, (params, x, kv.k, kv.v), (2, 3)


def chunk_step_call(impl, answer=0):
    """`stream.chunk_step` of Qwen2.5-Omni-7B in bfloat16 (abstract weights) on a 124-token unit: prefill through 28
    layers (`impl` attention), OmniPick's trim and tile_skip's migration under their `lax.cond`s, then `answer`
    greedy tokens (a while loop whose every iteration runs the 28 layers on one token)."""
    import importlib
    from unittest import mock

    import jax
    from flax import nnx

    import omnijax
    from omnijax.models.config import QWEN2_5_OMNI_7B
    from omnijax.retention import OmniPick
    from omnijax.testing import synthetic

    stream = importlib.import_module("omnijax.streaming.session")
    cfg = QWEN2_5_OMNI_7B.replace(dtype="bfloat16")
    graphdef, params = nnx.split(nnx.eval_shape(lambda: omnijax.Decoder(cfg)))
    chunk = jax.tree.map(lambda x: x[1], synthetic.qwen_av_session(3, vocab_size=cfg.vocab_size))
    chunk = dataclasses.replace(chunk, answer_tokens=chunk.answer_tokens + answer)
    state = jax.eval_shape(lambda: stream.init_state(cfg, num_pages=48, page_size=64))

    def step(params, state, chunk):
        model = nnx.merge(graphdef, params)
        # `attention.attend` runs the kernel interpreted when the default backend is the CPU, as it is here.
        with mock.patch.object(jax, "default_backend", lambda: "gpu"):
            return stream.chunk_step(model, state, chunk, policy=OmniPick(), max_answer_tokens=answer, impl=impl,
                                     paging="tile_skip")

    return step, (params, state, chunk), (1,)  # the state is donated, as `Session` and the serving engine do


def library_root() -> Path:
    """The checkout whose `omnijax` this process imports (found, not imported)."""
    return Path(importlib.util.find_spec("omnijax").origin).resolve().parents[1]


def in_checkout(args) -> int:
    """Runs this census in a child process whose working directory, and so whose `omnijax`, is `args.root`.

    Args:
        args: the parsed command line; `--out` is passed on as an absolute path.

    Returns:
        The child's exit status (its output goes straight to this process's).
    """
    cmd = harness.module_command(__spec__.name, "--out", Path(args.out).resolve(), "--match", args.match,
                                 "--target", args.target)
    return subprocess.run(cmd, cwd=args.root, env=harness.checkout_env()).returncode


def main(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument("--root", type=Path, help="checkout whose omnijax and omnijax.kernels are compiled "
                        "(default: the one this process imports)")
    parser.add_argument("--match", default="", help="count only the calls whose name contains this")
    parser.add_argument("--target", choices=["h200", "cpu"], default="h200",
                        help="compile for the described H200 (needs the CUDA plugin) or for this CPU (a check)")
    args = harness.parse(parser, argv, smoke=dict(target="cpu", match="k projection"))
    if args.root is not None and args.root.resolve() != library_root():
        return in_checkout(args)
    compile_for = compile_for_h200 if args.target == "h200" else compile_for_cpu
    import jax

    root = str(library_root())
    rows, start = [], time.perf_counter()
    print(f"jax {jax.__version__}, library from {root}, target: H200 (sm_90), compile only")
    print(f"{'call':<46} {'once':>5} {'loop':>5} {'big':>5}  details (loop: launches per iteration of its while loops, "
          "nested ones summed; big: copies of K/V pages or weights, dynamic slices in loops included)")
    for name, fn, call_args, donate in calls(args.match):
        if args.match not in name:
            continue
        try:
            row = {"call": name, **census(compile_for(fn, *call_args, donate=donate))}
        except Exception as e:  # an older checkout may lack an argument this call passes
            row = {"call": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
            print(f"{name:<46} {'-':>5} {'-':>5} {'-':>5}  {row['error']}")
        else:
            print(f"{name:<46} {row['launches_once']:>5} {row['launches_per_iteration']:>5} {row['big_copies']:>5}  "
                  f"{row['once']} | {row['per_iteration']}")
        rows.append(row)
    out = harness.output_dir(args)
    summary = {"jax": jax.__version__, "root": root, "target": TARGET if args.target == "h200" else "cpu",
               "rows": rows, "runtime_s": time.perf_counter() - start}
    print(f"total runtime {summary['runtime_s']:.0f} s")
    stem = "gpu_census" if args.target == "h200" else "gpu_census_cpu"
    harness.write_json(out, stem, summary, indent=2)
    plot([r for r in rows if "error" not in r], out, stem)


def plot(rows, out, stem):
    fig, ax = harness.pyplot().subplots(figsize=(9, 0.35 * len(rows) + 1.2))
    y = range(len(rows))
    once = [r["launches_once"] for r in rows]
    ax.barh(y, once, color="C0", label="launched once per call")
    ax.barh(y, [r["launches_per_iteration"] for r in rows], left=once, color="C1",
            label="per iteration of a while loop (a predicate read-back each)")
    ax.set_yticks(list(y), [r["call"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("kernel launches (optimized XLA:GPU HLO, H200 target, compiled without a GPU)")
    ax.legend(fontsize=8)
    harness.save_png(fig, out, stem)


if __name__ == "__main__":
    raise SystemExit(main())
