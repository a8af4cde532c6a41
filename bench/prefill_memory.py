"""Transient construction memory of post-prefill SnapKV vs TideKV at 8K–64K prompts, and TideKV's TTFT overhead
(seed 001 §6.2/§6.6: 83.89 % lower transient construction footprint at 64K, +1.06–4.17 % TTFT).

Both methods build the *same* compressed cache (SnapKV, window 64, pooling kernel 5, the blockwise "xla" scorer, the
same uniform budget per KV head per layer); they differ only in the schedule:
    post-prefill  `token_major_prefill(chunk=None)`: one-shot prefill of every layer (all layers' full KV alive at the
                  end), then SnapKV selection layer by layer. Also `post-prefill chunked` (`chunk=C`, token-major
                  chunked prefill, still all layers' full KV alive before selection) as a second, stronger baseline:
                  it has chunk-bounded activations, so its gap to TideKV is the all-layer KV residency alone.
    TideKV        `tidekv_prefill`: a host loop over layers calling the jitted `layer_step`, which donates the hidden
                  bridge `[B, S, D]` and holds one layer's full KV and one chunk's activations.
    layer-wise one-shot (Method A only) `layer_step` with chunk = S: each layer runs the whole prompt at once and is
                  compressed at its end, i.e. the schedule of the paper's Hugging Face SnapKV baseline (one layer's
                  full KV, whole-prompt activations), which the paper's 83.89 % is measured against.
    post floor    (analytic) what any post-prefill schedule must hold however well it is chunked: the caller's
                  embeddings + the final hidden states + every layer's full K and V.

Definition. Weights and the final compressed cache are excluded; *transient construction memory* is everything
else live at the peak: the prompt embeddings the caller holds, padded copies, the bridge / hidden states, full KV,
window queries, attention/MLP activations and selection temporaries. For TideKV the finished layers' compressed
caches are part of the final cache and do not count; for post-prefill the same holds for the caches packed so far.

Method A (no execution, default Qwen2.5-Omni-7B layer shapes: 28 layers, hidden 3584, 28 heads / 4 KV heads, head
dim 128, intermediate 18944, bfloat16): the jitted programs are lowered with `jax.ShapeDtypeStruct` arguments and
compiled, and `compile().memory_analysis()` gives argument / output / alias / temp bytes. XLA_FLAGS
`--xla_cpu_experimental_ynn_fusion_type=` is set before jax is imported, otherwise XLA:CPU's fused matmul regions
hide their buffers. Weights are given to the compiler as float32 arguments: XLA:CPU computes bf16 dots in f32 and,
with bf16 weight arguments, keeps f32 copies of them as temps (26 GB for the stacked 28-layer one-shot program), a
CPU-backend artefact unrelated to cache construction; activations, KV and hidden states stay bf16. Phases:
    TideKV       x (caller's embeddings) + [layer_step: non-weight arguments (bridge, positions; the bridge output
                 aliases its argument) + temp + outputs other than the bridge and the layer cache]
    post-prefill max of  (1) x + [_token_major: non-weight arguments (padded x copy, positions) + temp + outputs
                 (hidden, every layer's K and V, window queries)]
                 and (2) selection of one layer: x + padded x + hidden + all K/V + window queries + the layer's K/V
                 slices (`k_all[l, :, :S]` copies) + [select+pack jitted: temp].
The one-shot program scans the stacked weights and XLA:CPU materialises each layer's weight slices in its temp; they
are weight-derived, so they are read from the buffer assignment (`--xla_dump_to`) and subtracted (column "w-slices");
the raw figure is kept in the JSON. Largest temp buffers of every program are kept in the JSON too.

Method B (execution, narrow model: 4 layers, hidden 512, 8 heads / 2 KV heads, head dim 64, intermediate 1376,
mrope (8, 12, 12), vocab 1024, float32, random init), same selector and budget, default XLA flags (not the
memory-analysis flag). Per S:
    prime    for each method a process AOT-compiles its large jitted programs (`_token_major` + the SnapKV scorer, or
             `layer_step`) into a persistent compilation cache (a temp dir) and runs the method once with those
             programs replaced by zero outputs, which compiles and caches the small eager ops around them; compiler
             memory would otherwise dominate the small TideKV peak
    base     a fresh process that only builds the model and the prompt: its VmHWM
    memory   per method a fresh process builds the same, runs the prefill once (every program comes from the cache;
             hits and misses are logged and kept in the JSON) and reads VmHWM from /proc/self/status;
             transient RSS = that VmHWM minus base's (it still includes one-time costs of a first call: tracing,
             lowering for the cache key, loading executables)
    timing   one process (no persistent cache: it compiles in its warm-up round) runs every method once (warm-up),
             then `--repeats` rounds that run every method once each, interleaved, the order rotated from round to
             round; TTFT = prefill to the last logits plus compression, `block_until_ready` on logits and cache;
             medians, and the TTFT ratios are medians of same-round ratios (robust to the machine's speed drifting).

Method B's default lengths are 4K and 8K: this 2-core CPU runs the narrow model at ~20 GFLOP/s, and one-shot
prefill (whose paged attention visits every page for every query: no causal skipping) costs tens of seconds per run
at 8K and grows with S^2, so 16K/32K with a memory run, a warm-up and 3 timed runs per method do not fit a 10-minute
run; `--append` merges separate runs (e.g. `--skip-compiled --rss-seq 16384 --append`) into one JSON/PNG.

Run: `python bench/prefill_memory.py [--seq 8192 16384 32768 65536] [--rss-seq 4096 8192] [--budget 2048]
[--chunk 2048] [--repeats 3] [--skip-rss | --skip-compiled] [--out bench/out]`
(`--skip-rss` writes prefill_memory_compiled.{json,png}, `--skip-compiled` prefill_memory_rss.{json,png}.)
"""

