"""The latency cliff of unbounded session KV, and admission on the bounded signal (seed 002 §3, §5.2-5.3, Figs 4-7).

Model: the embedded tiny random Qwen2.5-Omni of `omnijax.testing.checkpoints` (4 layers, hidden 128, vocab 151,936,
audio encoder d_model 32), float32, `impl="xla"`, CPU. Frames: 16 kHz speech-like PCM from `loadgen.speech_like_pcm`,
encoded by `server.AudioFrameEncoder` (log-mel -> audio encoder -> audio unit): a 500 ms frame is 12 audio tokens + 2
markers.

Three parts:
1. Repeated runs, in-process (engine driven directly, no sockets; time is virtual: tick k is at k*B). N sessions join
   at random ticks in the first `--join-spread` ticks, each asks a random tau in [2, 4] greedy tokens per frame, and
   the run lasts a random length in [0.75, 1.25] x `--ticks`. The pool is sized so unbounded sessions saturate near
   the nominal run length, so the race between fill time and run length decides (the paper's metastability).
   Reported per policy: runs that walled (pool exhausted: dropped tokens, preempted sessions, stall events or empty
   frames), the first-order prediction t_sat = (1 - rho0) / (N r) from the telemetry's line fitted to occupancy over
   the first `--fit-ticks` ticks after the last join, and the measured saturation (first tick with pool exhaustion).
   Frames are pre-encoded (a bank of 16) and the batch bucket is N, so per-tick latency is the engine step alone.
2. Open-loop ramp with AIMD, in-process: one arrival per `--ramp-every` ticks up to `--ramp-max`, sessions of 40-80
   ticks. Each tick encodes every session's frame from PCM and ticks the engine, as the server does; that per-frame
   latency (encoding + tick, real compute time) feeds `admission.AIMD` (target `--target` x B; one control step per
   4 ticks on their mean: co-tenant CPU spikes on this machine trip a p95). B is calibrated from SinkWindow's
   measured per-frame latency so the target falls at about `--ramp-knee` sessions here (the controller is not told).
   Same AIMD, pool (384 pages), buckets (16, 32) and B for both policies. Attention is `--ramp-impl reference` with a
   48-page table per session: its cost follows the table width, so per-frame cost is flat in context as on a GPU,
   where attention over these short contexts is negligible (the paper's premise); with `xla` on this CPU the cost
   follows each session's active pages, and unbounded latency rises with context (see bench/metronome/RESULTS.md).
3. Real WebSocket clients (`loadgen.closed_loop`) against an `omnijax-serve --demo-model` subprocess per policy, with
   a pool that unbounded sessions fill mid-run: client-side latency over real time and empty frames.

Run: `python -m bench.metronome.serve_cliff [--runs 8] [--sessions 8] [--ticks 48] [--no-websocket] [--out bench/out]
[--smoke]`
(`--smoke`: one short run of 2 sessions per policy, one calibration tick per bucket, a 6-tick ramp over buckets 2
and 4, no WebSocket part, the demo checkpoint the smoke run's scripts share: `harness.smoke_demo_model`.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import subprocess
import sys
import time

import numpy as np

from bench import harness
from omnijax import StreamConfig
from omnijax.retention import NoSlide, SinkWindow
from omnijax.serve import loadgen
from omnijax.serve import server as srv
from omnijax.serve.engine.admission import AIMD
from omnijax.serve.engine.engine import Engine, EngineConfig

POLICIES = ("unbounded", "sink_window")


@dataclasses.dataclass(frozen=True)
class Setup:
    """An engine set-up by policy name (`unbounded` or `sink_window`): what the runs vary with `dataclasses.replace`."""

    policy: str
    sink: int
    window: int
    num_pages: int
    page_size: int
    chunk_tokens: int
    max_answer_tokens: int
    buckets: tuple[int, ...]
    frame_budget_s: float
    impl: str = "xla"
    max_pages: int | None = None

    def engine(self) -> EngineConfig:
        policy = NoSlide() if self.policy == "unbounded" else SinkWindow(sink=self.sink, window=self.window)
        stream = StreamConfig(policy=policy, impl=self.impl, page_size=self.page_size, num_pages=self.num_pages,
                              max_answer_tokens=self.max_answer_tokens)
        return EngineConfig(stream, max_pages=self.max_pages, chunk_tokens=self.chunk_tokens, buckets=self.buckets,
                            frame_budget_s=self.frame_budget_s)


def frame_bank(model, frame_ms: float, count: int, chunk_tokens: int):
    """`count` encoded frames of speech-like audio (chunks are reused with fresh unit ids)."""
    enc = srv.AudioFrameEncoder(model, chunk_tokens=chunk_tokens, answer_tokens=0)
    samples = srv.frame_samples(frame_ms)
    pcm = loadgen.speech_like_pcm(count * frame_ms / 1000, seed=7)
    return [enc.encode(pcm[i * samples:(i + 1) * samples], 0) for i in range(count)]


def chunk_for(bank, k: int, unit: int, tau: int):
    c = bank[k % len(bank)]
    return dataclasses.replace(c, unit=np.full_like(np.asarray(c.unit), unit),
                               answer_tokens=np.asarray([tau], np.int32), answer_unit=np.asarray([unit], np.int32))


def tick_row(t: int, budget: float, report, asked: dict) -> dict:
    outs = report.outputs
    empty = sum(1 for s, n in asked.items() if n > 0 and (s not in outs or not outs[s].tokens))
    return {"tick": t, "t": t * budget, "latency_ms": 1e3 * report.latency_s, "occupancy": float(report.occupancy),
            "running": int(report.running), "waiting": int(report.waiting), "served": len(outs), "empty": empty,
            "dropped": int(sum(o.dropped for o in outs.values())),
            "preempted": int(sum(bool(o.preempted) for o in outs.values())), "events": len(report.events)}


def finite(x):
    """JSON-ready: non-finite floats become None."""
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def stalled(row: dict) -> bool:
    return row["dropped"] > 0 or row["preempted"] > 0 or row["events"] > 0 or row["empty"] > 0


def closed_run(model, bank, cfg: Setup, *, sessions: int, ticks: int, join_spread: int, fit_ticks: int,
               seed: int) -> dict:
    """One in-process run (part 1)."""
    rng = np.random.default_rng(seed)
    budget = cfg.frame_budget_s
    engine = Engine(model, cfg.engine())
    joins = sorted(rng.integers(0, join_spread, sessions).tolist())
    taus = rng.integers(2, cfg.max_answer_tokens + 1, sessions).tolist()
    length = int(round(ticks * rng.uniform(0.75, 1.25)))
    units = [0] * sessions
    rows = []
    for t in range(length):
        asked = {}
        for i in range(sessions):
            if joins[i] == t:
                engine.open(f"s{i}")
            if joins[i] <= t:
                engine.submit(f"s{i}", chunk_for(bank, units[i] + i, units[i], taus[i]), taus[i])
                units[i] += 1
                asked[f"s{i}"] = taus[i]
        rows.append(tick_row(t, budget, engine.tick(), asked))
    # the telemetry's first-order fit on the ticks after the last join (absolute times: tick index x B)
    fit = engine.telemetry.saturation_fit(fit_ticks=fit_ticks, skip=max(joins) + 1)
    first = next((r for r in rows if stalled(r)), None)
    t_fit = fit.first_tick * budget
    return {"policy": cfg.policy, "seed": seed, "ticks": length, "duration_s": length * budget,
            "walled": first is not None, "first_stall_s": None if first is None else first["t"],
            "t_sat_measured": None if fit.measured_tick is None else fit.measured_tick * budget,
            "t_sat_predicted": t_fit + fit.t_sat_ticks * budget, "fit_start_s": t_fit, "rho0": fit.rho0,
            "fill_rate": fit.slope / budget, "rel_error": fit.relative_error,
            "empty_frames": sum(r["empty"] for r in rows), "frames": sum(r["served"] for r in rows),
            "peak_occupancy": max(r["occupancy"] for r in rows), "rows": rows}


class LiveFrames:
    """Encodes each session's next frame from PCM at tick time, as the server does (part 2's latency includes it)."""

    def __init__(self, model, frame_ms: float, chunk_tokens: int, seconds: float = 60.0):
        self.encoder = srv.AudioFrameEncoder(model, chunk_tokens=chunk_tokens, answer_tokens=0)
        self.samples = srv.frame_samples(frame_ms)
        self.pcm = loadgen.speech_like_pcm(seconds, seed=3)
        self.count = len(self.pcm) // self.samples

    def encode(self, session: int, unit: int):
        k = (17 * session + unit) % self.count
        return self.encoder.encode(self.pcm[k * self.samples:(k + 1) * self.samples], unit)


def serve_tick(engine, live: LiveFrames, active: dict, tau: int):
    """Encodes and submits every active session's frame, ticks; returns (report, latency incl. encoding, asked)."""
    start = time.perf_counter()
    asked = {}
    for sid, s in active.items():
        engine.submit(sid, live.encode(s["n"], s["unit"]), tau)
        s["unit"] += 1
        asked[sid] = tau
    encode_s = time.perf_counter() - start
    report = engine.tick()
    return report, encode_s + report.latency_s, asked


