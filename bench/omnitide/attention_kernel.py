"""Attention time over captured cache layouts: full context vs OmniPick under each paging mode (seed 000 Figures
10/11 kernel panels and Figure 15).

Layout capture. A synthetic Qwen2.5-Omni session (`synthetic.qwen_av_session`: a system prompt, then 2 s audiovisual
units of 124 tokens, or `--qwen-unit paper`: 1 s units of 909) is streamed past `--tokens` tokens, one chunk per
`Session.feed` (`impl="xla"`), through a narrow one-layer writer decoder (`TINY_OMNI` with one layer). Retention and
paging decide from unit, span, order and position metadata only, never from the cached values, so the layout a
writer leaves (page table, live slots, write order) is the layout the real model would leave. Configurations:
NoSlide (full context, a pool large enough for the whole stream; only its 4K/8K/16K/32K checkpoints are kept: the
first chunk whose streamed total reaches each), and `OmniPick()` (2500/1800 watermarks, a 48-page pool) under paging
`native`, `tile_skip`, `ordered_suffix`, `eager`, kept after every chunk together with the chunk's `stats.moved`.

Attention timing. Qwen2.5-Omni-7B attention shapes (28 query heads, 4 KV heads, head dim 128), float32, random K/V
pages `[N, 64, 4, 128]` sized to the configuration's pool (one compile per pool shape), one layer, jitted
`attention.attend(..., impl="xla")`, which loops over each sequence's active pages only. For each captured layout:
prefill = the next unit's 124 queries, decode = 1 query; their `q_order` follows every cached write order and their
`write_slots` are -1, so they attend to the cached slots only (the chunk's own tokens are not part of the layout).

Migration cost (OmniPage modes). A mode runs once per evicting chunk. To time what it does, a shadow session with
the same placement but no relayout re-feeds that chunk from the previous state, which yields the exact cache the
mode received; the mode function itself (`omnipage.tile_skip`, `omnipage.ordered_suffix`, `eager.compact`: plan,
gather-then-scatter copy, page bookkeeping) is then timed on a one-layer cache of the 7B shapes holding that layout,
with its input buffer donated (in buffers the runtime owns, so the update is in place). The K/V copy loops over the
listed moves only (`migration.apply_moves`); `bench/omnitide/migration_cost.py` splits the time into plan, copy and page
bookkeeping. Its returned moved count is checked against the session's `stats.moved`. A session runs the mode inside
its jitted step, while here each migration is a call of its own, so the time of the same call doing no work (a
jitted read of one value of the same cache, `dispatch_floor`) is timed beside every event and subtracted; both
figures are reported.
Attention is per layer and the copy is per layer, so the units match; the planner runs once per chunk for the whole
model, so charging it per layer overstates OmniPage's cost. The migration total is added to both the prefill and the
decode totals of `tile_skip` and `ordered_suffix`; `eager` is the oracle and excludes it (its cost is still
reported). A session migrates once per evicting chunk, in the chunk step after prefill and retention, so the decode
total charges it a second time (the least favourable accounting). The share of eager's saving recovered is also given
for attention alone, without migration: for decode, that is the share with migration charged once, where it runs.

Timing discipline: every case (checkpoint layouts, sampled session layouts, migration events) is run once per round,
interleaved, after two warm-up calls per compiled shape; figures are medians over `--repeats` rounds, and ratios are
medians of same-round ratios. The cumulative attention time uses every `--every`-th chunk, scaled by `--every`
(migration events are all timed). The exact active-page sums over all chunks are reported alongside as the
layout-only prediction of the same ratios.

Accelerators. `--impl pallas` times the block-sparse Triton kernel instead (a GPU; on CPU it would time the Pallas
interpreter). `--inner L` runs each attention call L times in sequence inside one jitted loop (each repetition's
queries depend on the previous output, like stacked layers) and migrates an L-layer cache in one call, then divides
by L: on a GPU one small call is mostly launch overhead, and this reports per-layer device time instead (`--unroll`:
the L calls as straight-line code, without the loop's counter and compare between them). `--splits S`
(with `--impl pallas`) times the kernel with each sequence's active pages split over S programs (split-K).
`--save-layouts F` pickles the captured layouts and `--layouts F` loads them instead of capturing (capture is host
work; it can run on another machine). `--profile DIR` traces the calls at the last checkpoint and reports the device
kernels each launches (on a GPU; see `bench/omnitide/_device_profile.py`).

Run: `python -m bench.omnitide.attention_kernel [--tokens 32768] [--repeats 5] [--every 3] [--impl xla]
[--dtype float32] [--inner 1] [--unroll] [--splits 1] [--layouts F | --save-layouts F] [--profile DIR]
[--out bench/out] [--smoke]`
(`--smoke`: 400 tokens, checkpoints 200 and 400, OmniPick at 300/200 in a 12-page pool, one round; the layouts are
saved to `<out>/smoke_layouts.pkl`, where the layout readers' `--smoke` runs find them.)
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import omnijax
from bench import harness
from bench.omnitide._device_profile import describe, trace_calls
from omnijax.kernels.block_sparse_attention import block_sparse_attention
from omnijax.kv import attention
from omnijax.models.config import TINY_OMNI
from omnijax.paging import Paging, eager, omnipage
from omnijax.retention import NoSlide, OmniPick
from omnijax.testing import synthetic

H, G, D = 28, 4, 128  # Qwen2.5-Omni-7B attention
PAGE, OMNI_POOL = 64, 48
UNIT = synthetic.qwen_unit_tokens()  # 124: one default 2 s unit (`--qwen-unit` picks another kind)
CHECKPOINTS = (4096, 8192, 16384, 32768)
MODES = ("native", "tile_skip", "ordered_suffix", "eager")
MODE_FNS = {"tile_skip": lambda kv: omnipage.tile_skip(kv, 32),
            "ordered_suffix": lambda kv: omnipage.ordered_suffix(kv, 1), "eager": eager.compact}
PAPER = {"speedup_32k": 12.72, "recovered": {"prefill": 0.885, "decode": 0.821}}
# The cost of calling a jitted function on a cache and waiting for it, with no work: what a migration timed as its own
# call pays on top of what it costs inside a session step.
dispatch_floor = jax.jit(lambda kv: kv.num_free + kv.valid[0, 0])
# A donated input must be a buffer the runtime owns: one aliasing numpy memory (jax.device_put on CPU) cannot be
# updated in place, and a migration would be charged a copy of the whole cache.
owned = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


def pallas_attend(**kernel_options):
    """One layer's attention by the block-sparse kernel with explicit options (`attention.attend` uses its defaults);
    interpreted on CPU."""
    def attend(q, k, v, view):
        return block_sparse_attention(q, k, v, view.page_table, view.slot_valid, view.slot_order, view.q_order,
                                      index=view.pages, interpret=jax.default_backend() == "cpu", **kernel_options)
    return attend


@dataclasses.dataclass(frozen=True)
class _PlaceOnly(Paging):
    """Mode `native` (no relayout) with another mode's placement: yields the cache a paging mode receives."""

    place: str = "first_fit"

    @property
    def placement(self) -> str:
        return self.place