from __future__ import annotations

import os
import sys
import tempfile

_ORIG_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")
if "--worker" not in sys.argv:  # Method A process: count fused buffers, dump buffer assignments for the breakdown
    _DUMP_DIR = tempfile.mkdtemp(prefix="prefill_memory_dump_")
    os.environ["XLA_FLAGS"] = " ".join([_ORIG_XLA_FLAGS, "--xla_cpu_experimental_ynn_fusion_type=",
                                        f"--xla_dump_to={_DUMP_DIR}",
                                        "--xla_dump_hlo_module_re=layer_step|token_major|select_pack"]).strip()

import argparse  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from omnijax.config import QWEN2_5_OMNI_7B, DecoderConfig  # noqa: E402

GiB, MiB = 2.0 ** 30, 2.0 ** 20
NARROW = DecoderConfig(vocab_size=1024, hidden_size=512, intermediate_size=1376, num_layers=4, num_heads=8,
                       num_kv_heads=2, head_dim=64, rope_theta=1e6, mrope_section=(8, 12, 12), dtype="float32")
PAGE = 512


# --------------------------------------------------------------------------------------------------------------------
# Method A: compiled memory analysis
# --------------------------------------------------------------------------------------------------------------------


def weight_structs(cfg: DecoderConfig) -> dict:
    """Stacked layer weights `[L, ...]` as float32 `ShapeDtypeStruct`s (see the docstring for why float32)."""
    from flax import nnx

    from omnijax.models.decoder import Decoder

    abstract = nnx.eval_shape(lambda: Decoder(cfg))
    return {n: jax.ShapeDtypeStruct(v.get_value().shape, jnp.float32) for n, v in vars(abstract.layers).items()
            if isinstance(v, nnx.Param)}


def nbytes(tree) -> int:
    return int(sum(np.prod(s.shape) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(tree)))


def kv_bytes(layer_cache) -> int:
    return nbytes((layer_cache.k, layer_cache.v))


def stats(compiled) -> dict:
    m = compiled.memory_analysis()
    return {"argument": int(m.argument_size_in_bytes), "output": int(m.output_size_in_bytes),
            "alias": int(m.alias_size_in_bytes), "temp": int(m.temp_size_in_bytes)}