def ramp_run(model, live: LiveFrames, cfg: Setup, *, ticks: int, every: int, max_arrivals: int,
             target: float, session_ticks: tuple[int, int], seed: int) -> dict:
    """Open-loop arrivals with AIMD admission (part 2)."""
    rng = np.random.default_rng(seed)
    engine = Engine(model, cfg.engine())
    aimd = AIMD(target_fraction=target, frame_budget_s=cfg.frame_budget_s, max_cap=cfg.buckets[-1], window=4,
                statistic="mean")  # the mean of 4 ticks: co-tenant CPU spikes here would trip a p95
    active, rows, arrivals, rejected = {}, [], 0, 0
    for t in range(ticks):
        if t % every == 0 and arrivals < max_arrivals:
            arrivals += 1
            if aimd.admit(len(active)):
                engine.open(f"s{arrivals}")
                active[f"s{arrivals}"] = {"left": int(rng.integers(*session_ticks)), "unit": 0, "n": arrivals}
            else:
                rejected += 1
        report, latency, asked = serve_tick(engine, live, active, cfg.max_answer_tokens)
        aimd.observe(latency, len(active))
        row = tick_row(t, cfg.frame_budget_s, report, asked)
        row.update(latency_ms=1e3 * latency, tick_ms=1e3 * report.latency_s, admitted=len(active),
                   cap=int(aimd.cap), arrivals=arrivals, rejected=rejected)
        rows.append(row)
        for sid in list(active):
            active[sid]["left"] -= 1
            if active[sid]["left"] <= 0:
                engine.close(sid)
                del active[sid]
    return {"policy": cfg.policy, "rows": rows, "rejected": rejected, "arrivals": arrivals,
            "aimd_steps": aimd.history}


