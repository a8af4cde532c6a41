"""Method B of `bench/tidekv/prefill_memory.py`: peak RSS and TTFT of each prefill schedule in fresh processes on a
narrow executable model (see that script's docstring for the prime / base / memory / timing processes).

The parent side (`method_b`, `spawn`) starts `python -m bench.tidekv.prefill_memory --worker MODE ...` processes in
the repository root; the worker side (`worker`) runs in them and prints one `RESULT {json}` line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from bench.tidekv._prefill_memory_common import NARROW, PAGE, MiB, nbytes


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
    """The narrow model, a random prompt's embeddings `x [1, S, D]` and positions, all materialised."""
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

    from omnijax.kernels.streaming_topk import streaming_topk_blockwise
    from omnijax.prefill import SnapKV, baselines, layer_major

    cfg, W, S = model.config, args.window, x.shape[1]
    chunk = S if method == "post_oneshot" else args.chunk
    Sp = layer_major.padded_length(S, chunk, PAGE)
    bridge = jax.ShapeDtypeStruct((1, Sp, cfg.hidden_size), cfg.jnp_dtype)
    pos = jax.ShapeDtypeStruct((cfg.position_axes, 1, Sp), jnp.int32)
    zeros = lambda structs: jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), structs)  # noqa: E731
    if method == "tidekv":  # the two programs of a layer step (`layer_major.run_layer`)
        forward = layer_major.layer_forward.lower(layer_major.layer_params(model, 0), bridge, pos, config=cfg,
                                                  prompt_len=S, chunk=chunk, page=PAGE, impl="xla", window=W)
        forward.compile()
        _, k_buf, v_buf, q_obs = forward.out_info
        compress = layer_major.layer_compress.lower(k_buf, v_buf, q_obs, prompt_len=S, selector=SnapKV(window=W),
                                                    budget=args.budget, window=W, room=0)
        compress.compile()
        fake = lambda p, b, *a, **k: (b, zeros(compress.out_info))  # noqa: E731
        with mock.patch.object(layer_major, "run_layer", fake):
            prefill(method, model, x, positions, args)
        return
    lowered = baselines.token_major.lower(model.layers.stacked(), bridge, pos, config=cfg, prompt_len=S, chunk=chunk,
                                           page=PAGE, impl="xla", window=W)
    lowered.compile()
    streaming_topk_blockwise.lower(jax.ShapeDtypeStruct((1, W, cfg.num_heads, cfg.head_dim), cfg.jnp_dtype),
                                   jax.ShapeDtypeStruct((1, S, cfg.num_kv_heads, cfg.head_dim), cfg.jnp_dtype),
                                   k=args.budget - W, block_size=512, pool_kernel=5).compile()
    with mock.patch.object(baselines, "token_major", lambda *a, **k: zeros(lowered.out_info)):
        prefill(method, model, x, positions, args)


def measure(mode: str, method: str, model, x, positions, args, log: CacheLog, built: dict) -> dict:
    """One worker mode (see `worker`) on the model and prompt `build` made; `built`: the RSS figures right after."""
    hits, misses = len(log.hits), len(log.misses)
    out = {"mode": mode, "method": method, "seq": x.shape[1], **built}
    if mode == "prime":
        prime(method, model, x, positions, args)
    elif mode == "memory":
        start = time.perf_counter()
        r = prefill(method, model, x, positions, args)
        out["first_s"] = time.perf_counter() - start
        out["hwm"] = proc_status("VmHWM")
        out["cache_kv_bytes"] = int(r.cache.nbytes())
        out["cache_all_bytes"] = nbytes(r.cache)
    elif mode == "timing":
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
    out["cache_hits"], out["cache_misses"] = log.hits[hits:], log.misses[misses:]
    return out


