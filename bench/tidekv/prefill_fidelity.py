"""Prompt-encoding fidelity of layer-major delayed eviction vs immediate eviction (seed 001 §6.5, Table 8).

Every path encodes the same prompts and is compared with the unchunked reference (Full-OneShot):
    full_oneshot         `token_major_prefill(chunk=None)`, no eviction (the reference)
    full_chunked         `token_major_prefill(chunk=C)`, token-major chunked prefill, no eviction
    layer_major_noevict  `tidekv_prefill(budgets=None)`, the layer-major schedule without eviction
    tidekv               `tidekv_prefill` + SnapKV at each layer's end (delayed eviction)
    post_snapkv          `token_major_prefill(chunk=None)` + post-prefill SnapKV (its prefill is Full-OneShot's)
    immediate_snapkv     `immediate_eviction_prefill`: chunked token-major, SnapKV after every chunk
    immediate_noevict    the same code with a budget of the whole prompt (never evicts): the numerical floor of the
                         immediate-eviction implementation (dense per-chunk attention with bf16 probabilities), so
                         its eviction drift can be told apart from its different attention arithmetic
Metrics against Full-OneShot, averaged over prompts:
    hidden rel-L2        ||h - h_ref||_F / ||h_ref||_F of the final layer's hidden states (before the final norm)
                         over the whole prompt;  cosine: mean over prompt tokens of the per-token cosine similarity
    prompt top-1 / JS    next-token distributions at *every* prompt position (logits of the hidden states):
                         argmax agreement and Jensen-Shannon divergence (nats); only hidden-state drift moves them
    next top-1 / JS      the prompt's last logits plus `--decode` teacher-forced decode steps: every path's own cache
                         (compressed or not) is fed the same continuation (Full-OneShot's greedy tokens) through
                         `prefill.force`; Full-OneShot decodes from its uncompressed cache. This is where the *kept*
                         cache matters: eviction at layer end (tidekv, post_snapkv) changes only these columns.
    kept=post            fraction of (layer, KV head) kept sets identical to post-prefill SnapKV's
    top1 / JS v post     the same teacher-forced distributions against post-prefill SnapKV's (the selector-matched
                         control) instead of Full-OneShot's
Eviction that happens during prefill (immediate_snapkv) changes the hidden states themselves; TideKV's hidden states
are those of layer_major_noevict by construction.

Model: a narrow Qwen2-shaped decoder (4 layers, hidden 512, 8 heads / 2 KV heads, head dim 64, intermediate 1376,
q/k/v bias, mrope (8, 12, 12), vocab 2048), random init (std 0.02), in bfloat16 and, as a check, float32. It has
random weights: q_proj and k_proj are scaled by `--qk-scale` so attention is peaked (otherwise it is near uniform over
the prompt and any selection looks harmless) and lm_head by `--head-scale` so next-token distributions are not near
uniform (the reference's mean entropy is printed). Prompts are uniformly random token ids with text positions, so
nothing in them is "important" the way retrieval prompts are: the numbers measure numerical drift of the schedules and
the perturbation from a reduced cache, not task quality. Drift magnitudes depend on these scales; compare rows within
a table, not with the paper's absolute figures.

Run: `python -m bench.tidekv.prefill_fidelity [--prompts 3] [--seq 4096] [--chunk 512] [--budget 512] [--decode 16]
[--dtypes bfloat16 float32] [--layers 4] [--out bench/out] [--smoke]`
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from omnijax.models.config import DecoderConfig
from omnijax.models.decoder import Decoder
from omnijax.prefill import SnapKV, force, greedy, immediate_eviction_prefill, tidekv_prefill, token_major_prefill

BASE = DecoderConfig(vocab_size=2048, hidden_size=512, intermediate_size=1376, num_layers=4, num_heads=8,
                     num_kv_heads=2, head_dim=64, rope_theta=1e6, mrope_section=(8, 12, 12), qkv_bias=True)
PATHS = ["full_oneshot", "full_chunked", "layer_major_noevict", "tidekv", "post_snapkv", "immediate_noevict",
         "immediate_snapkv"]
LABELS = {"full_oneshot": "Full-OneShot (ref)", "full_chunked": "Full-Chunked", "layer_major_noevict": "Tide-NoEvict",
          "tidekv": "TideKV (SnapKV)", "post_snapkv": "post-prefill SnapKV",
          "immediate_noevict": "Immediate (no evict)", "immediate_snapkv": "Immediate SnapKV"}
EVICTING = ("tidekv", "post_snapkv", "immediate_snapkv")
PAGE = 512


def build_model(dtype: str, qk_scale: float, head_scale: float, seed: int = 0, layers: int = 4) -> Decoder:
    from flax import nnx

    model = Decoder(BASE.replace(dtype=dtype, num_layers=layers), rngs=nnx.Rngs(seed))
    model.layers.q_proj[...] = model.layers.q_proj[...] * qk_scale
    model.layers.k_proj[...] = model.layers.k_proj[...] * qk_scale
    model.lm_head[...] = model.lm_head[...] * head_scale
    return model


def run_path(name, model, x, positions, args):
    selector = SnapKV(window=args.window)
    room = args.decode
    if name == "full_oneshot":
        return token_major_prefill(model, x, positions, page=PAGE, room=room)
    if name == "full_chunked":
        return token_major_prefill(model, x, positions, chunk=args.chunk, page=PAGE, room=room)
    if name == "layer_major_noevict":
        return tidekv_prefill(model, x, positions, chunk=args.chunk, page=PAGE, room=room)
    if name == "tidekv":
        return tidekv_prefill(model, x, positions, selector=selector, budgets=args.budget, chunk=args.chunk,
                              page=PAGE, room=room)
    if name == "post_snapkv":
        return token_major_prefill(model, x, positions, selector=selector, budgets=args.budget, page=PAGE, room=room)
    if name == "immediate_noevict":
        return immediate_eviction_prefill(model, x, positions, selector=selector, budget=x.shape[1],
                                          chunk=args.chunk, room=room)
    if name == "immediate_snapkv":
        return immediate_eviction_prefill(model, x, positions, selector=selector, budget=args.budget,
                                          chunk=args.chunk, room=room)
    raise ValueError(name)


def teacher_forced(model, result, tokens):
    """`[B, N + 1, V]` float32: the prompt's last logits, then the logits after feeding each of `tokens [B, N]`."""
    logits, _ = force(model, result.cache, tokens)
    return np.concatenate([np.asarray(result.logits, np.float32)[:, None], np.asarray(logits, np.float32)], axis=1)


