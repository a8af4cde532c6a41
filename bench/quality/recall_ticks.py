"""Tick latency of the serving engine with question-time recall (issue 40): the same sessions served by an engine
without recall and by one with `Recall(...)`, at equal device cells (the same pool, policy and paging), side by side.

Each engine serves `--sessions` sessions of a tiny random decoder (`TINY_OMNI`): every tick each session submits a
context frame of `--frame` tokens, and every `--every`-th tick (staggered per session) a question of 5 tokens asking
for `--answer` tokens instead. With recall a question first waits for its scores (`TickReport.recalling`: computed on
the recall executor while the engine ticks the other sessions) and gets no new frame meanwhile, as the engine's
tests drive it. The engines tick alternately in one loop (the machine's load is shared), after `--warm` untimed ticks
(the pools fill, the policy trims; `warm_up_recall` compiles the recall programs first, as `omnijax serve` does).

Reported per (paging mode, recall off / on): tick wall time p50 / p99 over the context ticks (no question asked or
answered in the tick) and over the question ticks (some session's question was submitted or answered in it), the
question latency (wall time from the question's submission to its answer, ticks and any wait for scores included;
when every session of an engine waits for its scores the driver waits for them rather than tick an idle engine) p50
/ p99, the process's CPU milliseconds per tick (`time.process_time`: every thread, the recall executor's included),
and the cells recalled for the first session. Writes `recall_ticks.json` and `recall_ticks.png` under `--out`.

    .venv/bin/python -m bench.quality.recall_ticks --out bench/quality/results
    .venv/bin/python -m bench.quality.recall_ticks --smoke   # seconds
"""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np

from bench import harness

SMOKE = dict(ticks=16, warm=8, paging=["native"], every=6, sessions=1, budget=16, window=16, frame=8,
             warmup=False)


def build_parser():
    p = harness.parser(__doc__)
    p.add_argument("--sessions", type=int, default=2, help="sessions per engine")
    p.add_argument("--frame", type=int, default=16, help="tokens per frame (the engine's chunk_tokens)")
    p.add_argument("--answer", type=int, default=4, help="answer tokens a question asks for")
    p.add_argument("--every", type=int, default=10, help="a question every this many ticks per session")
    p.add_argument("--ticks", type=int, default=160, help="timed ticks")
    p.add_argument("--warm", type=int, default=60, help="untimed ticks first")
    p.add_argument("--window", type=int, default=64, help="SinkWindow(4, window): the device cells per session")
    p.add_argument("--budget", type=int, default=64, help="Recall(budget=...) cells")
    p.add_argument("--paging", nargs="+", default=["native", "ordered_suffix"], help="paging modes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip warm_up_recall (--smoke: its programs compile in the ticks that need them)")
    return p


class Driver:
    """One engine and its sessions' scripts; `tick()` submits what is due and times one engine tick."""

    def __init__(self, engine, sessions: int, args, rng):
        from omnijax.chunks.chunk import text_chunk

        self.engine, self.args = engine, args
        self.ids = [f"s{i}" for i in range(sessions)]
        for sid in self.ids:
            engine.open(sid)
        self.frames = {sid: 0 for sid in self.ids}
        self.asked: dict[str, float] = {}  # sid -> wall time its question was submitted
        self.latencies: list[float] = []
        self.text_chunk, self.rng = text_chunk, rng

    def tick(self) -> tuple[float, float, bool]:
        """Returns (wall ms, process CPU ms, whether a question was submitted or answered in the tick)."""
        a, question = self.args, False
        recall = self.engine.recall
        if recall is not None and recall.futures() and all(sid in self.asked for sid in self.ids):
            # every session waits for its question's scores: nothing to tick (idle time, in the latency only)
            concurrent.futures.wait(recall.futures(), 60, concurrent.futures.FIRST_COMPLETED)
        start = time.perf_counter()
        for i, sid in enumerate(self.ids):
            if sid in self.asked:
                continue  # its question is being scored or answered: nothing new for it
            n = self.frames[sid]
            self.frames[sid] += 1
            if n % a.every == (i * a.every) // len(self.ids) and n >= a.every:
                chunk = self.text_chunk(self.rng.integers(3, 290, 5), length=a.frame, unit=10_000 + n,
                                        answer_tokens=a.answer)
                self.engine.submit(sid, chunk, a.answer)
                self.asked[sid], question = start, True
            else:
                self.engine.submit(sid, self.text_chunk(self.rng.integers(3, 290, a.frame), length=a.frame,
                                                        unit=2 * n), 0)
        cpu = time.process_time()
        report = self.engine.tick()
        end = time.perf_counter()
        cpu = time.process_time() - cpu
        for sid in list(self.asked):
            if sid in report.outputs:
                self.latencies.append(1e3 * (end - self.asked.pop(sid)))
                question = True
        return 1e3 * (end - start), 1e3 * cpu, question