def capture(model, chunks, policy, paging, num_pages, keep=None):
    """Streams `chunks` one at a time; returns one numpy layout row per kept chunk (all chunks when `keep` is None)."""
    session = omnijax.Session(model, policy=policy, paging=paging, num_pages=num_pages, page_size=PAGE, impl="xla")
    shadow = None
    if paging in MODE_FNS:
        shadow = omnijax.Session(model, policy=policy, paging=_PlaceOnly(place=Paging(paging).placement),
                                 num_pages=num_pages, page_size=PAGE, impl="xla")
    rows, tokens = [], 0
    for i in range(chunks.token_ids.shape[0]):
        chunk = jax.tree.map(lambda x: x[i], chunks)
        prev = None if shadow is None else jax.tree.map(jnp.copy, session.state)  # `feed` donates the state
        out = session.feed(chunk)
        tokens += int(np.asarray(chunk.valid).sum())
        kv, st = session.state.kv, out.stats
        if bool(kv.exhausted.any()):
            raise RuntimeError(f"{paging}: pool of {num_pages} pages ran out at chunk {i}")
        if keep is not None and i not in keep:
            continue
        row = {"chunk": i, "tokens": tokens, "page_table": np.asarray(kv.page_table), "valid": np.asarray(kv.valid),
               "order": np.asarray(kv.order), "moved": int(st.moved[0]), "evicted": int(st.evicted[0]),
               "active_pages": int(st.layout.active_pages[0]), "retained": int(st.layout.retained_cells[0]),
               "span": int(st.layout.physical_span[0])}
        if shadow is not None and row["evicted"] > 0:
            shadow.state = prev
            shadow.feed(chunk)
            row["pre_kv"] = jax.tree.map(np.asarray, shadow.state.kv.replace(k=None, v=None))  # K/V come later
        rows.append(row)
    return rows