def warm(model, live: LiveFrames, cfg: Setup, sizes) -> float:
    """Compiles the step (and a leave's row reset and re-bucketing) of `cfg` at each session count; returns s."""
    start = time.perf_counter()
    for n in sizes:
        engine = Engine(model, cfg.engine())
        active = {f"s{i}": {"unit": 0, "n": i} for i in range(n)}
        for sid in active:
            engine.open(sid)
        serve_tick(engine, live, active, cfg.max_answer_tokens)
        engine.close("s0")
        del active["s0"]
        serve_tick(engine, live, active, cfg.max_answer_tokens)
    return time.perf_counter() - start


def calibrate(model, live: LiveFrames, cfg: Setup, sizes, repeats: int = 8) -> dict:
    """Median steady per-frame latency (encoding + tick, s) of `cfg` with n sessions, for n in `sizes`."""
    out = {}
    for n in sizes:
        engine = Engine(model, cfg.engine())
        active = {f"s{i}": {"unit": 0, "n": i} for i in range(n)}
        for sid in active:
            engine.open(sid)
        lat = [serve_tick(engine, live, active, cfg.max_answer_tokens)[1] for _ in range(repeats + 2)]
        out[n] = float(np.median(lat[2:]))
    return out


def websocket_run(policy: str, args, pages: int) -> dict:
    """Part 3: an `omnijax-serve --demo-model` subprocess and `args.ws_sessions` real clients for `args.ws_seconds`."""
    import threading

    cmd = [sys.executable, "-m", "omnijax.serve.server", "--demo-model", "--port", "0", "--policy", policy,
           "--sink", str(args.sink), "--window", str(args.window), "--pages", str(pages), "--page-size",
           str(args.page_size), "--frame-ms", str(args.frame_ms), "--answer-tokens", "4", "--aimd-target", "0",
           "--warmup-sessions", str(args.ws_sessions), "--buckets", str(args.ws_sessions),
           "--chunk-tokens", str(srv.frame_tokens(srv.frame_samples(args.frame_ms)))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, ready = [], threading.Event()

    def pump():
        for line in proc.stdout:
            lines.append(line.rstrip())
            if "listening on" in line:
                ready.set()
    threading.Thread(target=pump, daemon=True).start()
    try:
        if not ready.wait(600):
            raise RuntimeError("server did not start:\n" + "\n".join(lines[-20:]))
        url = next(x for x in lines if "listening on" in x).split()[-1]
        result = asyncio.run(loadgen.closed_loop(url, sessions=args.ws_sessions, duration_s=args.ws_seconds,
                                                 frame_ms=args.frame_ms, seed=11))
    finally:
        proc.terminate()  # SIGTERM: graceful shutdown
        code = proc.wait(60)
    print(f"  websocket {policy}: server exited {code}: {lines[-1] if lines else ''}", flush=True)
    frames = sorted(result.frames, key=lambda f: f["t"])
    first = next((f["t"] for f in frames if f["empty"] or f["dropped"]), None)
    return {"policy": policy, "pages": pages, "summary": result.summary(), "first_empty_s": first,
            "server_exit": code, "frames": frames, "clients": result.clients}


def report(runs, ramps, ws, lat, ramp_budget, args) -> dict:
    """Prints the tables and returns the summary numbers."""
    print(f"\n{'policy':>11} {'runs':>4} {'walled':>6} {'t_sat pred':>10} {'t_sat meas':>10} {'|err|':>6} "
          f"{'empty':>7} {'p50 ms':>7} {'p99 ms':>7} {'peak occ':>8}")
    part1 = {}
    for p in POLICIES:
        mine = [r for r in runs if r["policy"] == p]
        walled = [r for r in mine if r["walled"]]
        errs = [r["rel_error"] for r in walled if r["rel_error"] is not None]
        lats = np.asarray([x["latency_ms"] for r in mine for x in r["rows"][2:]])
        part1[p] = {"runs": len(mine), "walled": len(walled), "err_median": float(np.median(errs)) if errs else None,
                    "err_max": float(max(errs)) if errs else None,
                    "empty_frames": sum(r["empty_frames"] for r in mine), "frames": sum(r["frames"] for r in mine),
                    "p50_ms": float(np.percentile(lats, 50)), "p99_ms": float(np.percentile(lats, 99)),
                    "peak_occupancy": max(r["peak_occupancy"] for r in mine)}
        pred = np.median([r["t_sat_predicted"] for r in mine]) if p == "unbounded" else math.nan
        meas = np.median([r["t_sat_measured"] for r in walled if r["t_sat_measured"] is not None] or [math.nan])
        err = f"{100 * part1[p]['err_median']:.1f}%" if errs else "-"
        print(f"{p:>11} {len(mine):>4} {len(walled):>4}/{len(mine):<1} {pred:>10.2f} {meas:>10.2f} {err:>6} "
              f"{part1[p]['empty_frames']:>7} {part1[p]['p50_ms']:>7.1f} {part1[p]['p99_ms']:>7.1f} "
              f"{part1[p]['peak_occupancy']:>8.2f}")
    print(f"\nAIMD ramp (B = {ramp_budget * 1e3:.0f} ms, target {args.target:g} x B = "
          f"{args.target * ramp_budget * 1e3:.0f} ms)")
    print(f"{'policy':>11} {'arrivals':>8} {'rejected':>8} {'max adm':>7} {'settled':>7} {'cap end':>7} "
          f"{'empty':>6} {'good %':>6} {'1st stall s':>11} {'p50 ms':>7} {'p99 ms':>7} (settled, p50/p99: last half)")
    part2 = {}
    for ramp in ramps:
        rows = ramp["rows"]
        half = rows[len(rows) // 2:]
        lat_half = np.asarray([r["latency_ms"] for r in half])
        part2[ramp["policy"]] = d = {
            "arrivals": ramp["arrivals"], "rejected": ramp["rejected"],
            "max_admitted": max(r["admitted"] for r in rows),
            "settled": float(np.median([r["admitted"] for r in half])), "cap_end": rows[-1]["cap"],
            "empty_frames": sum(r["empty"] for r in rows), "frames": sum(r["served"] for r in rows),
            "first_stall_s": next((r["t"] for r in rows if stalled(r)), None),
            "p50_ms": float(np.percentile(lat_half, 50)), "p99_ms": float(np.percentile(lat_half, 99))}
        d["good"] = 1 - d["empty_frames"] / max(1, d["frames"])
        first = "-" if d["first_stall_s"] is None else f"{d['first_stall_s']:.1f}"
        print(f"{ramp['policy']:>11} {d['arrivals']:>8} {d['rejected']:>8} {d['max_admitted']:>7} {d['settled']:>7.1f} "
              f"{d['cap_end']:>7.0f} {d['empty_frames']:>6} {100 * d['good']:>6.1f} {first:>11} {d['p50_ms']:>7.1f} "
              f"{d['p99_ms']:>7.1f}")
    part3 = {}
    if ws:
        print(f"\nWebSocket clients ({args.ws_sessions} sessions, {args.ws_seconds:g} s, B = {args.frame_ms:g} ms)")
        print(f"{'policy':>11} {'pages':>5} {'sent':>5} {'replies':>7} {'empty':>6} {'rtt p50':>7} {'rtt p99':>7} "
              f"{'srv p50':>7} {'srv p99':>7} {'1st empty s':>11}")
        for w in ws:
            s = w["summary"]
            part3[w["policy"]] = {**s, "first_empty_s": w["first_empty_s"], "pages": w["pages"]}
            first = "-" if w["first_empty_s"] is None else f"{w['first_empty_s']:.1f}"
            print(f"{w['policy']:>11} {w['pages']:>5} {s['frames_sent']:>5} {s['frames']:>7} {s['empty']:>6} "
                  f"{s['rtt_ms_p50']:>7.1f} {s['rtt_ms_p99']:>7.1f} {s['latency_ms_p50']:>7.1f} "
                  f"{s['latency_ms_p99']:>7.1f} {first:>11}")
    return {"part1": part1, "calibration_s": lat, "ramp_budget_s": ramp_budget, "part2": part2, "part3": part3}


def plot(runs, ramps, ws, ramp_budget, args, out):
    plt = harness.pyplot()
    colors = {"unbounded": "tab:red", "sink_window": "tab:blue"}
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    ax = axes[0, 0]  # Fig 4b: per-tick latency over time, every run; empty frames marked
    for r in runs:
        t = [x["t"] for x in r["rows"]]
        ax.plot(t, [x["latency_ms"] for x in r["rows"]], color=colors[r["policy"]], lw=0.6, alpha=0.6)
        stall = [x for x in r["rows"] if x["empty"]]
        ax.scatter([x["t"] for x in stall], [x["latency_ms"] for x in stall], color="k", s=4, zorder=3)
    ax.set(yscale="log", xlabel="session time (s, virtual: tick x B)", ylabel="tick latency (ms)",
           title=f"{args.runs} runs per policy (black: ticks with empty frames)")
    for p, c in colors.items():
        ax.plot([], [], color=c, label=p)
    ax.legend(fontsize=8)
    ax = axes[0, 1]  # Fig 5/6a: occupancy, linear fit, predicted vs measured t_sat
    for r in runs:
        ax.plot([x["t"] for x in r["rows"]], [x["occupancy"] for x in r["rows"]], color=colors[r["policy"]], lw=0.6,
                alpha=0.5)
    ex = next((r for r in runs if r["policy"] == "unbounded" and r["walled"]), None)
    if ex is not None:
        tt = np.linspace(ex["fit_start_s"], ex["t_sat_predicted"], 50)
        ax.plot(tt, ex["rho0"] + ex["fill_rate"] * (tt - ex["fit_start_s"]), "k:", label="early linear fit (one run)")
        ax.axvline(ex["t_sat_predicted"], color="k", ls=":", lw=0.8)
        ax.plot([ex["t_sat_measured"]], [1.0], "kx", ms=10, label=f"measured {ex['t_sat_measured']:.1f} s vs "
                                                                   f"predicted {ex['t_sat_predicted']:.1f} s")
    ax.set(xlabel="session time (s)", ylabel="KV pool occupancy", ylim=(0, 1.05), title="Pool occupancy")
    ax.legend(fontsize=8)
    ax = axes[0, 2]  # Fig 5 bottom: sessions served vs starved per tick
    for r in runs:
        ax.plot([x["t"] for x in r["rows"]], [x["empty"] for x in r["rows"]], color=colors[r["policy"]], lw=0.6,
                alpha=0.6)
    ax.set(xlabel="session time (s)", ylabel="empty frames per tick", title="Sessions starved per tick")
    for i, key in enumerate(("admitted", "latency_ms")):  # Fig 7
        ax = axes[1, i]
        for ramp in ramps:
            rows, c = ramp["rows"], colors[ramp["policy"]]
            t = [x["t"] for x in rows]
            ax.plot(t, [x[key] for x in rows], color=c, label=f"{ramp['policy']} {key.split('_')[0]}")
            if key == "admitted":
                ax.plot(t, [x["cap"] for x in rows], color=c, ls="--", lw=0.8, label=f"{ramp['policy']} cap")
                ax.plot(t, [x["running"] for x in rows], color=c, ls="-.", lw=0.8,
                        label=f"{ramp['policy']} running (not stalled)")
                ax.plot(t, [x["rejected"] for x in rows], color=c, ls=":", lw=0.8, label=f"{ramp['policy']} shed")
            else:
                stall = [x for x in rows if x["empty"]]
                ax.scatter([x["t"] for x in stall], [x[key] for x in stall], color="k", s=4, zorder=3)
        if key == "latency_ms":
            ax.axhline(args.target * ramp_budget * 1e3, color="gray", ls="--", lw=0.8, label="AIMD target")
            ax.set(yscale="log")
        ax.set(xlabel="time (s, virtual)", ylabel="sessions" if key == "admitted" else "tick latency (ms)",
               title="AIMD open-loop ramp: " + ("admitted, cap, shed" if key == "admitted" else "latency"))
        ax.legend(fontsize=7)
    ax = axes[1, 2]  # real WebSocket clients
    for w in ws:
        f = w["frames"]
        ax.plot([x["t"] for x in f], [x["rtt_ms"] for x in f], ".", ms=2, color=colors[w["policy"]],
                label=f"{w['policy']} client round trip")
        e = [x for x in f if x["empty"]]
        ax.scatter([x["t"] for x in e], [x["rtt_ms"] for x in e], color="k", s=5, zorder=3)
    ax.set(xlabel="wall time (s)", ylabel="frame round trip (ms)", yscale="log",
           title=f"WebSocket: {args.ws_sessions} clients (black: empty frames)")
    if ws:
        ax.legend(fontsize=8)
    harness.save_png(fig, out, "serve_cliff", dpi=110)


def main(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument("--runs", type=int, default=8, help="repeated in-process runs per policy")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--ticks", type=int, default=48, help="nominal run length (each run: x[0.75, 1.25])")
    parser.add_argument("--join-spread", type=int, default=4)
    parser.add_argument("--fit-ticks", type=int, default=12)
    parser.add_argument("--fill", type=float, default=0.9, help="pool = what unbounded sessions hold at fill x ticks")
    parser.add_argument("--frame-ms", type=float, default=500.0)
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--target", type=float, default=0.6, help="AIMD latency target (fraction of B)")
    parser.add_argument("--ramp-ticks", type=int, default=120)
    parser.add_argument("--ramp-every", type=int, default=1)
    parser.add_argument("--ramp-max", type=int, default=120)
    parser.add_argument("--ramp-impl", default="reference",
                        help="attention of the ramp (reference: cost follows the page-table width, flat in context)")
    parser.add_argument("--ramp-knee", type=int, default=20, help="sessions at which B puts the latency target")
    parser.add_argument("--calibrate-repeats", type=int, default=8,
                        help="timed ticks per bucket of B's calibration (after 2 untimed ones)")
    parser.add_argument("--ramp-buckets", type=int, nargs=2, default=[16, 32], help="the ramp's two batch buckets")
    parser.add_argument("--ws-sessions", type=int, default=6)
    parser.add_argument("--ws-seconds", type=float, default=24.0)
    parser.add_argument("--no-websocket", action="store_true")
    args = harness.parse(parser, argv, smoke=dict(runs=1, sessions=2, ticks=6, join_spread=1, fit_ticks=3,
                                                  ramp_ticks=6, ramp_max=4, ramp_knee=3, ramp_buckets=[2, 4],
                                                  calibrate_repeats=1, no_websocket=True))
    out = harness.output_dir(args)
    t_run = time.perf_counter()

    model = harness.demo_model(out, args.smoke)  # a smoke run's: the checkpoint its scripts share
    samples = srv.frame_samples(args.frame_ms)
    T = srv.frame_tokens(samples)
    bank = frame_bank(model, args.frame_ms, 16, T)
    P, B = args.page_size, args.frame_ms / 1000
    per_tick = T + 3  # mean tau = 3
    pages = args.sessions * math.ceil(per_tick * args.fill * args.ticks / P)
    base = Setup(policy="unbounded", sink=args.sink, window=args.window, num_pages=pages, page_size=P,
                        chunk_tokens=T, max_answer_tokens=4, buckets=(args.sessions,), frame_budget_s=B,
                        impl="xla")
    print(f"frame {args.frame_ms:g} ms = {T} tokens; pool {pages} x {P}; {args.sessions} sessions; "
          f"SinkWindow({args.sink}, {args.window})", flush=True)

    # ---- part 1: repeated runs
    live = LiveFrames(model, args.frame_ms, T)
    compile_s = sum(warm(model, live, dataclasses.replace(base, policy=p), (args.sessions,)) for p in POLICIES)
    runs = []
    for r in range(args.runs):
        for policy in POLICIES:
            run = closed_run(model, bank, dataclasses.replace(base, policy=policy), sessions=args.sessions,
                             ticks=args.ticks, join_spread=args.join_spread, fit_ticks=args.fit_ticks, seed=100 + r)
            runs.append(run)
            print(f"  run {r} {policy:>11}: {run['ticks']} ticks, walled={run['walled']}, t_sat measured "
                  f"{run['t_sat_measured']} predicted {run['t_sat_predicted']:.2f} s, empty {run['empty_frames']}, "
                  f"peak occupancy {run['peak_occupancy']:.2f}", flush=True)

    # ---- part 2: calibrate B from SinkWindow's per-frame latency (encoding + tick), then the AIMD ramp
    b0, b1 = buckets = tuple(args.ramp_buckets)
    ramp_pages = b1 * (math.ceil((args.sink + args.window + T + 4) / P) + 2)
    ramp_base = dataclasses.replace(base, num_pages=ramp_pages, buckets=buckets, impl=args.ramp_impl,
                                    max_pages=ramp_pages // 8)
    compile_s += sum(warm(model, live, dataclasses.replace(ramp_base, policy=p), buckets) for p in POLICIES)
    print(f"compiling (both policies, every bucket): {compile_s:.0f} s", flush=True)
    lat = calibrate(model, live, dataclasses.replace(ramp_base, policy="sink_window"), buckets,
                    repeats=args.calibrate_repeats)
    ramp_budget = (lat[b0] + (lat[b1] - lat[b0]) * (args.ramp_knee - b0) / (b1 - b0)) / args.target
    print(f"calibration (SinkWindow per-frame s by sessions): {lat}; ramp B = {ramp_budget * 1e3:.0f} ms "
          f"(target at ~{args.ramp_knee} sessions)", flush=True)
    ramps = []
    for p in POLICIES:
        ramps.append(ramp_run(model, live, dataclasses.replace(ramp_base, policy=p, frame_budget_s=ramp_budget),
                              ticks=args.ramp_ticks, every=args.ramp_every, max_arrivals=args.ramp_max,
                              target=args.target, session_ticks=(40, 80), seed=5))
        print(f"  ramp {p}: max admitted {max(r['admitted'] for r in ramps[-1]['rows'])}, rejected "
              f"{ramps[-1]['rejected']}", flush=True)

    # ---- part 3: real WebSocket clients against the server
    # unbounded sessions fill this pool half-way through the run; SinkWindow's bound always fits
    ws_pages = args.ws_sessions * max(math.ceil((T + 4) * 0.5 * args.ws_seconds / B / P),
                                      math.ceil((args.sink + args.window + T + 4) / P) + 2)
    ws = [] if args.no_websocket else [websocket_run(p, args, ws_pages) for p in POLICIES]

    summary = report(runs, ramps, ws, lat, ramp_budget, args)
    summary.update(config={**vars(args), "tokens_per_frame": T, "pages": pages, "ramp_pages": ramp_pages,
                           "ws_pages": ws_pages},
                   runtime_s=time.perf_counter() - t_run)
    print(f"total runtime {summary['runtime_s']:.0f} s")
    harness.write_json(out, "serve_cliff", finite({**summary, "runs": runs, "ramps": ramps, "websocket": ws}),
                       indent=None)
    plot(runs, ramps, ws, ramp_budget, args, out)


if __name__ == "__main__":
    main()