def log_softmax(z):
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def js_divergence(a, b):
    """Jensen-Shannon divergence (nats) between the softmax distributions of logits `a`, `b` [..., V]."""
    la, lb = log_softmax(a), log_softmax(b)
    pa, pb = np.exp(la), np.exp(lb)
    m = 0.5 * (pa + pb)
    lm = np.log(np.maximum(m, 1e-300))
    return np.maximum(0.5 * (pa * (la - lm)).sum(-1) + 0.5 * (pb * (lb - lm)).sum(-1), 0.0)


def entropy(z):
    lz = log_softmax(z)
    return -(np.exp(lz) * lz).sum(-1)


def same_kept(cache, other) -> float:
    """Fraction of (layer, KV head) segments holding the same prompt indices in both caches (prompt entries only)."""
    same, total = 0, 0
    for a, b in zip(cache.layers, other.layers):
        G = a.num_kv_heads
        for g in range(G):
            sets = []
            for layer in (a, b):
                lo, n = int(layer.offset[0, g]), int(layer.length[0, g])
                sets.append(sorted(np.asarray(layer.index[0, lo:lo + n]).tolist()))
            same += sets[0] == sets[1]
            total += 1
    return same / total


def prompt_logits(model, hidden):
    return np.asarray(jax.jit(model.logits)(hidden), np.float32)