def attention_case(row, q, kv_pages):
    """Arguments of one attention call over a captured layout (queries after every cached write order), with the
    view indexed outside the timed call."""
    table, valid, order = row["page_table"], row["valid"], row["order"]
    pages = table[table >= 0]
    q0 = int(order[pages][valid[pages]].max()) + 1 if valid[pages].any() else 0
    T = q.shape[1]
    view = attention.CacheView(write_slots=jnp.full((1, T), -1, jnp.int32), page_table=jnp.asarray(table),
                               slot_valid=jnp.asarray(valid), slot_order=jnp.asarray(order),
                               q_order=jnp.asarray(q0 + np.arange(T, dtype=np.int32))[None])
    view = attention.index_pages(view)  # once per chunk, as a model does before its layer loop
    return (q,) + kv_pages + (view,)


def layered(attend, layers, unroll=False):
    """Jitted `attend` run `layers` times in sequence, each call's queries depending on the previous output.

    In a loop by default (as a model's layer scan runs it: each iteration also pays the loop's counter and
    compare); with `unroll`, as straight-line code, so the time per layer is the call and the one fusion that
    chains it to the previous output.
    """
    if layers == 1:
        return jax.jit(attend)

    def run(q, k, v, view):
        step = lambda _, out: attend(q + 1e-30 * out, k, v, view)  # the dependence keeps the calls sequential  # noqa: E731
        return jax.lax.fori_loop(0, layers, step, jnp.zeros_like(q), unroll=bool(unroll))

    return jax.jit(run)


def load_layouts(path, chunks, tokens):
    """Layouts saved by `--save-layouts`, checked against this run's stream."""
    saved = pickle.loads(Path(path).read_bytes())
    if (saved["chunks"], saved["tokens"]) != (chunks, tokens):
        raise ValueError(f"{path} holds {saved['chunks']} chunks / {saved['tokens']} tokens; this run streams "
                         f"{chunks} / {tokens} (use the same --tokens)")
    print(f"loaded layouts of {chunks} chunks, {tokens} tokens from {path}", flush=True)
    return saved["layouts"]


def timed_rounds(cases, repeats, warmup=2):
    """`harness.interleaved` as these scripts time: `warmup` (two) warm-up calls per compiled shape (`Case.key`), a
    progress line per round. Returns `[repeats, cases]` ms."""
    return harness.interleaved(cases, repeats, warmup=warmup, label="timing")


def layouts_path(args) -> Path:
    """`args.layouts`; with `--smoke` and none given, tiny layouts captured into `<out>/smoke_layouts.pkl` (once)."""
    if args.layouts is None and args.smoke:
        path = Path(args.out) / "smoke_layouts.pkl"
        if not path.exists():
            main(["--smoke", "--repeats", "0", "--save-layouts", str(path), "--out", args.out])
        return path
    return Path(args.layouts)