def pct(x, q):
    return None if not len(x) else float(np.percentile(np.asarray(x, float), q))


def main(argv=None) -> int:
    args = harness.parse(build_parser(), argv, smoke=SMOKE)
    out = harness.output_dir(args)
    import omnijax
    from omnijax.models.config import TINY_OMNI
    from omnijax.retention import SinkWindow
    from omnijax.retention.recall import Recall
    from omnijax.serve.engine.engine import Engine, EngineConfig
    from omnijax.serve.engine.recall_warmup import warm_up_recall

    model = omnijax.Decoder(TINY_OMNI)
    a = args
    cells = 2 * (a.window + 4 + a.frame + a.answer + a.budget)  # per session, with room for a recall
    page = 16
    pages = a.sessions * -(-cells // page)
    rows = []
    for paging in a.paging:
        drivers = {}
        for recall in (None, Recall(budget=a.budget, top_units=8)):
            config = omnijax.StreamConfig(policy=SinkWindow(sink=4, window=a.window), paging=paging, page_size=page,
                                          num_pages=pages, max_answer_tokens=a.answer, recall=recall)
            buckets = tuple(sorted({1, a.sessions}))
            engine = Engine(model, EngineConfig(stream=config, chunk_tokens=a.frame, buckets=buckets))
            if recall is not None and a.warmup:
                warm_up_recall(engine, buckets)
            drivers["on" if recall else "off"] = Driver(engine, a.sessions, a, np.random.default_rng(a.seed))
        times = {k: {"context": [], "question": [], "cpu": []} for k in drivers}
        for t in range(a.warm + a.ticks):
            for k, d in (drivers.items() if t % 2 else reversed(drivers.items())):
                if t == a.warm:
                    d.latencies.clear()
                ms, cpu, question = d.tick()
                if t >= a.warm:
                    times[k]["question" if question else "context"].append(ms)
                    times[k]["cpu"].append(cpu)
        for k, d in drivers.items():
            x = times[k]
            stats = d.engine.recall_stats(d.ids[0]) if k == "on" else None
            rows.append({"paging": paging, "recall": k, "context_ticks": len(x["context"]),
                         "context_p50": pct(x["context"], 50), "context_p99": pct(x["context"], 99),
                         "question_ticks": len(x["question"]), "question_p50": pct(x["question"], 50),
                         "question_p99": pct(x["question"], 99), "latency_p50": pct(d.latencies, 50),
                         "latency_p99": pct(d.latencies, 99), "questions": len(d.latencies),
                         "cpu_ms_per_tick": float(np.mean(x["cpu"])),
                         "recalled_cells_s0": None if stats is None else stats.recalled_cells,
                         "device_cells": pages * page})
    harness.print_table(rows, [("paging", "paging", ""), ("recall", "recall", ""),
                               ("ctx n", "context_ticks", "d"), ("ctx p50", "context_p50", ".1f"),
                               ("ctx p99", "context_p99", ".1f"), ("q n", "question_ticks", "d"),
                               ("q p50", "question_p50", ".1f"), ("q p99", "question_p99", ".1f"),
                               ("lat p50", "latency_p50", ".1f"), ("lat p99", "latency_p99", ".1f"),
                               ("cpu/tick", "cpu_ms_per_tick", ".1f"), ("recalled", "recalled_cells_s0", "")])
    harness.write_json(out, "recall_ticks", {"args": vars(args), "rows": rows})
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['paging']}\nrecall {r['recall']}" for r in rows]
    x = np.arange(len(rows))
    for off, key, name in ((-0.2, "context", "context tick"), (0.2, "question", "question tick")):
        ax.bar(x + off, [r[f"{key}_p50"] or 0 for r in rows], 0.4, label=f"{name} p50")
        ax.scatter(x + off, [r[f"{key}_p99"] or 0 for r in rows], marker="_", s=200, color="k")
    ax.set_xticks(x, labels)
    ax.set_ylabel("ms (bar p50, dash p99)")
    ax.legend()
    harness.save_png(fig, out, "recall_ticks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
