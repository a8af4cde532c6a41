"""Per-update latency at 4K–32K history checkpoints under each retention policy (seed 000 §7.2.1, Figure 10).

A Qwen2.5-Omni session (a system prompt, then 2 s audiovisual units) is streamed under each retention policy up to
each history checkpoint; the NEXT unit is then timed through the same jitted step (`Session`) from that state. Full
context (NoSlide) attends over the whole history, the bounded policies over at most their watermark plus one unit,
so the ratio column shows what bounding the history buys per update. All (policy, checkpoint) cases are timed
side by side in interleaved rounds (each round feeds every case once), and the ratio to NoSlide is the median of
same-round ratios, because these machines' speed drifts over minutes.

Model (timed): Qwen2.5-Omni-3B attention and MLP shapes (16 query heads, 2 KV heads, head_dim 128, mrope (16, 24,
24), hidden 2048, intermediate 11008) with only `--layers` layers and a 1024-row vocab, random init, float32.
Adapter token ids are remapped with `ids % vocab`: retention reads only spans, units and positions.

Session: a 40-token system prompt (SYSTEM span), then Qwen2.5-Omni audiovisual units built by
`adapters.qwen2_5_omni.audiovisual_unit`: 2 s at 2 fps, video grid (2, 10, 14) patches (140 x 196 px frames, 70
video tokens after the 2x2 merge), 50 audio tokens (25 per second) and 4 bos/eos markers = 124 tokens per unit. The
history is streamed in scans of `--block-units` chunks (one compile per policy and pool shape); a checkpoint L is
the block boundary nearest L: 4,008 / 8,100 / 16,284 / 32,652 tokens for 4K / 8K / 16K / 32K.

History writer: streaming 32K tokens through even a 2-layer, 2048-wide decoder takes minutes per policy on a small
CPU, so by default the history is streamed by a *writer* decoder with the same cache shape (layers, KV heads, head
dim, mrope, rope theta) but a narrow body (hidden 64, 2 query heads). Policy decisions read only unit, span, order
and position metadata, which do not depend on the model (H2O reads attention mass, which does: its kept set is the
writer's, its cell count is the same). The dense reference attention costs the same whatever the cached values
are. `--history-model timed` streams the history through the timed model itself (tens of minutes).

Pool sizing: `impl="reference"` attends densely over every page-table entry, so an update's attention cost follows
the page table's width, not the retained cells. Each policy therefore gets a pool (`num_pages` = `max_pages`) just
large enough for its bound: NoSlide the history plus one unit (grown between checkpoints), the watermark policies
their high watermark plus one unit (a trim runs after the unit that crosses it), SinkWindow sink + window plus one
unit. A run that drops a token for lack of room fails.

Run: `python -m bench.omnitide.retention [--history 4096 8192 16384 32768] [--max-history N] [--policies ...]
[--repeats 6] [--history-model writer|timed] [--narrow] [--out bench/out] [--smoke]`
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

import omnijax
from bench import harness
from omnijax.chunks.spans import SpanKind
from omnijax.kv import layout as layout_lib
from omnijax.kv.paged import PageClass
from omnijax.models.config import QWEN2_5_OMNI_3B
from omnijax.models.qwen2_5_omni import layout as qwen
from omnijax.retention import (
    H2O,
    InfiniPotV,
    NoSlide,
    OfficialUnitWindow,
    OmniMemBudgets,
    OmniPick,
    SinkWindow,
    StreamingLLM,
    StreamingVLM,
    StreamMem,
    TokenSliding,
    UnitFIFO,
)

VOCAB = 1024
VIDEO_GRID = (2, 10, 14)  # 2 s at 2 fps (temporal patch 2): 2 x 5 x 7 merged = 70 video tokens, 140 x 196 px frames
AUDIO_TOKENS = 50  # 25 audio tokens per second
SECOND_PER_GRID = 1.0
SYSTEM_TOKENS = 40  # <|im_start|> + 38 ids + <|im_end|>

# Policies of seed 000 §7.1 at its default 2500/1800 watermarks; SinkWindow at Metronome's S=16, W=1024 (no
# watermark: it trims as soon as the cache holds more than 1040 tokens); OfficialUnitWindow at 2500/1800 instead of
# MiniCPM-o's 8000/6000 so it is comparable (with equal watermarks it is the same rule as UnitFIFO).
POLICIES = {
    "no_slide": NoSlide(),
    "unit_fifo": UnitFIFO(high_watermark=2500, low_watermark=1800),
    "token_sliding": TokenSliding(window=1800, high_watermark=2500),
    "streaming_llm": StreamingLLM(sink_tokens=2, window=1800, high_watermark=2500),
    "h2o": H2O(heavy=900, recent=900, high_watermark=2500),
    "sink_window": SinkWindow(sink=16, window=1024),
    "official_unit_window": OfficialUnitWindow(high_watermark=2500, low_watermark=1800),
    "omnipick": OmniPick(high_watermark=2500, low_watermark=1800),
    # the 2025-26 streaming baselines at budgets near OmniPick's low watermark: StreamingVLM's text sinks and
    # windows (1,792 tokens), OmniMem-style modality budgets (1,800 audiovisual tokens, text kept)
    "streaming_vlm": StreamingVLM(sink=128, text_window=384, vision_window=1280),
    "omnimem_budgets": OmniMemBudgets(visual_budget=1200, audio_budget=600),
    # InfiniPot-V ranks video tokens; audio is compressed alike here (else the audio alone outgrows any budget)
    "infinipot_v": InfiniPotV(budget=1800, visual_kinds=(SpanKind.IMAGE, SpanKind.SLICE, SpanKind.VIDEO,
                                                         SpanKind.AUDIO)),
    "streammem": StreamMem(budget=1800),  # keeps SYSTEM and its proxies (the markers)
}


def configs(layers: int):
    timed = QWEN2_5_OMNI_3B.replace(num_layers=layers, vocab_size=VOCAB)
    writer = timed.replace(hidden_size=64, intermediate_size=64, num_heads=2)
    return timed, writer


def session_chunks(num_units: int, seed: int = 0):
    """The system prompt (unit 0) and audiovisual units 1..num_units, token ids remapped into the small vocab."""
    rng = np.random.default_rng(seed)
    body = rng.integers(0, 100_000, SYSTEM_TOKENS - 2)
    system = qwen.system_unit(np.concatenate([[qwen.IM_START], body, [qwen.IM_END]]), unit=0)
    units = [qwen.audiovisual_unit(VIDEO_GRID, AUDIO_TOKENS, SECOND_PER_GRID, unit=i) for i in range(1, num_units + 1)]
    return [dataclasses.replace(c, token_ids=np.asarray(c.token_ids) % VOCAB) for c in [system] + units]


def bound_cells(policy) -> int | None:
    """Most retained cells before a trim (None: unbounded)."""
    if isinstance(policy, NoSlide):
        return None
    if isinstance(policy, SinkWindow):
        return policy.sink + policy.window
    if isinstance(policy, StreamingVLM):  # it trims on every chunk down to its budget
        return policy.budget
    if isinstance(policy, (OmniMemBudgets, InfiniPotV, StreamMem)):  # what they always keep grows with the session
        return None
    return policy.high_watermark


def grow_pool(state, num_pages: int):
    """The same state in a pool (and page table) of `num_pages` pages; the new pages are free."""
    kv = state.kv
    extra = num_pages - kv.num_pages
    if extra <= 0:
        return state

    def pad(x, axis, value=0):
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, extra)
        return jnp.pad(x, widths, constant_values=value)

    free = int(kv.num_free)
    # Pages are popped from the top of the stack: keep the old free pages on top, then the new ones in id order.
    stack = jnp.concatenate([jnp.arange(num_pages - 1, kv.num_pages - 1, -1, dtype=jnp.int32), kv.free_stack[:free],
                             jnp.zeros((kv.num_pages - free,), jnp.int32)])
    kv = kv.replace(k=pad(kv.k, 1), v=pad(kv.v, 1), valid=pad(kv.valid, 0), pos=pad(kv.pos, 1),
                    order=pad(kv.order, 0), unit=pad(kv.unit, 0, -1), span=pad(kv.span, 0), offset=pad(kv.offset, 0),
                    score=pad(kv.score, 0), page_table=pad(kv.page_table, 1, -1),
                    page_class=pad(kv.page_class, 0, int(PageClass.FREE)), free_stack=stack,
                    num_free=jnp.asarray(free + extra, jnp.int32))
    return dataclasses.replace(state, kv=kv)


def timed_rounds(cases, warmup: int, repeats: int):
    """Times `Session.feed` of each case's next unit from its checkpoint state, interleaved (`harness.interleaved`):
    every round feeds every case once (state restored first), so drift of the machine's speed hits all cases alike.
    The first call of each case compiles (once per policy and pool shape); it and `warmup` more are discarded.
    Returns `[repeats, cases]` ms; each case's last output is left in `case["update"]`."""
    def restore(case):
        case["session"].state = jax.tree.map(jnp.copy, case["state"])  # `feed` donates it
        return ()

    def feed(case):
        out = case["session"].feed(case["chunk"])
        return out, case["session"].state

    timed = [harness.Case(lambda c=c: feed(c), lambda c=c: restore(c)) for c in cases]
    return harness.interleaved(timed, repeats, warmup=1 + warmup, label="update",
                               after=lambda i, result: cases[i].__setitem__("update", result[0]))