def temp_values(module: str, weight_shapes: set) -> dict:
    """From the newest buffer-assignment dump of `module`: the largest values of the preallocated temp and the total
    size of weight-slice copies (values whose f32 shape is one layer's weight shape)."""
    files = sorted(glob.glob(os.path.join(_DUMP_DIR, f"*{module}*after_optimizations-buffer-assignment.txt")),
                   key=os.path.getmtime)
    if not files:
        return {"largest": [], "weight_slices": 0}
    text = Path(files[-1]).read_text()
    block = re.search(r"^allocation \d+: size \d+, preallocated-temp:\n(.*?)(?=^allocation |\Z)", text, re.S | re.M)
    values = {}
    for name, size, dtype, shape in re.findall(r"value: <\d+ (\S+) @0> \(size=(\d+),offset=\d+\): (\w+)\[([\d,]*)\]",
                                               block.group(1) if block else ""):
        values.setdefault((name, dtype, shape), int(size))
    largest = sorted(values.items(), key=lambda kv: -kv[1])[:8]
    w = sum(size for (name, dtype, shape), size in values.items()
            if dtype == "f32" and tuple(int(s) for s in shape.split(",") if s) in weight_shapes
            and "slice" in name)
    for f in files:
        os.remove(f)
    return {"largest": [f"{dtype}[{shape}] {name}: {size / MiB:.0f} MiB" for (name, dtype, shape), size in largest],
            "weight_slices": int(w)}


def compile_tidekv(cfg, S, *, budget, chunk, selector, weights):
    from omnijax.prefill.layer_major import layer_step, padded_length

    Sp = padded_length(S, chunk, PAGE)
    one = {n: jax.ShapeDtypeStruct(w.shape[1:], w.dtype) for n, w in weights.items()}
    t = time.perf_counter()
    lowered = layer_step.lower(one, jax.ShapeDtypeStruct((1, Sp, cfg.hidden_size), cfg.jnp_dtype),
                               jax.ShapeDtypeStruct((cfg.position_axes, 1, Sp), jnp.int32), config=cfg, prompt_len=S,
                               chunk=chunk, page=PAGE, impl="xla", selector=selector, budget=budget,
                               window=selector.window, room=0)
    st = stats(lowered.compile())
    compile_s = time.perf_counter() - t
    _, cache = lowered.out_info
    weight_arg = nbytes(one)
    x = S * cfg.hidden_size * cfg.jnp_dtype.dtype.itemsize
    step = (st["argument"] - weight_arg) + st["temp"] + (st["output"] - st["alias"] - nbytes(cache))
    wshapes = {tuple(w.shape[1:]) for w in weights.values()}
    return {"stats": st, "weight_args": weight_arg, "x": x, "transient": x + step, "compile_s": compile_s,
            "cache_kv_bytes": cfg.num_layers * kv_bytes(cache), "cache_all_bytes": cfg.num_layers * nbytes(cache),
            "breakdown": {"x (caller's embeddings)": x, "bridge + positions (arguments)": st["argument"] - weight_arg,
                          "layer_step temp": st["temp"]},
            "temp_values": temp_values("layer_step", wshapes)}


def compile_post(cfg, S, *, budget, chunk, selector, weights):
    """Post-prefill SnapKV: `_token_major` (chunk=None -> S, one shot) then per-layer selection."""
    from omnijax.prefill.baselines import _token_major
    from omnijax.prefill.cache import pack
    from omnijax.prefill.layer_major import padded_length

    C = S if chunk is None else chunk
    Sp = padded_length(S, C, PAGE)
    t = time.perf_counter()
    lowered = _token_major.lower(weights, jax.ShapeDtypeStruct((1, Sp, cfg.hidden_size), cfg.jnp_dtype),
                                 jax.ShapeDtypeStruct((cfg.position_axes, 1, Sp), jnp.int32), config=cfg,
                                 prompt_len=S, chunk=C, page=PAGE, impl="xla", window=selector.window)
    st = stats(lowered.compile())
    wshapes = {tuple(w.shape[1:]) for w in weights.values()}
    tv = temp_values("token_major", wshapes)
    hidden, k_all, v_all, q_all = lowered.out_info
    weight_arg = nbytes(weights)
    x = S * cfg.hidden_size * cfg.jnp_dtype.dtype.itemsize
    phase1 = x + (st["argument"] - weight_arg) + st["temp"] + st["output"]

    keys = jax.ShapeDtypeStruct((1, S, cfg.num_kv_heads, cfg.head_dim), cfg.jnp_dtype)
    q_obs = jax.ShapeDtypeStruct((1, selector.window, cfg.num_heads, cfg.head_dim), cfg.jnp_dtype)
    def select_pack(q, k, v):
        return pack(k, v, selector.select(q, k, budget))

    lowered_sel = jax.jit(select_pack).lower(q_obs, keys, keys)
    sel = stats(lowered_sel.compile())
    compile_s = time.perf_counter() - t
    cache = lowered_sel.out_info
    phase2 = (x + (Sp * cfg.hidden_size * cfg.jnp_dtype.dtype.itemsize) + nbytes((hidden, k_all, v_all, q_all))
              + sel["argument"] + sel["temp"])
    transient = max(phase1, phase2)
    return {"stats": st, "select_stats": sel, "weight_args": weight_arg, "x": x, "phase1": phase1, "phase2": phase2,
            "transient_raw": transient, "weight_slices": tv["weight_slices"],
            "transient": max(phase1 - tv["weight_slices"], phase2), "compile_s": compile_s,
            "cache_kv_bytes": cfg.num_layers * kv_bytes(cache), "cache_all_bytes": cfg.num_layers * nbytes(cache),
            "breakdown": {"x (caller's embeddings)": x, "padded x + positions (arguments)": st["argument"] - weight_arg,
                          "hidden (output)": nbytes(hidden), "all layers' K+V (outputs)": nbytes((k_all, v_all)),
                          "window queries (output)": nbytes(q_all), "_token_major temp": st["temp"],
                          "of which weight-slice copies": tv["weight_slices"]},
            "temp_values": tv["largest"]}


