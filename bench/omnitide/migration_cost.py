"""Where a paging mode's migration time goes: planning, K/V copy and page bookkeeping, per evicting chunk.

`bench/omnitide/attention_kernel.py` charges each OmniPage mode its whole migration (the mode function: plan, copy,
bookkeeping) and finds it decides whether a mode recovers 90 % of the eager oracle's attention saving. This script
splits that cost so the part worth optimising is known, on CPU or on a GPU:

- `floor`: a jitted call that reads the cache and returns one scalar (dispatch and argument handling, no work);
- `plan`: the mode's planner alone (`plan_tile_skip`; `plan_ordered_suffix` after the empty-entry drop that
  `ordered_suffix` does first; `eager.plan`), returning the plan;
- `copy`: `migration.apply_plan` with the plan precomputed (move listing, slot fields, the K/V copy loop), cache
  donated, once per `--chunks` value (slots moved per step of the copy loop; fewer steps, more padding);
- `mode`: the mode function as the session runs it (`omnipage.tile_skip(kv, 32)`, `omnipage.ordered_suffix(kv, 1)`,
  `eager.compact`), cache donated. `mode - plan - copy + floor` is the rest: promotion, page-table drop, pool release.

Input: the layouts that `bench/omnitide/attention_kernel.py --save-layouts F` pickles. Each evicting chunk's row holds
the exact cache the mode received (`pre_kv`, without K/V); the cache gets random K/V of the Qwen2.5-Omni-7B shapes with
`--layers` layers, in buffers the runtime owns (so donation updates in place). Every event of every mode and part is run
once per round, interleaved, after two warm-up calls per compiled function; figures are medians over `--repeats` rounds,
per event and summed over the session, in ms for the whole cache and per layer.

`--profile DIR` also traces the plan, copy (first `--chunks` value) and mode calls of each mode with
`jax.profiler.trace(DIR/mode/part)` (open with TensorBoard or Perfetto) and reports, per call, the device events
(kernels on a GPU; none on CPU, where everything is host work) and their summed time, also in the JSON.

Run: `python -m bench.omnitide.migration_cost --layouts .layouts/layouts_32k.pkl [--layers 28] [--dtype float32]
[--chunks 256] [--repeats 5] [--events N] [--profile DIR] [--out bench/out] [--smoke]`
(`--smoke`: one layer, one event per mode, one round, on tiny layouts that `attention_kernel.py --smoke` captures.)
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from bench.omnitide._device_profile import describe, trace_calls
from bench.omnitide.attention_kernel import MODE_FNS, D, G, dispatch_floor, layouts_path, owned, timed_rounds
from omnijax.paging import eager, migration, omnipage

PLANS = {  # the planner of each mode, as the mode runs it
    "tile_skip": lambda kv: omnipage.plan_tile_skip(kv, 32),
    "ordered_suffix": lambda kv: omnipage.plan_ordered_suffix(migration.drop_empty_entries(kv), 1),
    "eager": lambda kv: omnipage.MigrationPlan(dst=eager.plan(kv), accepted=jnp.ones((kv.batch,), bool)),
}


def copy_input(mode: str, kv):
    """The cache `apply_plan` receives inside `mode` (ordered_suffix drops empty entries before planning)."""
    return migration.drop_empty_entries(kv) if mode == "ordered_suffix" else kv


def main(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument("--layouts", default=".layouts/layouts_32k.pkl",
                        help="layouts pickled by bench.omnitide.attention_kernel --save-layouts (--smoke: tiny ones)")
    parser.add_argument("--layers", type=int, default=28, help="layers of K/V moved per call (Qwen2.5-Omni-7B: 28)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--chunks", type=int, nargs="+", default=[256], help="copy-loop step sizes to time")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--events", type=int, help="time only the first N evicting chunks of each mode")
    parser.add_argument("--profile", help="trace the plan, copy and mode calls into this directory (kernels per call)")
    args = harness.parse(parser, argv, smoke=dict(layouts=None, layers=1, chunks=[64], repeats=1, events=1))
    if args.layers < 1 or any(c < 1 or c & (c - 1) for c in args.chunks):
        parser.error("--layers must be >= 1 and every --chunks value a power of two")
    path = layouts_path(args)
    if not path.exists():
        parser.error(f"{path} not found; write it with: python -m bench.omnitide.attention_kernel --repeats 0 "
                     f"--save-layouts {path}")
    t_run = time.perf_counter()
    layouts = pickle.loads(path.read_bytes())["layouts"]
    events = {m: [r for r in layouts[m] if "pre_kv" in r][:args.events] for m in MODE_FNS}
    N, P = events["tile_skip"][0]["pre_kv"].valid.shape
    rng = np.random.default_rng(0)
    k, v = (np.asarray(jnp.asarray(rng.standard_normal((args.layers, N, P, G, D), dtype=np.float32), args.dtype))
            for _ in range(2))
    copy_fns = {c: jax.jit(lambda kv, dst, ok, c=c: migration.apply_plan(kv, dst, ok, chunk=c), donate_argnums=0)
                for c in args.chunks}
    prepare_copy = {m: jax.jit(lambda kv, m=m: copy_input(m, owned(kv))) for m in MODE_FNS}
    cases, index = [], {}

    def add(key, prepare, fn, tag):
        index[tag] = len(cases)
        cases.append(harness.Case(fn, prepare, key))

    for m, mode_fn in MODE_FNS.items():
        plan_fn, jmode = jax.jit(PLANS[m]), jax.jit(mode_fn, donate_argnums=0)
        for row in events[m]:
            prepare = lambda kv=row["pre_kv"]: (owned(kv.replace(k=k, v=v)),)  # noqa: E731
            kv0 = prepare()[0]
            plan = plan_fn(kv0)
            dst, ok = plan.dst, plan.accepted
            got = int(jnp.sum((dst >= 0) & ok[:, None]))
            if got != row["moved"]:
                raise RuntimeError(f"{m} chunk {row['chunk']}: plan moves {got}, the session moved {row['moved']}")
            del kv0  # caches are built per call: 99 events of a 28-layer cache would not fit in memory
            add("floor", prepare, dispatch_floor, (m, row["chunk"], "floor"))
            add(("plan", m), prepare, plan_fn, (m, row["chunk"], "plan"))
            for c, fn in copy_fns.items():
                add(("copy", m, c), lambda kv=row["pre_kv"], d=dst, o=ok: (prepare_copy[m](kv.replace(k=k, v=v)), d, o),
                    fn, (m, row["chunk"], f"copy{c}"))
            add(("mode", m), prepare, jmode, (m, row["chunk"], "mode"))
    print(f"timing {len(cases)} cases per round ({sum(map(len, events.values()))} events, {args.layers} layers, "
          f"{args.dtype}, {jax.devices()[0].device_kind})", flush=True)
    ms = timed_rounds(cases, args.repeats)  # [R, cases]
    c0 = f"copy{args.chunks[0]}"  # the copy taken out of the mode for `rest` (the mode itself steps 256 slots)
    parts = ["floor", "plan"] + [f"copy{c}" for c in args.chunks] + ["mode"]
    kernels = profile_parts(cases, index, events, ["plan", c0, "mode"], Path(args.profile)) if args.profile else {}

    rows = []
    for m in MODE_FNS:
        session = {p: np.sum([ms[:, index[m, r["chunk"], p]] for r in events[m]], axis=0) for p in parts}  # [R]
        entry = {"mode": m, "events": len(events[m]), "moved_slots": sum(r["moved"] for r in events[m]),
                 "layers": args.layers, "dtype": args.dtype, "device": jax.devices()[0].device_kind}
        for p in parts:
            entry[f"{p}_ms_per_event"] = float(np.median(session[p])) / len(events[m])
            entry[f"{p}_ms_session_per_layer"] = float(np.median(session[p])) / args.layers
        rest = session["mode"] - session["plan"] - session[c0] + session["floor"]
        entry["rest_ms_per_event"] = float(np.median(rest)) / len(events[m])
        entry["profile"] = kernels.get(m, {})
        rows.append(entry)

    print(f"\nms per evicting chunk for the whole {args.layers}-layer cache (median of {args.repeats}); last column: "
          f"the mode over the session, per layer")
    print(f"{'mode':>14} {'events':>6} {'moved':>6} " + " ".join(f"{p:>9}" for p in parts)
          + f" {'rest':>7} {'ms/layer':>8}")
    for r in rows:
        print(f"{r['mode']:>14} {r['events']:>6} {r['moved_slots']:>6} "
              + " ".join(f"{r[f'{p}_ms_per_event']:>9.3f}" for p in parts)
              + f" {r['rest_ms_per_event']:>7.3f} {r['mode_ms_session_per_layer']:>8.3f}")
    out = harness.output_dir(args)
    print(f"total runtime {time.perf_counter() - t_run:.0f} s")
    harness.write_json(out, "migration_cost", rows)
    plot(rows, args, out)


def profile_parts(cases, index, events, parts, root: Path) -> dict:
    """Traces each (mode, part) over its events into `root/mode/part` and summarises the device kernels per call."""
    summary = {}
    for m in events:
        for p in parts:
            calls = [(c.fn, c.prepare) for c in (cases[index[m, r["chunk"], p]] for r in events[m])]
            summary.setdefault(m, {})[p] = trace_calls(calls, root / m / p)
            print(f"  profile {m:>14} {p:>8}: {describe(summary[m][p])}", flush=True)
    return summary


def plot(rows, args, out):
    c0 = f"copy{args.chunks[0]}"
    fig, ax = harness.pyplot().subplots(figsize=(6.5, 3.8))
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for key, label in (("plan", "plan"), (c0, f"copy (chunk {args.chunks[0]})"), ("rest", "bookkeeping (rest)")):
        h = np.array([max(r[f"{key}_ms_per_event"], 0.0) for r in rows])
        ax.bar(x, h, bottom=bottom, label=label)
        bottom += h
    ax.plot(x, [r["mode_ms_per_event"] for r in rows], "k_", markersize=30, label="mode (timed whole)")
    ax.plot(x, [r["floor_ms_per_event"] for r in rows], "r_", markersize=30, label="dispatch floor")
    ax.set_xticks(x, [f"{r['mode']}\n{r['moved_slots'] / r['events']:.0f} slots/event" for r in rows])
    ax.set_ylabel(f"ms per evicting chunk ({args.layers} layers)")
    ax.set_title(f"Migration cost by part, {rows[0]['device']}, {args.dtype}")
    ax.legend(fontsize=8)
    harness.save_png(fig, out, "migration_cost")


if __name__ == "__main__":
    main()