def main(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument("--history", type=int, nargs="+", default=[4096, 8192, 16384, 32768],
                        help="history checkpoints in streamed tokens (rounded to the nearest block boundary)")
    parser.add_argument("--max-history", type=int, default=None, help="skip NoSlide checkpoints above this")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--block-units", type=int, default=None,
                        help="chunks per history scan (default: as many 124-token units as fit in 4096 tokens)")
    parser.add_argument("--history-model", choices=["writer", "timed"], default="writer")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--narrow", action="store_true",
                        help="time the narrow history writer instead of the 3B shapes (a quick check)")
    args = harness.parse(parser, argv, smoke=dict(history=[248], block_units=1, policies=["no_slide", "omnipick"],
                                                  layers=1, warmup=0, repeats=1, narrow=True))
    out = harness.output_dir(args)
    t_run = time.perf_counter()

    timed_cfg, writer_cfg = configs(args.layers)
    if args.narrow:
        timed_cfg = writer_cfg
    timed = omnijax.Decoder(timed_cfg)
    writer = timed if args.history_model == "timed" or args.narrow else omnijax.Decoder(writer_cfg)
    unit_len = int(session_chunks(1)[1].length)
    block = args.block_units or 4096 // unit_len
    blocks_at = {L: max(1, round(L / (block * unit_len))) for L in sorted(set(args.history))}
    max_blocks = max(blocks_at.values())
    chunks = session_chunks(max_blocks * block)  # system + units; the unit after checkpoint k*block is chunks[k*block]
    P = args.page_size
    history_tokens = {k: SYSTEM_TOKENS + (k * block - 1) * unit_len for k in set(blocks_at.values())}
    print(f"unit: {unit_len} tokens (70 video + 50 audio + 4 markers); block: {block} chunks; checkpoints: "
          + ", ".join(f"{L} -> {history_tokens[k]} tokens" for L, k in blocks_at.items()))

    cases = []  # one per (policy, checkpoint): its state after the history and a session of the timed model
    for name in args.policies:
        policy = POLICIES[name]
        bound = bound_cells(policy)
        checkpoints = sorted(set(blocks_at.values()))
        if bound is None and args.max_history is not None:
            checkpoints = [k for k in checkpoints if history_tokens[k] <= args.max_history]
        if not checkpoints:
            continue
        state, t_hist = None, 0.0
        for b in range(1, max(checkpoints) + 1):
            target = min(k for k in checkpoints if k >= b)
            cells = bound if bound is not None else history_tokens[target]
            pages = math.ceil((cells + unit_len) / P)
            if state is None:
                state = omnijax.init_state(timed_cfg, num_pages=pages, page_size=P)
            state = grow_pool(state, pages)
            stacked = omnijax.stack_chunks(chunks[(b - 1) * block: b * block])
            start = time.perf_counter()
            state = omnijax.stream(writer, stacked, policy=policy, state=state).state
            jax.block_until_ready(state)
            t_hist += time.perf_counter() - start
            if bool(state.kv.exhausted.any()):
                raise RuntimeError(f"{name}: pool of {pages} pages ran out at block {b}")
            if b in checkpoints:
                session = omnijax.Session(timed, policy=policy, state=state)
                cases.append({"policy": name, "block": b, "state": session.state, "session": session,
                              "chunk": chunks[b * block], "stats": layout_lib.layout_stats(state.kv),
                              "table_slots": state.kv.max_pages * P})
        print(f"  {name:>20}: history to {history_tokens[max(checkpoints)]} tokens streamed in {t_hist:.1f} s "
              f"(incl. compile)", flush=True)

    ms = timed_rounds(cases, args.warmup, args.repeats)  # [repeats, cases]
    base_col = {c["block"]: i for i, c in enumerate(cases) if c["policy"] == "no_slide"}
    rows = []
    for i, c in enumerate(cases):
        if bool(c["update"].stats.layout.exhausted.any()):
            raise RuntimeError(f"{c['policy']}: the timed update ran out of room")
        j = base_col.get(c["block"])
        rows.append({
            "policy": c["policy"], "checkpoint": [L for L, k in blocks_at.items() if k == c["block"]][0],
            "history_tokens": history_tokens[c["block"]], "retained_cells": int(c["stats"].retained_cells[0]),
            "physical_span": int(c["stats"].physical_span[0]), "table_slots": c["table_slots"],
            "trimmed": bool(c["update"].stats.evicted[0] > 0),
            "update_ms": float(np.median(ms[:, i])), "update_ms_all": ms[:, i].tolist(),
            # median over rounds of the same-round ratio: robust to the machine's speed drifting between rounds
            "vs_no_slide": None if j is None else float(np.median(ms[:, i] / ms[:, j]))})
    top = max(history_tokens.values())
    pick = next((r for r in rows if r["policy"] == "omnipick" and r["history_tokens"] == top), None)
    speedup = 1.0 / pick["vs_no_slide"] if pick and pick["vs_no_slide"] else None

    print(f"\n{'policy':>20} {'history':>7} {'retained':>8} {'span':>6} {'table':>6} {'trim':>4} {'ms':>8} "
          f"{'min-max':>11} {'/NoSlide':>8}")
    for r in sorted(rows, key=lambda r: (r["history_tokens"], args.policies.index(r["policy"]))):
        ratio = f"{r['vs_no_slide']:.2f}" if r["vs_no_slide"] is not None else "-"
        print(f"{r['policy']:>20} {r['history_tokens']:>7} {r['retained_cells']:>8} {r['physical_span']:>6} "
              f"{r['table_slots']:>6} {'yes' if r['trimmed'] else 'no':>4} {r['update_ms']:>8.1f} "
              f"{min(r['update_ms_all']):>5.0f}-{max(r['update_ms_all']):<5.0f} {ratio:>8}")
    if speedup is not None:
        print(f"NoSlide / OmniPick per-update latency at {top} tokens: {speedup:.2f}x")
    runtime = time.perf_counter() - t_run
    print(f"total runtime {runtime:.0f} s")

    summary = {"timed_config": timed_cfg.to_json(), "history_model": args.history_model,
               "writer_config": writer_cfg.to_json() if args.history_model == "writer" else None,
               "unit": {"video_grid_thw": list(VIDEO_GRID), "audio_tokens": AUDIO_TOKENS,
                        "second_per_grid": SECOND_PER_GRID, "tokens": unit_len},
               "system_tokens": SYSTEM_TOKENS, "page_size": P, "block_units": block, "impl": "reference",
               "warmup": args.warmup, "repeats": args.repeats,
               "policies": {n: repr(POLICIES[n]) for n in args.policies},
               "no_slide_over_omnipick_at_max": speedup, "max_history_tokens": top, "runtime_s": runtime,
               "rows": rows}
    harness.write_json(out, "retention", summary, indent=2)
    plot(rows, args.policies, speedup, top, out)