def nbytes_of(entry: dict, key: str) -> int:
    return int(entry["breakdown"][key])


def method_a(args):
    from omnijax.prefill import SnapKV

    cfg = QWEN2_5_OMNI_7B.replace(dtype="bfloat16")
    selector = SnapKV(window=args.window)
    weights = weight_structs(cfg)
    rows = []
    for S in args.seq:
        row = {"seq": S}
        row["tidekv"] = compile_tidekv(cfg, S, budget=args.budget, chunk=args.chunk, selector=selector,
                                       weights=weights)
        row["layerwise_oneshot"] = compile_tidekv(cfg, S, budget=args.budget, chunk=S, selector=selector,
                                                  weights=weights)
        row["post_oneshot"] = compile_post(cfg, S, budget=args.budget, chunk=None, selector=selector,
                                           weights=weights)
        row["post_chunked"] = compile_post(cfg, S, budget=args.budget, chunk=args.chunk, selector=selector,
                                           weights=weights)
        t, p, pc = row["tidekv"]["transient"], row["post_oneshot"]["transient"], row["post_chunked"]["transient"]
        row["reduction_vs_oneshot"] = 1 - t / p
        row["reduction_vs_oneshot_raw"] = 1 - t / row["post_oneshot"]["transient_raw"]
        row["reduction_vs_chunked"] = 1 - t / pc
        row["reduction_vs_layerwise_oneshot"] = 1 - t / row["layerwise_oneshot"]["transient"]
        floor = row["post_oneshot"]["x"] + nbytes_of(row["post_oneshot"], "hidden (output)") + nbytes_of(
            row["post_oneshot"], "all layers' K+V (outputs)")
        row["post_floor"] = floor
        row["reduction_vs_post_floor"] = 1 - t / floor
        row["same_cache_bytes"] = (row["tidekv"]["cache_all_bytes"] == row["post_oneshot"]["cache_all_bytes"]
                                   == row["post_chunked"]["cache_all_bytes"]
                                   == row["layerwise_oneshot"]["cache_all_bytes"])
        rows.append(row)
        print(f"  S={S}: post one-shot {p / GiB:.2f} GiB (raw {row['post_oneshot']['transient_raw'] / GiB:.2f}), "
              f"post chunked {pc / GiB:.2f} GiB, TideKV {t / GiB:.3f} GiB -> {100 * row['reduction_vs_oneshot']:.2f}"
              f" % lower (compile {row['post_oneshot']['compile_s']:.0f} + {row['tidekv']['compile_s']:.0f} s)",
              flush=True)
    return cfg, rows


# --------------------------------------------------------------------------------------------------------------------
# Method B: peak RSS and TTFT of fresh processes
# --------------------------------------------------------------------------------------------------------------------


def proc_status(key: str) -> int:
    """`VmRSS` / `VmHWM` of this process in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


METHODS = ["post_oneshot", "post_chunked", "tidekv"]


class CacheLog:
    """Counts jax's persistent-compilation-cache hits and misses (logger `jax._src.compiler`, DEBUG)."""

    def __init__(self):
        import logging

        self.hits, self.misses = [], []
        handler = logging.Handler(logging.DEBUG)
        handler.emit = self._emit
        log = logging.getLogger("jax._src.compiler")
        log.setLevel(logging.DEBUG)
        log.addHandler(handler)
        log.propagate = False

    def _emit(self, record):
        msg = record.getMessage()
        name = msg.split("'")[1] if "'" in msg else msg
        if msg.startswith("Persistent compilation cache hit"):
            self.hits.append(name)
        elif "cache miss" in msg.lower() or msg.startswith("PERSISTENT COMPILATION CACHE MISS"):
            self.misses.append(name)


