"""Device-kernel census of jitted calls: trace them with `jax.profiler.trace`, count and time the device events.

Shared by `bench/omnitide/attention_kernel.py` and `bench/omnitide/migration_cost.py` (`--profile DIR`). On a GPU
the device events are the kernels each call launched; on CPU everything is host work and the census is empty.
"""

from __future__ import annotations

import collections
import gzip
import json
from pathlib import Path

import jax


def trace_calls(calls, trace_dir: Path) -> dict:
    """Runs `calls` (`(fn, prepare)` pairs; `fn(*prepare())`) inside one trace; returns `device_kernels`.

    One untraced call comes first, so compilation stays out of the trace, and every call's arguments are built before
    tracing starts, so only the calls themselves are traced (a call may donate its arguments).
    """
    fn, prepare = calls[0]
    jax.block_until_ready(fn(*prepare()))
    args = [prepare() for _, prepare in calls]
    jax.block_until_ready(args)
    with jax.profiler.trace(str(trace_dir)):
        for (fn, _), a in zip(calls, args):
            jax.block_until_ready(fn(*a))
    return device_kernels(trace_dir, len(calls))


def device_kernels(trace_dir: Path, calls: int) -> dict:
    """Device events of a `jax.profiler.trace` directory: per call counts and time, the longest kernels, tracks.

    Device tracks are the trace's processes not named `/host...`; when some of their threads are named `Stream...`
    (CUDA streams), only those count, since other device threads repeat the same kernels grouped by XLA op/module.
    """
    trace = json.loads(gzip.decompress(sorted(trace_dir.rglob("*.trace.json.gz"))[-1].read_bytes()))["traceEvents"]
    meta = lambda kind: {(e["pid"], e.get("tid")) if kind == "thread_name" else e["pid"]: e["args"]["name"]  # noqa: E731
                         for e in trace if e.get("ph") == "M" and e.get("name") == kind}
    procs, threads = meta("process_name"), meta("thread_name")
    device = [e for e in trace if e.get("ph") == "X" and not procs.get(e["pid"], "/host").startswith("/host")]
    streams = [e for e in device if threads.get((e["pid"], e["tid"]), "").startswith("Stream")]
    counted = streams or device
    tracks = collections.Counter(f"{procs[e['pid']]}|{threads.get((e['pid'], e['tid']), e['tid'])}" for e in device)
    by_name = collections.Counter()
    for e in counted:
        by_name[e["name"][:60]] += e.get("dur", 0.0)
    return {"kernels_per_call": len(counted) / calls, "device_us_per_call": sum(by_name.values()) / calls,
            "top_kernels_us_per_call": {k: v / calls for k, v in by_name.most_common(8)},
            "tracks": dict(tracks.most_common(6))}


def describe(summary: dict) -> str:
    """One line: device events and their time per call, and the three longest kernels."""
    top = ", ".join(f"{name} {us:.1f}" for name, us in list(summary["top_kernels_us_per_call"].items())[:3])
    return (f"{summary['kernels_per_call']:.1f} device events per call, {summary['device_us_per_call']:.1f} us"
            + (f"; longest (us per call): {top}" if top else "; no device track (CPU)"))
