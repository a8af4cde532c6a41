"""Physical KV span of the native (no-compaction) layout under other slot-placement rules, same retention decisions.

Question: how long would the page-rounded physical span of the native layout be if new tokens were placed by a
different rule (llama.cpp-style contiguous or head-cursor placement instead of omnijax's token-by-token first fit)?

Why a replay is exact: OmniPick's retention decisions read only token metadata (unit, span, order, position), never
the slot a token sits in, so the set of live tokens after every chunk is the same whatever the placement rule. The
recorded native layouts therefore give, per chunk, the live set of write orders, and any placement rule can be
replayed against that sequence of live sets in plain numpy.

Input: the layouts pickled by `bench/omnitide/attention_kernel.py --save-layouts` (default `.layouts/layouts_32k.pkl`,
Qwen2.5-Omni session, 266 chunks = 32,884 tokens, page size 64, pool of 48 pages). Its `native` rows hold per chunk
(after the chunk's trim) `page_table [1, M]`, `valid [N, P]` and `order [N, P]` indexed by physical page, and the
library's `span` and `retained`. Table-space index of entry e, offset o is `e * P + o`; the library's span is
`P * (last table entry holding a live slot + 1)`, which the script recomputes from `valid` and checks.

Method, per chunk i:
  1. live set L_i = write orders of the live slots after the chunk (`order[valid]` through the page table).
  2. new tokens N_i = orders in [tokens_{i-1}, tokens_i) (write orders are a global counter; the script checks
     that the new orders seen in the data are exactly those, i.e. contiguous increments).
  3. each rule places N_i (one "ubatch") into a table-space slot map, then the trim frees every slot whose order is
     not in L_i.
  4. recorded: span = P * ceil((highest live slot + 1) / P), live count, and the eager span ceil(live / P) * P
     (the fully packed oracle).

Rules (table space of P-slot pages, unbounded table unless noted):
  first_fit                each new token, in order, takes the lowest free slot (omnijax `reserve`, placement
                           `first_fit`: holes below the high-water mark, then the mark on). Replays the library.
  contiguous               a chunk's new tokens need one contiguous run of free slots; the first such run from
                           slot 0 (llama.cpp `find_slot` before non-contiguous slots, without the head cursor).
  contiguous_next_fit      contiguous run searched from a head cursor (slot after the last placed token); when the
                           run would pass the capacity (`--capacity-pages` * P) the search wraps to 0; head advances
                           past the placed run (llama.cpp's ring-buffer slot search). Failing to fit is reported.
  contiguous_next_fit_reset  the same plus llama.cpp's heuristic: if head > used + 2 * n,
                           reset head to 0 before the search.
  next_fit_noncontiguous   llama.cpp with non-contiguous cells (`find_slot`): head reset as above, then the
                           first n free cells at or after head, wrapping at the capacity; head = last cell + 1.

A ubatch that does not fit the ring (no free run, or fewer free cells than tokens) is where llama.cpp's decode
would fail; the replay records the chunk, places the ubatch past the ring and goes on, so those rules' later spans
exceed the pool and are flagged in the tables.

Reported at the last chunk (the 32K checkpoint) and as means over the chunks from the first trim on (after each
trim, and before it: the cache the chunk's own prefill sees): live cells, span per rule, span / live, the eager
reduction 1 - eager / span per rule and the peak span. Checks printed first: the recomputed span and live count
equal the library's, new write orders are contiguous, and first_fit's span and full slot map equal the library's.
Output: a table on stdout, `placement_sim.json` (summaries, checks, per-chunk spans) and `placement_sim.png` under
`--out`.

Paper reference (seed 000 §7.2.3, Qwen at 32K): useful 2,778 cells, native span 3,840 (span / useful 1.38),
OmniPage 2,816 (-26.7%), which is the eager span of 2,778 cells.

`--pad R` rounds every reported span up to R slots (a page multiple): llama.cpp pads the cells attention sees to
256 with flash attention. Layouts captured with `attention_kernel.py --qwen-unit paper` (909-token 1 s units) write
`placement_sim_paper.*`.

Run: `.venv/bin/python -m bench.omnitide.placement_sim [--layouts .layouts/layouts_32k.pkl] [--capacity-pages 48]
[--pad 256] [--out bench/out] [--smoke]`
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

import omnijax  # noqa: F401  (the pickle holds omnijax objects in some rows)
from bench import harness

RULES = ("first_fit", "contiguous", "contiguous_next_fit", "contiguous_next_fit_reset", "next_fit_noncontiguous")
PAPER = {"useful": 2778, "native_span": 3840, "omnipage_span": 2816, "reduction": 0.267}




def table_view(row, P):
    """Per table-space slot (entry e, offset o -> e * P + o): (live bool [S], order int [S])."""
    table = np.asarray(row["page_table"])[0]
    valid, order = np.asarray(row["valid"]), np.asarray(row["order"])
    pages = np.clip(table, 0, valid.shape[0] - 1)
    live = (valid[pages] & (table >= 0)[:, None]).reshape(-1)
    return live, order[pages].reshape(-1)


def round_up(x, to):
    """`x` (a count or an array of counts) rounded up to a multiple of `to` slots."""
    return -(-np.asarray(x) // to) * to


def span_of(live_slots, P):
    """Page-rounded extent of the live slots (table-space indices)."""
    return 0 if len(live_slots) == 0 else int(P * ((max(live_slots) + P) // P))


def read_stream(rows, P):
    """Per chunk: new orders, live set, library span and retained, library table-space slot of each live order."""
    stream, prev_tokens, prev_live = [], 0, set()
    seen_max = -1
    for row in rows:
        live, order = table_view(row, P)
        slots = np.flatnonzero(live)
        orders = order[slots]
        live_set = set(int(x) for x in orders)
        if len(live_set) != len(slots):
            raise ValueError(f"chunk {row['chunk']}: duplicate live orders")
        new = list(range(prev_tokens, row["tokens"]))
        # Check: the new orders visible in the data are exactly a contiguous increment of the token counter.
        seen_new = sorted(x for x in live_set if x > seen_max)
        if seen_new and (seen_new[0] < prev_tokens or seen_new[-1] >= row["tokens"]):
            raise ValueError(f"chunk {row['chunk']}: new orders {seen_new[0]}..{seen_new[-1]} outside "
                             f"[{prev_tokens}, {row['tokens']})")
        if not live_set <= prev_live | set(new):
            raise ValueError(f"chunk {row['chunk']}: a live order was neither live before nor new")
        stream.append({"chunk": int(row["chunk"]), "tokens": int(row["tokens"]), "new": new, "live": live_set,
                       "new_contiguous": seen_new == new, "evicted": int(row["evicted"]),
                       "lib_span": int(row["span"]), "lib_retained": int(row["retained"]),
                       "lib_span_recomputed": span_of(slots, P),
                       "lib_slot": dict(zip((int(x) for x in orders), (int(s) for s in slots)))})
        seen_max = max(seen_max, max(live_set, default=-1))
        prev_tokens, prev_live = row["tokens"], live_set
    return stream




class Placer:
    def __init__(self, rule, capacity):
        self.rule, self.capacity = rule, capacity
        self.occ = np.zeros(capacity, bool)  # grows for the unbounded rules
        self.slot_of = {}  # order -> slot
        self.head = 0
        self.failures = []  # chunks whose ubatch did not fit the capacity

    def _grow(self, n):
        """Makes table space at least n slots long."""
        if n > len(self.occ):
            self.occ = np.concatenate([self.occ, np.zeros(n - len(self.occ), bool)])

    def _extent(self):
        """One past the highest occupied slot (0 when empty)."""
        return max(self.slot_of.values(), default=-1) + 1

    def _first_run(self, n, start, limit):
        """First index >= start with n free slots in a row ending at or before `limit`, or None."""
        self._grow(limit)
        free = ~self.occ[:limit]
        run = 0
        for j in range(start, limit):
            run = run + 1 if free[j] else 0
            if run == n:
                return j - n + 1
        return None

    def place(self, chunk, new):
        n = len(new)
        if n == 0:
            return
        used = len(self.slot_of)
        C = self.capacity
        if self.rule == "first_fit":
            self._grow(self._extent() + n)  # enough free slots exist below extent + n
            slots = np.flatnonzero(~self.occ)[:n]
        elif self.rule == "contiguous":
            at = self._first_run(n, 0, self._extent() + n)  # a run always fits right after the extent
            slots = np.arange(at, at + n)
        elif self.rule in ("contiguous_next_fit", "contiguous_next_fit_reset"):
            if self.rule == "contiguous_next_fit_reset" and self.head > used + 2 * n:
                self.head = 0
            at = None
            if self.head + n <= C:
                at = self._first_run(n, self.head, C)
            if at is None:  # wrap: search from 0 (llama.cpp tests the whole ring once)
                at = self._first_run(n, 0, C)
            if at is None:  # out of capacity: record, then place past the capacity so the replay goes on
                self.failures.append(chunk)
                at = self._first_run(n, max(C, self._extent()), max(C, self._extent()) + n)
            slots = np.arange(at, at + n)
        elif self.rule == "next_fit_noncontiguous":
            if self.head > used + 2 * n:
                self.head = 0
            self._grow(C)
            order = np.concatenate([np.arange(self.head, C), np.arange(0, self.head)])
            free = order[~self.occ[order]]
            if len(free) < n:
                self.failures.append(chunk)
                start = max(C, self._extent())
                free = np.concatenate([free, np.arange(start, start + n - len(free))])
            slots = free[:n]
        else:
            raise ValueError(self.rule)
        self._grow(int(slots.max()) + 1)
        assert not self.occ[slots].any()
        self.occ[slots] = True
        for o, s in zip(new, slots):
            self.slot_of[o] = int(s)
        self.head = int(slots[-1]) + 1  # llama.cpp: head moves past the last placed cell ...
        if self.head >= C:
            self.head = 0  # ... and wraps at the ring's end (unused by first_fit and contiguous)

    def trim(self, live):
        for o in [o for o in self.slot_of if o not in live]:
            self.occ[self.slot_of.pop(o)] = False

    def span(self, P):
        return span_of(list(self.slot_of.values()), P)


def simulate(stream, rule, P, capacity):
    """Replays `stream` under `rule`. Returns per-chunk spans and live counts after the trim and before it (the
    cache the chunk's own prefill sees), the slot maps after the trim, and the chunks whose ubatch overflowed the
    ring."""
    placer = Placer(rule, capacity)
    out = {"span": [], "pre_span": [], "pre_live": [], "slot_maps": []}
    for ch in stream:
        placer.place(ch["chunk"], ch["new"])
        out["pre_span"].append(placer.span(P))
        out["pre_live"].append(len(placer.slot_of))
        placer.trim(ch["live"])
        assert set(placer.slot_of) == ch["live"]
        out["span"].append(placer.span(P))
        out["slot_maps"].append(dict(placer.slot_of))
    out = {k: (np.array(v) if k != "slot_maps" else v) for k, v in out.items()}
    out["failures"] = placer.failures
    return out




def summary(results, live, lib_span, sel, P, key="span"):
    """Means over the chunks `sel` (a slice): live, eager span, and per rule span, span / live (ratio of the means;
    the mean of per-chunk ratios is in the JSON), eager reduction 1 - eager / span, peak span over every chunk up
    to the slice's end. `key="pre_span"`: before each chunk's trim."""
    if key == "pre_span":
        live = results["first_fit"]["pre_live"]  # the same for every rule
    eager = round_up(live, P)
    lv, eg = float(np.mean(live[sel])), float(np.mean(eager[sel]))
    out = {"live": lv, "eager_span": eg, "library_native_span": float(np.mean(lib_span[sel])), "rules": {}}
    for rule, r in results.items():
        sp = float(np.mean(r[key][sel]))
        out["rules"][rule] = {"span": sp, "span_per_live": sp / lv, "mean_of_span_per_live":
                              float(np.mean(r[key][sel] / live[sel])), "eager_reduction": 1 - eg / sp,
                              "peak_span": int(np.max(r[key][:sel.stop]))}
    return out


def print_table(title, r, integer, notes):
    f = (lambda x: f"{x:,.0f}") if integer else (lambda x: f"{x:,.1f}")
    print(f"\n{title}\n  live {f(r['live'])} cells, eager span {f(r['eager_span'])}"
          + (f", library native span {f(r['library_native_span'])}" if r.get("library_native_span") else ""))
    print(f"  {'rule':<27}{'span':>9}{'span/live':>11}{'eager red.':>12}{'peak span':>11}")
    for rule, x in r["rules"].items():
        print(f"  {rule:<27}{f(x['span']):>9}{x['span_per_live']:>11.3f}{x['eager_reduction']:>11.1%}"
              f"{x['peak_span']:>11,}{notes.get(rule, '')}")


def plot(tokens, live, eager, pre_eager, results, out, stem):
    """Left: first fit (the library's native layout) against the packed oracle and the live cells, after each trim;
    middle and right: every rule's span on a log scale after each trim and before it (with the packed span of the
    cells then, `pre_eager`)."""
    fig, (left, mid, right) = harness.pyplot().subplots(1, 3, figsize=(19, 4.2))
    left.plot(tokens, results["first_fit"]["span"], label="span, first fit (the library's native)")
    left.plot(tokens, eager, label="span, fully packed (eager oracle)")
    left.plot(tokens, live, color="gray", linewidth=0.8, label="live cells")
    left.set_title("native layout vs the packed oracle, after each trim")
    for ax, key, when in ((mid, "span", "after each trim"), (right, "pre_span", "before each trim (attended)")):
        for rule, r in results.items():
            ax.plot(tokens, r[key], label=rule, linewidth=1.2)
        ax.set_yscale("log")
        ax.set_title(f"span per placement rule, {when}")
    mid.plot(tokens, eager, "k:", label="fully packed")
    right.plot(tokens, pre_eager, "k:", label="fully packed")
    for ax in (left, mid, right):
        ax.set_xlabel("streamed tokens")
        ax.set_ylabel("KV slots")
        ax.legend(fontsize=7)
    harness.save_png(fig, out, stem)


def main(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument("--layouts", default=".layouts/layouts_32k.pkl",
                        help="pickle from attention_kernel (--smoke: the tiny one of `attention_kernel.py --smoke`)")
    parser.add_argument("--layout", default="native", help="which recorded layout to replay (native)")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--capacity-pages", type=int, default=48, help="ring capacity of the head-cursor rules")
    parser.add_argument("--pad", type=int, default=0,
                        help="round every reported span up to this many slots (a page multiple; default: one page)")
    args = harness.parse(parser, argv, smoke=dict(layouts=None, capacity_pages=12))
    if args.layouts is None:  # --smoke: capture tiny layouts (jax) unless an earlier smoke run left them
        from bench.omnitide.attention_kernel import layouts_path

        args.layouts = str(layouts_path(args))
    P, C = args.page_size, args.capacity_pages * args.page_size
    R = args.pad or P
    if R % P:
        parser.error(f"--pad must be a multiple of the page size {P}, got {R}")

    saved = pickle.loads(Path(args.layouts).read_bytes())
    rows = saved["layouts"][args.layout]
    stream = read_stream(rows, P)
    n = len(stream)
    print(f"{args.layouts}: {saved['chunks']} chunks, {saved['tokens']} tokens, Qwen units "
          f"'{saved.get('qwen_unit', '2s')}'; replaying '{args.layout}' "
          f"({n} rows), page {P}, ring capacity {C} slots")

    live = np.array([len(ch["live"]) for ch in stream])
    eager = round_up(live, P)
    lib_span = np.array([ch["lib_span"] for ch in stream])
    results = {rule: simulate(stream, rule, P, C) for rule in RULES}
    ff = results["first_fit"]
    checks = {
        "library_span_equals_recomputed": sum(ch["lib_span"] == ch["lib_span_recomputed"] for ch in stream),
        "library_retained_equals_live": sum(ch["lib_retained"] == len(ch["live"]) for ch in stream),
        "new_orders_contiguous": sum(ch["new_contiguous"] for ch in stream),
        "first_fit_span_equals_library": int(np.sum(ff["span"] == lib_span)),
        "first_fit_slot_map_equals_library": sum(m == ch["lib_slot"] for m, ch in zip(ff["slot_maps"], stream)),
        **{f"{rule}_slot_map_equals_first_fit": sum(a == b for a, b in zip(results[rule]["slot_maps"],
                                                                             ff["slot_maps"]))
           for rule in RULES[1:]},
    }
    print(f"checks (chunks out of {n}):")
    for k, v in checks.items():
        print(f"  {k}: {v}")
    checks["first_fit_span_mismatch_chunks"] = [stream[i]["chunk"] for i in np.flatnonzero(ff["span"] != lib_span)]
    if R != P:  # report every span rounded up to R slots (llama.cpp pads the cells attention sees to 256)
        eager, lib_span = round_up(live, R), round_up(lib_span, R)
        for r in results.values():
            r["span"], r["pre_span"] = round_up(r["span"], R), round_up(r["pre_span"], R)
        print(f"spans below are rounded up to {R} slots")

    trims = [i for i, ch in enumerate(stream) if ch["evicted"] > 0]
    first = trims[0] if trims else 0
    notes = {rule: f"  * ring full from chunk {r['failures'][0]} ({len(r['failures'])} chunks)"
             for rule, r in results.items() if r["failures"]}
    at_last = summary(results, live, lib_span, slice(n - 1, n), R)
    mean_post = summary(results, live, lib_span, slice(first, n), R)
    mean_pre = summary(results, live, lib_span, slice(first, n), R, key="pre_span")
    mean_pre["library_native_span"] = None
    at_last_pre = summary(results, live, lib_span, slice(n - 1, n), R, key="pre_span")
    at_last_pre["library_native_span"] = None
    print_table(f"Last chunk {stream[-1]['chunk']} ({stream[-1]['tokens']:,} tokens), after its trim", at_last, True,
                notes)
    print_table("Same chunk, before its trim (the cache its prefill attends over)", at_last_pre, True, notes)
    print_table(f"Mean over chunks {stream[first]['chunk']}..{stream[-1]['chunk']} (from the first trim, "
                f"{n - first} chunks), after each trim", mean_post, False, notes)
    print_table("Same chunks, before each trim (the cache the chunk's prefill sees)", mean_pre, False, notes)
    if notes:
        print(f"  * the ubatch found no free run / not enough free cells in the {C}-slot ring (llama.cpp would fail "
              "the decode); the replay places it past the ring and goes on, so later spans exceed the pool")
    paper_eager = int(round_up(PAPER["useful"], R))
    print(f"\npaper (Qwen, 32K): useful {PAPER['useful']:,}, native span {PAPER['native_span']:,} "
          f"(span/useful {PAPER['native_span'] / PAPER['useful']:.3f}), OmniPage {PAPER['omnipage_span']:,} "
          f"(-{PAPER['reduction']:.1%}); eager span of the useful cells {paper_eager:,} "
          f"(-{1 - paper_eager / PAPER['native_span']:.1%})")

    out = harness.output_dir(args)
    payload = {
        "layouts": str(args.layouts), "qwen_unit": saved.get("qwen_unit", "2s"), "layout": args.layout,
        "page_size": P, "span_rounding": R, "capacity_slots": C,
        "chunks": n, "tokens": stream[-1]["tokens"], "first_trim_chunk": stream[first]["chunk"],
        "checks": checks, "last_chunk": at_last, "last_chunk_before_trim": at_last_pre,
        "mean_from_first_trim": mean_post, "mean_from_first_trim_before_trim": mean_pre, "paper": PAPER,
        "ring_failures": {rule: r["failures"] for rule, r in results.items()},
        "per_chunk": [{"chunk": ch["chunk"], "tokens": ch["tokens"], "live": int(live[i]), "eager": int(eager[i]),
                       "library_span": int(lib_span[i]), "live_before_trim": int(ff["pre_live"][i]),
                       "span": {rule: int(r["span"][i]) for rule, r in results.items()},
                       "span_before_trim": {rule: int(r["pre_span"][i]) for rule, r in results.items()}}
                      for i, ch in enumerate(stream)],
    }
    stem = "placement_sim" if payload["qwen_unit"] == "2s" else f"placement_sim_{payload['qwen_unit']}"
    harness.write_json(out, stem, payload)
    pre_eager = round_up(ff["pre_live"], R)
    plot([ch["tokens"] for ch in stream], live, eager, pre_eager, results, out, stem)


if __name__ == "__main__":
    main()