def build(S: int):
    from omnijax.models.decoder import Decoder

    cfg = NARROW
    model = Decoder(cfg)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, S)))
    x = model.embed_tokens(ids)
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (3, 1, S))
    jax.block_until_ready((x, positions, model.layers.stacked()))
    return model, x, positions


def prefill(method: str, model, x, positions, args):
    """One prefill to the last logits and the compressed cache (blocked on both)."""
    from omnijax.prefill import SnapKV, tidekv_prefill, token_major_prefill

    selector = SnapKV(window=args.window)
    if method == "tidekv":
        r = tidekv_prefill(model, x, positions, selector=selector, budgets=args.budget, chunk=args.chunk, page=PAGE)
    else:
        r = token_major_prefill(model, x, positions, chunk=None if method == "post_oneshot" else args.chunk,
                                selector=selector, budgets=args.budget, page=PAGE)
    jax.block_until_ready((r.logits, r.cache))
    return r


def prime(method: str, model, x, positions, args):
    """Fills the persistent cache for one method without running its large programs: they are AOT-compiled, and the
    method is then run once with them replaced by zero outputs of the right shapes, which compiles (and caches) the
    small eager ops around them (padding, slicing, selection and packing of the post-prefill path)."""
    from unittest import mock

    from omnijax.prefill import SnapKV
    from omnijax.prefill import baselines, layer_major
    from pallas_kernels.streaming_topk import streaming_topk_blockwise

    cfg, W, S = model.config, args.window, x.shape[1]
    chunk = S if method == "post_oneshot" else args.chunk
    Sp = layer_major.padded_length(S, chunk, PAGE)
    bridge = jax.ShapeDtypeStruct((1, Sp, cfg.hidden_size), cfg.jnp_dtype)
    pos = jax.ShapeDtypeStruct((cfg.position_axes, 1, Sp), jnp.int32)
    zeros = lambda structs: jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), structs)  # noqa: E731
    if method == "tidekv":
        lowered = layer_major.layer_step.lower(layer_major.layer_params(model, 0), bridge, pos, config=cfg,
                                               prompt_len=S, chunk=chunk, page=PAGE, impl="xla",
                                               selector=SnapKV(window=W), budget=args.budget, window=W, room=0)
        lowered.compile()
        fake = lambda p, b, *a, **k: (b, zeros(lowered.out_info[1]))  # noqa: E731
        with mock.patch.object(layer_major, "layer_step", fake):
            prefill(method, model, x, positions, args)
        return
    lowered = baselines._token_major.lower(model.layers.stacked(), bridge, pos, config=cfg, prompt_len=S, chunk=chunk,
                                           page=PAGE, impl="xla", window=W)
    lowered.compile()
    streaming_topk_blockwise.lower(jax.ShapeDtypeStruct((1, W, cfg.num_heads, cfg.head_dim), cfg.jnp_dtype),
                                   jax.ShapeDtypeStruct((1, S, cfg.num_kv_heads, cfg.head_dim), cfg.jnp_dtype),
                                   k=args.budget - W, block_size=512, pool_kernel=5).compile()
    with mock.patch.object(baselines, "_token_major", lambda *a, **k: zeros(lowered.out_info)):
        prefill(method, model, x, positions, args)