def main(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument("--tokens", type=int, default=32768, help="stream until the session has this many tokens")
    parser.add_argument("--checkpoints", type=int, nargs="+", default=list(CHECKPOINTS),
                        help="history checkpoints (tokens) of the full-context comparison")
    parser.add_argument("--watermarks", type=int, nargs=2, default=[2500, 1800], metavar=("HIGH", "LOW"),
                        help="OmniPick's watermarks")
    parser.add_argument("--omni-pool", type=int, default=OMNI_POOL, help="pages of the OmniPick pool")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (0 with --save-layouts: capture only)")
    parser.add_argument("--every", type=int, default=3, help="chunk stride of the cumulative attention time")
    parser.add_argument("--impl", choices=("xla", "pallas"), default="xla", help="attention implementation timed")
    parser.add_argument("--pages-per-block", type=int, default=0,
                        help="impl=xla with this many pages per online-softmax step (a power of two; 0: "
                             "attention.block_pages chooses from the shapes; 1: one page per step)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="query and K/V dtype")
    parser.add_argument("--inner", type=int, default=1, help="layers per timed call (amortises launch overhead)")
    parser.add_argument("--splits", type=int, default=1,
                        help="with --impl pallas: split each sequence's active pages over this many programs")
    parser.add_argument("--unroll", action="store_true",
                        help="run the --inner calls as straight-line code, not in a loop (no loop counter per call)")
    parser.add_argument("--qwen-unit", default="2s", choices=sorted(synthetic.QWEN_UNITS),
                        help="unit kind of the session (omnijax.testing.synthetic.QWEN_UNITS); prefill times one unit")
    parser.add_argument("--save-layouts", help="pickle the captured layouts to this file")
    parser.add_argument("--layouts", help="load captured layouts from this file instead of capturing")
    parser.add_argument("--profile", help="trace the last checkpoint's calls into this directory (kernels per call)")
    args = harness.parse(parser, argv, smoke=dict(tokens=400, checkpoints=[200, 400], watermarks=[300, 200],
                                                  omni_pool=12, repeats=1, every=4))
    if args.inner < 1:
        parser.error(f"--inner must be at least 1, got {args.inner}")
    if args.tokens < min(args.checkpoints):
        parser.error(f"--tokens must reach the first history checkpoint, {min(args.checkpoints)}; got {args.tokens}")
    if args.splits < 1 or (args.splits > 1 and args.impl != "pallas"):
        parser.error(f"--splits must be at least 1, and above 1 only with --impl pallas (got {args.splits})")
    out = harness.output_dir(args)
    if args.smoke and args.layouts is None and args.save_layouts is None:
        args.save_layouts = str(out / "smoke_layouts.pkl")  # what the layout readers' --smoke runs load (layouts_path)
    t_run = time.perf_counter()
    omni_pool = args.omni_pool
    writer_cfg = TINY_OMNI.replace(num_layers=1)
    writer = omnijax.Decoder(writer_cfg)
    unit = synthetic.qwen_unit_tokens(args.qwen_unit)
    chunks = synthetic.qwen_av_session(math.ceil(args.tokens / unit) + 1, vocab_size=writer_cfg.vocab_size,
                                       unit_kind=args.qwen_unit)
    cum = np.cumsum(np.asarray(chunks.valid).sum(axis=(1, 2)))
    n = int(np.argmax(cum >= args.tokens)) + 1  # stop at the first chunk past --tokens
    chunks = jax.tree.map(lambda x: x[:n], chunks)
    checkpoints = {L: int(np.argmax(cum >= L)) for L in sorted(args.checkpoints) if L <= cum[n - 1]}
    full_pool = math.ceil(int(cum[n - 1]) / PAGE) + 2

    if args.layouts:
        layouts = load_layouts(args.layouts, n, int(cum[n - 1]))
    else:
        layouts = {}
        for name, policy, paging, pool, keep in [("full", NoSlide(), "native", full_pool,
                                                  set(checkpoints.values()))] + [
                (m, OmniPick(*args.watermarks), m, omni_pool, None) for m in MODES]:
            start = time.perf_counter()
            layouts[name] = capture(writer, chunks, policy, paging, pool, keep)
            print(f"captured {name:>14}: {n} chunks, {int(cum[n - 1])} tokens, pool {pool} pages, "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    if args.save_layouts:
        path = Path(args.save_layouts)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # a reader never sees half a file
        partial.write_bytes(pickle.dumps({"chunks": n, "tokens": int(cum[n - 1]), "qwen_unit": args.qwen_unit,
                                          "layouts": layouts}))
        os.replace(partial, path)
        print(f"wrote {args.save_layouts}", flush=True)
        if args.repeats == 0:
            return

    rng = np.random.default_rng(0)
    rand = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32), args.dtype)  # noqa: E731
    qs = {"prefill": rand(1, unit, H, D), "decode": rand(1, 1, H, D)}
    kv_pages = {pool: (rand(pool, PAGE, G, D), rand(pool, PAGE, G, D)) for pool in (full_pool, omni_pool)}
    if args.pages_per_block:  # impl=xla with a fixed block (1: the page-at-a-time loop it replaced)
        one_layer = lambda q, k, v, view: attention.attend_xla(q, k, v, view, pages_per_block=args.pages_per_block)  # noqa: E731
    elif args.splits == 1:
        one_layer = lambda q, k, v, view: attention.attend(q, k, v, view, impl=args.impl)  # noqa: E731
    else:  # the kernel itself: `attention.attend` runs it unsplit
        one_layer = pallas_attend(num_splits=args.splits)
    attend = layered(one_layer, args.inner, args.unroll)
    cases, index = [], {}  # index[(kind, config, chunk, phase)] = case column

    def add(key, prepare, fn, tag):
        index[tag] = len(cases)
        cases.append(harness.Case(fn, prepare, key))

    for L, c in checkpoints.items():  # Figure 10/11 analogue
        for name in ("full",) + MODES:
            row = next(r for r in layouts[name] if r["chunk"] == c)
            pool = full_pool if name == "full" else omni_pool
            for phase, q in qs.items():
                a = attention_case(row, q, kv_pages[pool])
                add((pool, phase), lambda a=a: a, attend, ("ckpt", name, c, phase))
    sampled = list(range(0, n, args.every))
    for c in sampled:  # Figure 15 analogue: the four modes side by side at every sampled chunk
        for m in MODES:
            for phase, q in qs.items():
                a = attention_case(layouts[m][c], q, kv_pages[omni_pool])
                add((omni_pool, phase), lambda a=a: a, attend, ("cum", m, c, phase))
    k7, v7 = (np.asarray(jnp.asarray(rng.standard_normal((args.inner, omni_pool, PAGE, G, D), dtype=np.float32),
                                     args.dtype)) for _ in range(2))
    for m, fn in MODE_FNS.items():
        jfn = jax.jit(fn, donate_argnums=0)  # one call moves all args.inner layers
        for row in layouts[m]:
            if "pre_kv" in row:
                prepare = lambda kv=row["pre_kv"]: (owned(kv.replace(k=k7, v=v7)),)  # noqa: E731
                got = int(jfn(*prepare())[1][0])
                if got != row["moved"]:
                    raise RuntimeError(f"{m} chunk {row['chunk']}: mode moved {got}, session moved {row['moved']}")
                add(("mig", m), prepare, jfn, ("mig", m, row["chunk"], None))
                add("floor", prepare, dispatch_floor, ("floor", m, row["chunk"], None))
    print(f"timing {len(cases)} cases per round ({len(checkpoints)} checkpoints, {len(sampled)} sampled chunks x "
          f"{len(MODES)} modes, {sum(1 for t in index if t[0] == 'mig')} migration events)", flush=True)
    ms = timed_rounds(cases, args.repeats) / args.inner  # [R, cases], per layer
    profile = {}
    if args.profile:  # what one call at the last checkpoint launches, per configuration and phase
        last = checkpoints[max(checkpoints)]
        for name in ("full",) + MODES:
            for phase in qs:
                case = cases[index["ckpt", name, last, phase]]
                prepare, fn = case.prepare, case.fn
                profile[f"{name}_{phase}"] = trace_calls([(fn, prepare)] * 3, Path(args.profile) / f"{name}_{phase}")
                print(f"  profile {name:>14} {phase:>7} (a {args.inner}-layer call): "
                      f"{describe(profile[f'{name}_{phase}'])}", flush=True)
    col = lambda *tag: ms[:, index[tag]]  # noqa: E731

    ckpt_rows = []
    for L, c in checkpoints.items():
        for name in ("full",) + MODES:
            row = next(r for r in layouts[name] if r["chunk"] == c)
            full_pages = next(r for r in layouts["full"] if r["chunk"] == c)["active_pages"]
            entry = {"checkpoint": L, "history_tokens": row["tokens"], "config": name, "retained": row["retained"],
                     "active_pages": row["active_pages"], "pages_ratio": full_pages / row["active_pages"]}
            for phase in qs:
                t = col("ckpt", name, c, phase)
                entry[f"{phase}_ms"] = float(np.median(t))
                entry[f"{phase}_speedup"] = float(np.median(col("ckpt", "full", c, phase) / t))
            ckpt_rows.append(entry)

    totals = {}  # [R] seconds per (mode, phase): attention (scaled by --every) and migration
    for m in MODES:
        events = [r["chunk"] for r in layouts[m] if "pre_kv" in r]
        gross = sum((col("mig", m, c, None) for c in events), np.zeros(args.repeats))
        floor = sum((col("floor", m, c, None) for c in events), np.zeros(args.repeats))
        totals[m, "mig"], totals[m, "floor"] = (gross - floor) / 1e3, floor / 1e3  # charged: net of dispatch
        for phase in qs:
            totals[m, phase] = args.every * sum(col("cum", m, c, phase) for c in sampled) / 1e3
    charged = lambda m, phase: totals[m, phase] + (totals[m, "mig"] if m in ("tile_skip", "ordered_suffix") else 0)  # noqa: E731
    pages_sum = {m: sum(r["active_pages"] for r in layouts[m]) for m in MODES}
    oracle_pages = pages_sum["native"] - pages_sum["eager"]  # 0 when nothing trimmed: recovered shares are undefined
    if not oracle_pages:
        print("eager removes no active page in this session (nothing trimmed?): recovered shares are undefined (nan)")
    cum_rows = []
    for m in MODES:
        entry = {"mode": m, "migration_s": float(np.median(totals[m, "mig"])),
                 "migration_dispatch_floor_s": float(np.median(totals[m, "floor"])), "migration_charged": m != "eager"
                 and m != "native", "moved_slots": sum(r["moved"] for r in layouts[m]),
                 "migration_events": sum(1 for r in layouts[m] if "pre_kv" in r), "active_page_chunks": pages_sum[m],
                 "pages_reduction": 1 - pages_sum[m] / pages_sum["native"],
                 "pages_recovered": (pages_sum["native"] - pages_sum[m]) / oracle_pages if oracle_pages else math.nan}
        for phase in qs:
            nat, eag, mine = charged("native", phase), charged("eager", phase), charged(m, phase)
            entry[f"{phase}_attention_s"] = float(np.median(totals[m, phase]))
            entry[f"{phase}_total_s"] = float(np.median(mine))
            entry[f"{phase}_reduction"] = float(np.median(1 - mine / nat))
            entry[f"{phase}_recovered"] = float(np.median((nat - mine) / (nat - eag)))
            a_nat, a_eag, a_mine = totals["native", phase], totals["eager", phase], totals[m, phase]
            entry[f"{phase}_recovered_attention_only"] = float(np.median((a_nat - a_mine) / (a_nat - a_eag)))
        cum_rows.append(entry)

    print(f"\nattention per layer (ms, median of {args.repeats}) at history checkpoints; speedup vs full context")
    print(f"{'ckpt':>6} {'tokens':>6} {'config':>14} {'pages':>5} {'x':>5} {'prefill':>8} {'x':>6} {'decode':>7} "
          f"{'x':>6}")
    for r in ckpt_rows:
        print(f"{r['checkpoint']:>6} {r['history_tokens']:>6} {r['config']:>14} {r['active_pages']:>5} "
              f"{r['pages_ratio']:>5.1f} {r['prefill_ms']:>8.1f} {r['prefill_speedup']:>6.2f} {r['decode_ms']:>7.2f} "
              f"{r['decode_speedup']:>6.2f}")
    print(f"\ncumulative attention over {n} chunks (every {args.every}-th timed, x{args.every}), seconds per layer; "
          "OmniPage modes include migration (net of its call's dispatch, shown as disp.), eager excludes it; "
          "(attn) = recovered share without migration")
    print(f"{'mode':>14} {'prefill':>8} {'red.':>6} {'recov.':>6} {'(attn)':>6} {'decode':>7} {'red.':>6} "
          f"{'recov.':>6} {'(attn)':>6} {'mig s':>6} {'disp.':>6} {'moved':>6} {'pages':>6} {'p.red':>6} "
          f"{'p.rec':>6}")
    for r in cum_rows:
        print(f"{r['mode']:>14} {r['prefill_total_s']:>8.2f} {r['prefill_reduction']:>6.1%} "
              f"{r['prefill_recovered']:>6.1%} {r['prefill_recovered_attention_only']:>6.1%} "
              f"{r['decode_total_s']:>7.3f} {r['decode_reduction']:>6.1%} {r['decode_recovered']:>6.1%} "
              f"{r['decode_recovered_attention_only']:>6.1%} {r['migration_s']:>6.3f} "
              f"{r['migration_dispatch_floor_s']:>6.3f} {r['moved_slots']:>6} "
              f"{r['active_page_chunks']:>6} {r['pages_reduction']:>6.1%} {r['pages_recovered']:>6.1%}")
    top = max(checkpoints)
    best = {r["config"]: r for r in ckpt_rows if r["checkpoint"] == top}
    print(f"speedup vs full context at {top}: " + ", ".join(
        f"{m} {best[m]['prefill_speedup']:.2f}x/{best[m]['decode_speedup']:.2f}x (prefill/decode)" for m in MODES)
          + f"; paper {PAPER['speedup_32k']}x")
    runtime = time.perf_counter() - t_run
    print(f"total runtime {runtime:.0f} s")
    shapes = {"heads": H, "kv_heads": G, "head_dim": D, "dtype": args.dtype, "impl": args.impl, "splits": args.splits}
    summary = {"attention_shapes": shapes,
               "device": str(jax.devices()[0].device_kind), "inner_layers": args.inner, "unrolled": args.unroll,
               "writer_config": writer_cfg.to_json(), "page_size": PAGE, "omnipick_pool_pages": omni_pool,
               "omnipick_watermarks": args.watermarks,
               "full_pool_pages": full_pool, "qwen_unit": args.qwen_unit, "chunks": n, "tokens": int(cum[n - 1]),
               "every": args.every,
               "repeats": args.repeats, "paper": PAPER, "runtime_s": runtime, "checkpoints": ckpt_rows,
               "cumulative": cum_rows, "profile": profile}
    stem = "attention_kernel" if jax.default_backend() == "cpu" and args.impl == "xla" else \
        f"attention_kernel_{jax.default_backend()}_{args.impl}_{args.dtype}" + \
        (f"_splits{args.splits}" if args.splits > 1 else "")
    stem += ("_unrolled" if args.unroll else "") + ("" if args.qwen_unit == "2s" else f"_{args.qwen_unit}")
    harness.write_json(out, stem, summary, indent=2)
    plot(ckpt_rows, cum_rows, out, stem, f"{summary['device']}, impl={args.impl}, {args.dtype}"
         + (f", {args.splits} splits" if args.splits > 1 else "") + (", unrolled" if args.unroll else ""))


def plot(ckpt_rows, cum_rows, out, stem, where):
    fig, axes = harness.pyplot().subplots(1, 3, figsize=(14, 4), gridspec_kw={"width_ratios": [1.4, 1, 1]})
    ax = axes[0]
    for i, name in enumerate(("full",) + MODES):
        mine = [r for r in ckpt_rows if r["config"] == name]
        x = [r["checkpoint"] for r in mine]
        ax.plot(x, [r["prefill_ms"] for r in mine], "o-", color=f"C{i}", label=f"{name} prefill (one unit of q)")
        ax.plot(x, [r["decode_ms"] for r in mine], "s--", color=f"C{i}", label=f"{name} decode (1 q)")
    ax.set_xscale("log", base=2)
    ticks = sorted({r["checkpoint"] for r in ckpt_rows})
    ax.set_xticks(ticks, [f"{c // 1024}K" if c >= 1024 else str(c) for c in ticks])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("streamed history")
    ax.set_ylabel("attention ms per layer (median)")
    ax.set_title(f"Qwen-7B attention shapes, {where}")
    ax.legend(fontsize=6, ncol=2)
    for ax, phase in zip(axes[1:], ("prefill", "decode")):
        x = np.arange(len(cum_rows))
        attn = [r[f"{phase}_attention_s"] for r in cum_rows]
        mig = [r["migration_s"] if r["migration_charged"] else 0.0 for r in cum_rows]
        ax.bar(x, attn, color=[f"C{i + 1}" for i in x])
        ax.bar(x, mig, bottom=attn, color="k", alpha=0.5, label="migration (charged)")
        for i, r in enumerate(cum_rows):
            note = "copy excluded" if r["mode"] == "eager" else "" if r["mode"] == "native" \
                else f"{r[f'{phase}_recovered']:.0%} of eager"
            label = "baseline" if r["mode"] == "native" else f"{-r[f'{phase}_reduction']:+.1%}\n{note}"
            ax.text(i, attn[i] + mig[i], label, ha="center",
                    va="bottom", fontsize=7)
        ax.set_xticks(x, [r["mode"] for r in cum_rows], fontsize=8)
        ax.set_ylabel("cumulative attention s per layer")
        ax.set_title(f"{phase}: whole OmniPick session")
        ax.set_ylim(0, 1.4 * max(a + m for a, m in zip(attn, mig)))
        ax.legend(fontsize=7, loc="upper left")
    harness.save_png(fig, out, stem)


if __name__ == "__main__":
    main()