def worker(args):
    """Runs in a fresh process; prints one `RESULT {json}` line.

    base: build the model and the prompt only.  prime: AOT-compile into the persistent cache.  memory: one prefill,
    VmHWM after it.  timing: every method once (warm-up), then `repeats` interleaved rounds.  every (`--smoke`): all
    of them in this one process, in that order (base, prime and memory per method, timing), keyed "base",
    "prime <method>", "memory <method>", "timing": a check that they run, not a measurement (one process's VmHWM
    only grows).
    """
    if args.worker != "timing":  # timing compiles in its own warm-up round (executables loaded from the persistent
        # cache ran TideKV's layer_step 5-25 % slower than in-process compiled ones in checks here)
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    log = CacheLog()
    model, x, positions = build(args.worker_seq)
    built = {"rss_built": proc_status("VmRSS"), "hwm_built": proc_status("VmHWM")}
    run = lambda mode, method: measure(mode, method, model, x, positions, args, log, built)  # noqa: E731
    if args.worker == "every":
        out = {"base": run("base", "-")}
        out.update({f"{mode} {m}": run(mode, m) for mode in ("prime", "memory") for m in METHODS})
        out["timing"] = run("timing", "-")
    else:
        out = run(args.worker, args.method)
    print("RESULT " + json.dumps(out), flush=True)


def spawn(mode: str, S: int, args, method: str = "", *, entry_module: str, worker_xla_flags: str) -> dict:
    """Runs `python -m entry_module --worker mode` in a fresh process (in the repository root) with
    `XLA_FLAGS=worker_xla_flags`; returns its result."""
    env = dict(os.environ, XLA_FLAGS=worker_xla_flags)
    cmd = harness.module_command(entry_module, "--worker", mode, "--method", method or "-", "--worker-seq", S,
                                 "--cache-dir", args.cache_dir, "--budget", args.rss_budget, "--chunk", args.chunk,
                                 "--window", args.window, "--repeats", args.repeats)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=harness.ROOT)
    stdout, stderr = proc.communicate()
    for line in stderr.splitlines():
        if line.startswith("  round"):
            print(line, flush=True)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"worker {mode} {method} S={S} failed:\n{stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def method_b(args, *, entry_module: str, worker_xla_flags: str):
    """Per `args.rss_seq`: prime, base, one memory process per method and one timing process, each a fresh
    `python -m entry_module --worker` process with `XLA_FLAGS=worker_xla_flags` (`--smoke`: one `every` process
    runs them all). Returns the rows."""
    every = {}  # --smoke: S -> the results of one `every` worker, which runs all of an S's modes in one process

    def spawn_worker(mode: str, S: int, method: str = "") -> dict:
        if args.smoke:
            if S not in every:
                every[S] = spawn("every", S, args, entry_module=entry_module, worker_xla_flags=worker_xla_flags)
            return every[S][f"{mode} {method}" if method else mode]
        return spawn(mode, S, args, method, entry_module=entry_module, worker_xla_flags=worker_xla_flags)

    rows = []
    big = {"post_oneshot": "token_major", "post_chunked": "token_major", "tidekv": "layer_forward"}
    for S in args.rss_seq:
        start = time.perf_counter()
        for method in METHODS:
            spawn_worker("prime", S, method)
        print(f"  S={S}: large programs compiled into the persistent cache in {time.perf_counter() - start:.0f} s",
              flush=True)
        base = spawn_worker("base", S)
        row = {"seq": S, "base_hwm": base["hwm_built"], "base_rss": base["rss_built"]}
        for method in METHODS:
            r = spawn_worker("memory", S, method)
            r["transient_rss"] = r["hwm"] - base["hwm_built"]
            r["big_program_cached"] = any(big[method] in h for h in r["cache_hits"])
            row[method] = r
            print(f"  S={S} {method}: transient RSS {r['transient_rss'] / MiB:.0f} MiB (first run {r['first_s']:.1f} s;"
                  f" cache hits {len(r['cache_hits'])}, compiled {len(r['cache_misses'])} small programs; "
                  f"{big[method]} cached: {r['big_program_cached']})", flush=True)
        timing = spawn_worker("timing", S)["times_s"]
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