def worker(args):
    """Runs in a fresh process; prints one `RESULT {json}` line.

    base: build the model and the prompt only.  prime: AOT-compile into the persistent cache.  memory: one prefill,
    VmHWM after it.  timing: every method once (warm-up), then `repeats` interleaved rounds.
    """
    if args.worker != "timing":  # timing compiles in its own warm-up round (executables loaded from the persistent
        # cache ran TideKV's layer_step 5-25 % slower than in-process compiled ones in checks here)
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    log = CacheLog()
    S = args.worker_seq
    model, x, positions = build(S)
    out = {"mode": args.worker, "method": args.method, "seq": S, "rss_built": proc_status("VmRSS"),
           "hwm_built": proc_status("VmHWM")}
    if args.worker == "prime":
        prime(args.method, model, x, positions, args)
    elif args.worker == "memory":
        start = time.perf_counter()
        r = prefill(args.method, model, x, positions, args)
        out["first_s"] = time.perf_counter() - start
        out["hwm"] = proc_status("VmHWM")
        out["cache_kv_bytes"] = int(r.cache.nbytes())
        out["cache_all_bytes"] = nbytes(r.cache)
    elif args.worker == "timing":
        times = {m: [] for m in METHODS}
        for round_ in range(1 + args.repeats):
            k = round_ % len(METHODS)  # rotate the order from round to round: no method always follows the same one
            for m in METHODS[k:] + METHODS[:k]:
                start = time.perf_counter()
                prefill(m, model, x, positions, args)
                times[m].append(time.perf_counter() - start)
            print(f"  round {round_ + 1}/{1 + args.repeats}" + (" (warm-up)" if round_ == 0 else "") + ": "
                  + ", ".join(f"{m} {times[m][-1]:.2f} s" for m in METHODS), file=sys.stderr, flush=True)
        out["times_s"] = times
    out["cache_hits"], out["cache_misses"] = log.hits, log.misses
    print("RESULT " + json.dumps(out), flush=True)