def plot(rows, policies, speedup, top, out):
    fig, (ax, ax2) = harness.pyplot().subplots(1, 2, figsize=(11, 4))
    markers = "os^vDPX*"
    for i, name in enumerate(policies):
        mine = sorted((r for r in rows if r["policy"] == name), key=lambda r: r["history_tokens"])
        if not mine:
            continue
        x = [r["history_tokens"] for r in mine]
        style = dict(marker=markers[i % len(markers)], label=name, linewidth=2.5 if name in ("omnipick", "no_slide")
                     else 1.2)
        ax.plot(x, [r["update_ms"] for r in mine], **style)
        ax2.plot(x, [r["retained_cells"] for r in mine], **style)
    ticks = sorted({r["history_tokens"] for r in rows})
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xticks(ticks, [f"{t:,}" for t in ticks])
        a.minorticks_off()
        a.set_xlabel("streamed history (tokens)")
    ax.set_yscale("log")
    ax.set_ylabel("next-update latency (ms, median)")
    ax.set_title("Per-update latency (CPU, impl=reference)")
    ax2.set_yscale("log")
    ax2.set_ylabel("retained cells")
    ax2.set_title("Retained KV cells at the checkpoint")
    if speedup is not None:
        y = next(r["update_ms"] for r in rows if r["policy"] == "omnipick" and r["history_tokens"] == top)
        ax.annotate(f"NoSlide / OmniPick = {speedup:.2f}x", xy=(top, y), xytext=(0.35, 0.9),
                    textcoords="axes fraction", arrowprops=dict(arrowstyle="->"))
    ax.legend(fontsize=7)
    harness.save_png(fig, out, "retention")


if __name__ == "__main__":
    main()
