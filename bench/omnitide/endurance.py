"""One-hour streaming sessions under OmniPick: per-chunk latency and retained cells over time, step-wise.

The test suite checks that retained cells, span and cursor stay flat (`tests/streaming/test_endurance.py`); this script
measures what the tests may not assert: that per-chunk latency is flat too once trimming starts. Each layout runs
through `omnijax.Session` (one jitted step, compiled once) chunk by chunk; the table compares the median latency of
the first and last tenth of the steady state (after the first trim) side by side.

Those two medians are taken minutes apart, so on a shared machine they also differ by whatever else the machine did
meanwhile. The controlled columns remove that: the session's state is kept right after a trim early in the steady
state and right after one in its last tenth, and one chunk (the chunk after the late state, no question, no trim for
either state) is fed to a copy of each state in turn, `--probe-rounds` times, interleaved. Any difference left is
the state's (history length, positions, unit metadata), which is what a flat-latency claim is about.

Run: `python -m bench.omnitide.endurance [--minutes 60] [--probe-rounds 30] [--watermarks 2500 1800] [--out bench/out]
[--smoke]`
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import omnijax
from bench import harness
from omnijax.models.config import TINY_OMNI
from omnijax.retention import OmniPick
from omnijax.testing import synthetic

QWEN3_TINY = TINY_OMNI.replace(mrope_section=None, qkv_bias=False, qk_norm=True)


def run(layout: str, minutes: float, probe_rounds: int, watermarks=(2500, 1800)) -> dict:
    if layout == "qwen2_5_omni":
        model, units = omnijax.Decoder(TINY_OMNI), int(minutes * 30)  # 2 s units
        chunks = synthetic.qwen_av_session(units, vocab_size=TINY_OMNI.vocab_size, question_every=30)
        policy = OmniPick(*watermarks)
    else:
        model, units = omnijax.Decoder(QWEN3_TINY), int(minutes * 60)  # 1 s units
        chunks = synthetic.minicpm_duplex_session(units, vocab_size=QWEN3_TINY.vocab_size, slices_every=0)
        policy = OmniPick(*watermarks, source_image_whole=True)
    longest = int(np.asarray(chunks.valid).sum(axis=(1, 2)).max())
    session = omnijax.Session(model, policy=policy, page_size=64,
                              num_pages=-(-(policy.high_watermark + longest) // 64) + 2)
    n = chunks.token_ids.shape[0]
    asks = np.asarray(chunks.answer_tokens).reshape(n, -1).max(axis=1) > 0  # [n] chunks that ask a question
    ms, retained, evicted = np.zeros(n), np.zeros(n, int), np.zeros(n, int)
    kept, first_trim = {}, None  # kept: "early" / "late" -> (chunk index, state copy)
    for i in range(n):
        chunk = jax.tree.map(lambda x: x[i], chunks)
        start = time.perf_counter()
        out = session.feed(chunk)
        jax.block_until_ready(out.logits)
        ms[i] = 1e3 * (time.perf_counter() - start)
        retained[i], evicted[i] = int(out.stats.layout.retained_cells[0]), int(out.stats.evicted[0])
        if not evicted[i] or i + 1 == n or asks[i + 1]:
            continue
        first_trim = i if first_trim is None else first_trim
        tenth = max(1, (n - first_trim) // 10)
        if "early" not in kept and i >= first_trim + tenth // 2:
            kept["early"] = (i, jax.tree.map(jnp.copy, session.state))
        elif i >= n - tenth:
            kept["late"] = (i, jax.tree.map(jnp.copy, session.state))
    first = int(np.argmax(evicted > 0))
    steady = np.arange(first, n)
    tenth = max(1, len(steady) // 10)
    early, late = np.median(ms[steady[:tenth]]), np.median(ms[steady[-tenth:]])
    trims = ms[evicted > 0]
    row = {"layout": layout, "chunks": n, "tokens": int(np.asarray(chunks.valid).sum()), "first_trim": first,
           "early_ms": float(early), "late_ms": float(late), "late_over_early": float(late / early),
           "trim_chunk_ms": float(np.median(trims)) if trims.size else None,
           "retained_max_after_trim": int(retained[first:].max()), "retained_last": int(retained[-1]),
           "ms": ms.round(3).tolist(), "retained": retained.tolist()}
    row.update(controlled(session, chunks, kept, probe_rounds))
    return row


def controlled(session, chunks, kept: dict, rounds: int) -> dict:
    """Feeds one chunk to copies of the early and the late kept state in turn; medians and their ratio."""
    if set(kept) != {"early", "late"} or rounds <= 0:
        return {"probe_chunk": None}
    probe_index = kept["late"][0] + 1
    probe = jax.tree.map(lambda x: x[probe_index], chunks)

    def case(name):
        def feed():
            out = session.feed(probe)
            if int(out.stats.evicted[0]):
                raise RuntimeError(f"the probe chunk {probe_index} trims the {name} state; pick another")
            return out.logits
        def restore():
            session.state = jax.tree.map(jnp.copy, kept[name][1])  # `feed` donates it
            return ()
        return harness.Case(feed, restore)

    times = harness.interleaved({name: case(name) for name in ("early", "late")}, rounds)  # one warm-up call each
    early, late = float(np.median(times["early"])), float(np.median(times["late"]))
    return {"probe_chunk": probe_index, "early_state_chunk": kept["early"][0], "late_state_chunk": kept["late"][0],
            "probe_early_ms": early, "probe_late_ms": late, "probe_late_over_early": late / early,
            "probe_ratio_per_round": (times["late"] / times["early"]).tolist()}


def main(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--probe-rounds", type=int, default=30,
                        help="interleaved rounds of the controlled early/late-state comparison (0: skip it)")
    parser.add_argument("--watermarks", type=int, nargs=2, default=[2500, 1800], metavar=("HIGH", "LOW"),
                        help="OmniPick's high and low watermarks")
    args = harness.parse(parser, argv, smoke=dict(minutes=0.8, probe_rounds=2, watermarks=[400, 250]))
    out = harness.output_dir(args)
    rows = [run(layout, args.minutes, args.probe_rounds, args.watermarks)
            for layout in ("qwen2_5_omni", "minicpmo_4_5")]
    print(f"{'layout':>14} {'chunks':>6} {'tokens':>8} {'1st trim':>8} {'early ms':>8} {'late ms':>8} "
          f"{'late/early':>10} {'trim ms':>8} {'max kept':>8} | {'states':>11} {'early ms':>8} {'late ms':>8} "
          f"{'late/early':>10}")
    for r in rows:
        probe = (f"{r['early_state_chunk']:>5}/{r['late_state_chunk']:>5} {r['probe_early_ms']:>8.2f} "
                 f"{r['probe_late_ms']:>8.2f} {r['probe_late_over_early']:>10.2f}") if r["probe_chunk"] else "skipped"
        print(f"{r['layout']:>14} {r['chunks']:>6} {r['tokens']:>8} {r['first_trim']:>8} {r['early_ms']:>8.2f} "
              f"{r['late_ms']:>8.2f} {r['late_over_early']:>10.2f} {r['trim_chunk_ms']:>8.2f} "
              f"{r['retained_max_after_trim']:>8} | {probe}")
    harness.write_json(out, "endurance", rows, indent=None)

    fig, axes = harness.pyplot().subplots(2, 2, figsize=(10, 5), sharex="col")
    for col, r in enumerate(rows):
        minutes = np.arange(r["chunks"]) * args.minutes / r["chunks"]
        axes[0, col].plot(minutes, r["retained"], lw=0.8)
        axes[0, col].set_title(f"{r['layout']} under OmniPick")
        axes[0, col].set_ylabel("retained cells")
        axes[1, col].plot(minutes, r["ms"], lw=0.5)
        axes[1, col].set_ylim(0, np.percentile(r["ms"], 99.5) * 1.2)
        axes[1, col].set_ylabel("ms per chunk")
        axes[1, col].set_xlabel("session minute")
    harness.save_png(fig, out, "endurance", dpi=110)


if __name__ == "__main__":
    main()