def spawn(mode: str, S: int, args, method: str = "") -> dict:
    env = dict(os.environ, XLA_FLAGS=_ORIG_XLA_FLAGS)
    cmd = [sys.executable, __file__, "--worker", mode, "--method", method or "-", "--worker-seq", str(S),
           "--cache-dir", args.cache_dir, "--budget", str(args.rss_budget), "--chunk", str(args.chunk),
           "--window", str(args.window), "--repeats", str(args.repeats)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate()
    for line in stderr.splitlines():
        if line.startswith("  round"):
            print(line, flush=True)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"worker {mode} {method} S={S} failed:\n{stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def method_b(args):
    rows = []
    big = {"post_oneshot": "_token_major", "post_chunked": "_token_major", "tidekv": "layer_step"}
    for S in args.rss_seq:
        start = time.perf_counter()
        for method in METHODS:
            spawn("prime", S, args, method)
        print(f"  S={S}: large programs compiled into the persistent cache in {time.perf_counter() - start:.0f} s",
              flush=True)
        base = spawn("base", S, args)
        row = {"seq": S, "base_hwm": base["hwm_built"], "base_rss": base["rss_built"]}
        for method in METHODS:
            r = spawn("memory", S, args, method)
            r["transient_rss"] = r["hwm"] - base["hwm_built"]
            r["big_program_cached"] = any(big[method] in h for h in r["cache_hits"])
            row[method] = r
            print(f"  S={S} {method}: transient RSS {r['transient_rss'] / MiB:.0f} MiB (first run {r['first_s']:.1f} s;"
                  f" cache hits {len(r['cache_hits'])}, compiled {len(r['cache_misses'])} small programs; "
                  f"{big[method]} cached: {r['big_program_cached']})", flush=True)
        timing = spawn("timing", S, args)["times_s"]
        for method in METHODS:
            row[method]["ttft_s"] = timing[method][1:]
            row[method]["warmup_s"] = timing[method][0]
            row[method]["ttft_median_s"] = float(np.median(timing[method][1:]))
        t = np.asarray(timing["tidekv"][1:])
        # median over rounds of same-round ratios: robust to the machine's speed drifting between rounds
        row["ttft_ratio_vs_oneshot"] = float(np.median(t / np.asarray(timing["post_oneshot"][1:])))
        row["ttft_ratio_vs_chunked"] = float(np.median(t / np.asarray(timing["post_chunked"][1:])))
        tm = row["tidekv"]
        row["rss_reduction_vs_oneshot"] = 1 - tm["transient_rss"] / row["post_oneshot"]["transient_rss"]
        row["rss_reduction_vs_chunked"] = 1 - tm["transient_rss"] / row["post_chunked"]["transient_rss"]
        row["same_cache_bytes"] = len({row[m]["cache_all_bytes"] for m in METHODS}) == 1
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------------------------------


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 16384, 32768, 65536],
                        help="Method A prompt lengths (Qwen2.5-Omni-7B shapes)")
    parser.add_argument("--rss-seq", type=int, nargs="+", default=[4096, 8192],
                        help="Method B prompt lengths (narrow executable model)")
    parser.add_argument("--budget", type=int, default=2048, help="tokens per KV head per layer (Method A)")
    parser.add_argument("--rss-budget", type=int, default=2048, help="tokens per KV head per layer (Method B)")
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-rss", action="store_true", help="Method A only (compile-only, no execution)")
    parser.add_argument("--skip-compiled", action="store_true", help="Method B only")
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--append", action="store_true",
                        help="merge the rows into an existing output JSON (rows of the same S are replaced)")
    parser.add_argument("--worker", choices=["base", "prime", "memory", "timing"], help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--worker-seq", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_run = time.perf_counter()
    summary = {"definition": "transient = peak live bytes minus weights minus the final compressed cache",
               "budget_per_kv_head_per_layer": args.budget, "chunk": args.chunk, "page": PAGE,
               "selector": f"SnapKV(window={args.window}, pool_kernel=5, impl='xla', block_size=512)", "impl": "xla"}
    a_rows, b_rows = [], []
    try:
        if not args.skip_compiled:
            print("Method A: compiled memory analysis (Qwen2.5-Omni-7B layer shapes, bf16, batch 1)", flush=True)
            cfg, a_rows = method_a(args)
            summary["method_a"] = {"config": cfg.to_json(), "weights_given_as": "float32 arguments", "rows": a_rows}
    finally:
        shutil.rmtree(_DUMP_DIR, ignore_errors=True)
    if not args.skip_rss:
        print("Method B: transient peak RSS and TTFT of fresh processes (narrow float32 model)", flush=True)
        args.cache_dir = tempfile.mkdtemp(prefix="prefill_memory_cc_")
        try:
            b_rows = method_b(args)
        finally:
            shutil.rmtree(args.cache_dir, ignore_errors=True)
        summary["method_b"] = {"config": NARROW.to_json(), "budget_per_kv_head_per_layer": args.rss_budget,
                               "repeats": args.repeats, "rows": b_rows}

    name = "prefill_memory" if a_rows and b_rows else "prefill_memory_compiled" if a_rows else "prefill_memory_rss"
    path = out / f"{name}.json"
    if args.append and path.exists():  # merge with an earlier run's rows (same S replaced)
        old = json.loads(path.read_text())
        for key, rows in (("method_a", a_rows), ("method_b", b_rows)):
            if key in old and key in summary:
                mine = {r["seq"] for r in rows}
                rows[:0] = [r for r in old[key]["rows"] if r["seq"] not in mine]
                rows.sort(key=lambda r: r["seq"])
                summary[key]["rows"] = rows
        summary["earlier_runtimes_s"] = old.get("earlier_runtimes_s", []) + [old.get("runtime_s")]
    if a_rows:
        print(f"\nMethod A (compiled, GiB; budget {args.budget}/head/layer, chunk {args.chunk}):")
        print(f"{'S':>6} {'post 1-shot':>11} {'w-slices':>8} {'post chunk':>10} {'lw 1-shot':>9} {'post floor':>10} "
              f"{'TideKV':>7} {'vs 1-shot':>9} {'vs chunked':>10} {'vs lw':>7} {'vs floor':>8} {'cache MiB':>9} same")
        for r in a_rows:
            t, p, pc, lw = r["tidekv"], r["post_oneshot"], r["post_chunked"], r["layerwise_oneshot"]
            print(f"{r['seq']:>6} {p['transient'] / GiB:>11.2f} {p['weight_slices'] / GiB:>8.2f} "
                  f"{pc['transient'] / GiB:>10.2f} {lw['transient'] / GiB:>9.2f} {r['post_floor'] / GiB:>10.2f} "
                  f"{t['transient'] / GiB:>7.3f} {100 * r['reduction_vs_oneshot']:>8.2f}% "
                  f"{100 * r['reduction_vs_chunked']:>9.2f}% {100 * r['reduction_vs_layerwise_oneshot']:>6.2f}% "
                  f"{100 * r['reduction_vs_post_floor']:>7.2f}% {t['cache_all_bytes'] / MiB:>9.2f} "
                  f"{'yes' if r['same_cache_bytes'] else 'NO'}")
    if b_rows:
        print(f"\nMethod B (fresh-process transient RSS in MiB; TTFT median of {args.repeats} interleaved rounds in s; "
              f"ratios = median of same-round ratios):")
        print(f"{'S':>6} {'post 1-shot':>11} {'post chunk':>10} {'TideKV':>7} {'vs 1-shot':>9} {'vs chunk':>8} "
              f"{'TTFT 1-shot':>11} {'TTFT chunk':>10} {'TTFT Tide':>9} {'Tide/1-shot':>11} {'Tide/chunk':>10} "
              f"{'cache KiB':>9} same")
        for r in b_rows:
            p, pc, t = r["post_oneshot"], r["post_chunked"], r["tidekv"]
            print(f"{r['seq']:>6} {p['transient_rss'] / MiB:>11.0f} {pc['transient_rss'] / MiB:>10.0f} "
                  f"{t['transient_rss'] / MiB:>7.0f} {100 * r['rss_reduction_vs_oneshot']:>8.1f}% "
                  f"{100 * r['rss_reduction_vs_chunked']:>7.1f}% "
                  f"{p['ttft_median_s']:>11.3f} {pc['ttft_median_s']:>10.3f} {t['ttft_median_s']:>9.3f} "
                  f"{r['ttft_ratio_vs_oneshot']:>11.3f} {r['ttft_ratio_vs_chunked']:>10.3f} "
                  f"{t['cache_all_bytes'] / 1024:>9.0f} {'yes' if r['same_cache_bytes'] else 'NO'}")
    runtime = time.perf_counter() - t_run
    summary["runtime_s"] = runtime
    print(f"total runtime {runtime:.0f} s")
    path.write_text(json.dumps(summary, indent=2))
    plot(a_rows, b_rows, out / f"{name}.png")
    print(f"wrote {out / (name + '.json')} and {out / (name + '.png')}")


def plot(a_rows, b_rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (1 if a_rows else 0) + (2 if b_rows else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    axes = list(axes[0])
    styles = {"post_oneshot": ("post-prefill SnapKV (one-shot)", "o"),
              "post_chunked": ("post-prefill SnapKV (chunked prefill)", "s"), "tidekv": ("TideKV", "^")}
    if a_rows:
        ax = axes.pop(0)
        x = [r["seq"] for r in a_rows]
        for key, (label, marker) in styles.items():
            ax.plot(x, [r[key]["transient"] / GiB for r in a_rows], marker=marker, label=label)
        ax.plot(x, [r["layerwise_oneshot"]["transient"] / GiB for r in a_rows], marker="v",
                label="SnapKV layer-wise one-shot (HF-style)")
        ax.plot(x, [r["post_floor"] / GiB for r in a_rows], linestyle=":", color="gray",
                label="post-prefill floor: x + hidden + all-layer KV")
        top = a_rows[-1]
        ax.annotate(f"{100 * top['reduction_vs_oneshot']:.1f}% lower",
                    xy=(top["seq"], top["tidekv"]["transient"] / GiB),
                    xytext=(0.45, 0.45), textcoords="axes fraction", arrowprops=dict(arrowstyle="->"))
        ax.set_title("A: compiled transient (Qwen2.5-Omni-7B shapes, bf16)", fontsize=9)
        ax.set_ylabel("transient construction memory (GiB)")
        ax.set_yscale("log")
    if b_rows:
        ax = axes.pop(0)
        x = [r["seq"] for r in b_rows]
        for key, (label, marker) in styles.items():
            ax.plot(x, [r[key]["transient_rss"] / MiB for r in b_rows], marker=marker, label=label)
        ax.set_title("B: fresh-process peak RSS minus base (narrow, f32)", fontsize=9)
        ax.set_ylabel("transient RSS (MiB)")
        ax.set_ylim(bottom=0)
        ax = axes.pop(0)
        ax.plot(x, [r["ttft_ratio_vs_oneshot"] for r in b_rows], marker="o", label="TideKV / post one-shot")
        ax.plot(x, [r["ttft_ratio_vs_chunked"] for r in b_rows], marker="s", label="TideKV / post chunked")
        ax.axhline(1.05, color="gray", linestyle="--", linewidth=1, label="+5 % target")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title("B: TTFT ratio (median)", fontsize=9)
        ax.set_ylabel("TTFT ratio")
    for ax in fig.axes:
        ax.set_xscale("log", base=2)
        ticks = sorted({r["seq"] for r in (a_rows or b_rows)} | {r["seq"] for r in b_rows})
        ax.set_xticks(ticks, [f"{t // 1024}K" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("prompt tokens S")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