def evaluate(dtype, args):
    """All paths on each prompt in turn (batch 1, as in the paper; `immediate_eviction_prefill` also fails on
    XLA:CPU in bfloat16 with batch > 1, see bench/tidekv/RESULTS.md). Returns `(rows, info)`."""
    model = build_model(dtype, args.qk_scale, args.head_scale, layers=args.layers)
    rng = np.random.default_rng(args.seed)
    S = args.seq
    ids_all = rng.integers(0, BASE.vocab_size, (args.prompts, S))
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (3, 1, S))
    keys = ["seconds", "rel_l2", "cos", "cos_min", "prompt_top1", "prompt_js", "last_top1", "last_js", "next_top1",
            "next_js", "same_kept", "post_top1", "post_js"]
    acc = {name: {**{k: [] for k in keys}, "cells": 0, "kv_bytes": 0}
           for name in PATHS}
    entropies, margins, prompt_entropies = [], [], []
    for p in range(args.prompts):
        x = model.embed_tokens(jnp.asarray(ids_all[p:p + 1]))
        results = {}
        for name in PATHS:
            start = time.perf_counter()
            r = run_path(name, model, x, positions, args)
            jax.block_until_ready((r.hidden, r.logits, r.cache))
            acc[name]["seconds"].append(time.perf_counter() - start)
            acc[name]["cells"], acc[name]["kv_bytes"] = int(r.cache.cells()[0]), int(r.cache.nbytes())
            results[name] = r
        ref = results["full_oneshot"]
        # Continuation: Full-OneShot's greedy tokens from its own uncompressed cache, fed to every path.
        tokens = greedy(model, ref.cache, ref.logits, args.decode)[0]  # [1, N]
        ref_next = teacher_forced(model, ref, tokens)[0]  # [N + 1, V]
        ref_h = np.asarray(ref.hidden, np.float32)[0]  # [S, D]
        ref_prompt = prompt_logits(model, ref.hidden)[0]  # [S, V]
        entropies.append(entropy(ref_next).mean())
        prompt_entropies.append(entropy(ref_prompt).mean())
        margins.append(np.mean(np.diff(np.sort(ref_next, -1)[..., -2:], axis=-1)))
        post = results["post_snapkv"].cache
        nexts = {name: ref_next if name == "full_oneshot" else teacher_forced(model, results[name], tokens)[0]
                 for name in PATHS}
        for name in PATHS:
            r, a = results[name], acc[name]
            a["same_kept"].append(same_kept(r.cache, post))
            h = np.asarray(r.hidden, np.float32)[0]
            a["rel_l2"].append(np.linalg.norm(h - ref_h) / np.linalg.norm(ref_h))
            cos = (h * ref_h).sum(-1) / (np.linalg.norm(h, axis=-1) * np.linalg.norm(ref_h, axis=-1))  # [S]
            a["cos"].append(cos.mean())
            a["cos_min"].append(cos.min())
            pl = ref_prompt if name == "full_oneshot" else prompt_logits(model, r.hidden)[0]
            nxt, post_next = nexts[name], nexts["post_snapkv"]
            a["prompt_top1"].append((pl.argmax(-1) == ref_prompt.argmax(-1)).mean())
            a["prompt_js"].append(js_divergence(pl, ref_prompt).mean())
            a["last_top1"].append(float(nxt[0].argmax() == ref_next[0].argmax()))
            a["last_js"].append(js_divergence(nxt[0], ref_next[0]))
            a["next_top1"].append((nxt.argmax(-1) == ref_next.argmax(-1)).mean())
            a["next_js"].append(js_divergence(nxt, ref_next).mean())
            a["post_top1"].append((nxt.argmax(-1) == post_next.argmax(-1)).mean())
            a["post_js"].append(js_divergence(nxt, post_next).mean())
        print(f"  [{dtype}] prompt {p + 1}/{args.prompts}: "
              + ", ".join(f"{name} {acc[name]['seconds'][-1]:.1f} s" for name in PATHS), flush=True)
    rows = []
    for name in PATHS:
        a = acc[name]
        mean = lambda key: float(np.mean(a[key]))  # noqa: E731
        rows.append({
            "dtype": dtype, "path": name, "seconds_first_prompt_incl_compile": a["seconds"][0],
            "seconds_median": float(np.median(a["seconds"])),
            "cache_cells": a["cells"], "cache_kv_bytes": a["kv_bytes"],
            "hidden_rel_l2": mean("rel_l2"), "hidden_rel_l2_per_prompt": [float(v) for v in a["rel_l2"]],
            "hidden_cosine": mean("cos"), "hidden_cosine_min_token": float(np.min(a["cos_min"])),
            "prompt_top1": mean("prompt_top1"), "prompt_js": mean("prompt_js"),
            "last_top1": mean("last_top1"), "last_js": mean("last_js"),
            "next_top1": mean("next_top1"), "next_top1_per_prompt": [float(v) for v in a["next_top1"]],
            "next_js": mean("next_js"), "next_js_per_prompt": [float(v) for v in a["next_js"]],
            "kept_as_post_snapkv": mean("same_kept") if name in EVICTING else None,
            "next_top1_vs_post_snapkv": mean("post_top1"),
            "next_js_vs_post_snapkv": mean("post_js")})
    info = {"ref_next_entropy_nats": float(np.mean(entropies)),
            "ref_prompt_entropy_nats": float(np.mean(prompt_entropies)),
            "uniform_entropy_nats": float(np.log(BASE.vocab_size)),
            "ref_next_top1_margin": float(np.mean(margins))}
    return rows, info


def main(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument("--prompts", type=int, default=3, help="random prompts (run one at a time)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--budget", type=int, default=512, help="tokens kept per KV head per layer")
    parser.add_argument("--window", type=int, default=64, help="SnapKV observation window")
    parser.add_argument("--decode", type=int, default=16, help="teacher-forced decode steps")
    parser.add_argument("--qk-scale", type=float, default=4.0)
    parser.add_argument("--head-scale", type=float, default=8.0)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the narrow model")
    args = harness.parse(parser, argv, smoke=dict(prompts=1, seq=128, chunk=64, budget=32, window=16, decode=2,
                                                  dtypes=["float32"], layers=1))
    out = harness.output_dir(args)
    t_run = time.perf_counter()
    rows, infos = [], {}
    for dtype in args.dtypes:
        r, infos[dtype] = evaluate(dtype, args)
        rows += r
    cols = [("hidden_rel_l2", "hid relL2", ".2e"), ("hidden_cosine", "hid cos", ".6f"),
            ("prompt_top1", "prm top1", ".4f"), ("prompt_js", "prm JS", ".1e"), ("last_top1", "last top1", ".2f"),
            ("last_js", "last JS", ".1e"), ("next_top1", "next top1", ".3f"), ("next_js", "next JS", ".1e"),
            ("kept_as_post_snapkv", "kept=post", ".2f"), ("next_top1_vs_post_snapkv", "top1 v post", ".3f"),
            ("next_js_vs_post_snapkv", "JS v post", ".1e")]
    for dtype in args.dtypes:
        info = infos[dtype]
        print(f"\n{dtype}: {args.prompts} random prompts x {args.seq} tokens, chunk {args.chunk}, budget "
              f"{args.budget}/head (SnapKV window {args.window}), {args.decode} teacher-forced steps; reference "
              f"next-token entropy {info['ref_next_entropy_nats']:.2f} nats (uniform "
              f"{info['uniform_entropy_nats']:.2f})")
        print(f"{'path':>22} " + " ".join(f"{h:>10}" for _, h, _ in cols))
        for r in rows:
            if r["dtype"] == dtype:
                print(f"{LABELS[r['path']]:>22} " + " ".join(f"{r[k]:>10{f}}" if r[k] is not None else f"{'-':>10}"
                                                             for k, _, f in cols))
    runtime = time.perf_counter() - t_run
    print(f"total runtime {runtime:.0f} s")
    summary = {"config": BASE.replace(num_layers=args.layers).to_json(), "random_weights": True,
               "qk_scale": args.qk_scale,
               "head_scale": args.head_scale, "prompts": args.prompts, "seq": args.seq, "chunk": args.chunk,
               "budget_per_kv_head": args.budget, "window": args.window, "decode_steps": args.decode,
               "page": PAGE, "impl": "xla", "reference": "full_oneshot", "js_unit": "nats", "info": infos,
               "runtime_s": runtime, "rows": rows}
    harness.write_json(out, "prefill_fidelity", summary, indent=2)
    plot(rows, args.dtypes, out)


def plot(rows, dtypes, out):
    plt = harness.pyplot()
    metrics = [("hidden_rel_l2", "hidden rel-L2 (log)", True), ("hidden_cosine", "1 - hidden cosine (log)", True),
               ("prompt_js", "JS, all prompt positions (log)", True),
               ("next_top1", "top-1 agreement, last + decode", False),
               ("next_js", "JS, last + decode (log)", True),
               ("next_top1_vs_post_snapkv", "top-1 agreement with post-prefill SnapKV", False)]
    fig, axes = plt.subplots(2, 3, figsize=(13, 8))
    axes = axes.ravel()
    paths = [p for p in PATHS if p != "full_oneshot"]
    width = 0.8 / len(dtypes)
    for ax, (key, title, log) in zip(axes, metrics):
        for j, dtype in enumerate(dtypes):
            vals = []
            for p in paths:
                v = next(r[key] for r in rows if r["dtype"] == dtype and r["path"] == p)
                vals.append(1 - v if key == "hidden_cosine" else v)
            if log:
                vals = [max(v, 1e-12) for v in vals]
            ax.bar(np.arange(len(paths)) + (j - (len(dtypes) - 1) / 2) * width, vals, width, label=dtype)
        ax.set_xticks(np.arange(len(paths)), [LABELS[p] for p in paths], rotation=45, ha="right", fontsize=7)
        if log:
            ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("Fidelity vs Full-OneShot (random-weight narrow Qwen-shaped decoder; values at 1e-12 are exact 0)",
                 fontsize=9)
    harness.save_png(fig, out, "prefill_fidelity")


if __name__ == "__main__":
    main()
