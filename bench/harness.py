"""What every bench script shares: its command line (`--out`, `--smoke`), interleaved timing of several candidates,
JSON rows and a PNG under `--out`, and a printed table.

- `parse(parser, argv, smoke={...})`: `--smoke` replaces the defaults by the script's smallest setting (options given
  on the command line still win) and turns on the persistent compilation cache (`smoke_setup`), so
  `python -m bench.<group>.<script> --smoke --out DIR` (from the repository root) runs in seconds once its programs
  are cached; `tests/test_bench_smoke.py` runs every script that way.
- `interleaved(cases, rounds)`: every round runs every case once, the order rotated from round to round (A, B then
  B, A for two), so a drift of the machine's speed hits every case alike; returns milliseconds `[rounds, cases]`.
  `stats` summarises one column (median and percentiles), `same_round_ratio` compares two.
- `write_json`, `save_png` (matplotlib, Agg backend) print one `wrote PATH` line per file: the smoke test reads them.
- `module_command(name, ...)`, `checkout_env()`: a script's worker processes run `python -m bench.<group>.<script>`
  with `cwd=ROOT` (the repository root), or with `cwd` another checkout whose library is to be measured;
  `run_worker(command, inline=args.smoke)` runs one, in this process for a `--smoke` check.
- `python -m bench.harness --smoke-all NAME... --out DIR` (`smoke_all`): several scripts' `--smoke` runs one after
  another in one process, as `python -m NAME --smoke --out DIR` would run each, so they pay the interpreter, the
  imports and jax's start once and share what they compile; each script's output sits between a `SMOKE_BEGIN` and a
  `SMOKE_END` line (each on a line of its own, the latter with the exit status, seconds and CPU seconds), on stdout
  and stderr alike. A failing script does not stop the others.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
"""The repository root: the working directory of `python -m bench.<group>.<script>`."""


def parser(doc: str, *, out: str = "bench/out") -> argparse.ArgumentParser:
    """An argument parser described by the first paragraph of `doc`, with `--out` and `--smoke`."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out", default=out, help="directory of the JSON and PNG outputs")
    p.add_argument("--smoke", action="store_true", help="the smallest setting: a check that the script runs")
    return p


def parse(p: argparse.ArgumentParser, argv=None, *, smoke: Mapping[str, Any] | None = None) -> argparse.Namespace:
    """Parses `argv`; with `--smoke`, `smoke` (option destinations -> values) replaces the defaults first and
    `smoke_setup` turns the persistent compilation cache on."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--smoke" in argv:
        smoke_setup()
        if smoke:
            p.set_defaults(**smoke)
    return p.parse_args(argv)


def smoke_setup() -> None:
    """What a `--smoke` run (a check, not a measurement) turns on: the persistent compilation cache of
    `omnijax.compilation_cache` (`OMNIJAX_COMPILATION_CACHE`; off, as there, when it says so), so a second smoke run
    loads its programs instead of compiling them again. It is set through jax's own environment variables, so a
    script's worker processes (started without `--smoke`) share it unless they choose a cache themselves, and a
    process that has not imported jax yet (a parent that only starts workers) need not import it here. A measured
    run leaves the process as it is (compile times are part of some figures). torch's OpenMP threads are made to wait
    passively (`OMP_WAIT_POLICY`, unless set; read when torch is imported): a smoke run's workers run in its own
    process (`run_worker`), where spinning threads would burn the cores its jax compilations need."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    setting = os.environ.get("OMNIJAX_COMPILATION_CACHE", "").strip()
    if setting.lower() in ("off", "0", "false", "none", "no"):
        return
    chosen = os.environ.get("JAX_COMPILATION_CACHE_DIR", "")
    if setting or not chosen:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        chosen = str(Path(setting or os.path.join(xdg, "omnijax", "jax")).expanduser().resolve())
    Path(chosen).mkdir(parents=True, exist_ok=True)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=chosen, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    if "jax" in sys.modules:  # jax read its settings when it was imported
        from omnijax import compilation_cache

        compilation_cache.enable(chosen)


SMOKE_DEMO_MODEL = "smoke_demo_model"
"""Under a smoke run's `--out`: the demo checkpoint `smoke_demo_model` builds once for every script."""


def smoke_demo_model(out: str | Path) -> str:
    """`omnijax.serve.app.build_demo_model`'s checkpoint for a `--smoke` run, built once under
    `<out>/smoke_demo_model/` and shared by the smoke runs into the same `--out` (serve_cliff, token_streaming,
    realtime_load; they may run at once, in one process or several: a file lock makes a second wait for the first's
    build instead of building again). A measured run builds its own (`build_demo_model` into a temporary directory),
    as before; a smoke run loads this one, which spares each script the build (random weights written, converted:
    ~2 CPU s, ~5 s in a process that has not yet trained the tiny tokenizer).

    Returns:
        The converted checkpoint's directory (what `build_demo_model` returns).
    """
    import fcntl

    from omnijax.serve.app import build_demo_model

    root = Path(out) / SMOKE_DEMO_MODEL
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = root / ".complete"  # holds the checkpoint's directory, written once it is whole
        if not done.exists():
            done.write_text(build_demo_model(root / "model"))
        return done.read_text()


def demo_model(out: str | Path, smoke: bool) -> Any:
    """`omnijax.serve.app.build_demo_model`'s model, loaded: for a `--smoke` run the checkpoint the smoke run's
    scripts share (`smoke_demo_model(out)`), otherwise one built into a temporary directory, removed once loaded.

    Returns:
        What `omnijax.load` returns for it.
    """
    import omnijax
    from omnijax.serve.app import build_demo_model

    if smoke:
        return omnijax.load(smoke_demo_model(out))
    with tempfile.TemporaryDirectory(prefix="omnijax-bench-demo-") as tmp:
        return omnijax.load(build_demo_model(tmp))


def module_command(name: str, *args) -> list[str]:
    """The command that runs the bench module `name` in a fresh interpreter: `python -m name *args`.

    Args:
        name: the module's dotted name, e.g. a script's own `__spec__.name` ("bench.tidekv.prefill_memory").
        *args: its command-line arguments (turned into strings).

    Returns:
        The argument list for `subprocess`; run it with `cwd=ROOT`, or with `cwd` another checkout and
        `env=checkout_env()`.
    """
    if not name.startswith("bench."):
        raise ValueError(f"{name!r} is not a bench module: run the script as `python -m bench.<group>.<script>`")
    return [sys.executable, "-m", name, *map(str, args)]


def run_worker(command: Sequence[str], *, inline: bool = False, env: Mapping[str, str] | None = None,
               timeout: float | None = None) -> subprocess.CompletedProcess:
    """Runs a script's worker, a `module_command` (`python -m bench.<group>.<script> --worker ...`), and returns
    what it printed and its exit status.

    Args:
        command: the `module_command` list.
        inline: run the module's `main` in this process (`run_main`), its stdout and stderr captured, instead of a
            fresh interpreter: for `--smoke` runs, which check that the script works and measure nothing, so a
            worker's process isolation buys them nothing while its interpreter start and imports cost seconds
            (torch and transformers alone ~6 CPU s). The worker still parses its command line and prints the result
            the parent reads. `env` then replaces `os.environ` for the call (a variable a library read when it was
            imported, such as OpenMP's, keeps the value it was read with).
        env: the worker process's environment (default: this process's).
        timeout: seconds before the worker process is killed (not for `inline`).

    Returns:
        A `subprocess.CompletedProcess` with text `stdout` and `stderr`.
    """
    command = [str(c) for c in command]
    if not inline:
        return subprocess.run(command, cwd=ROOT, env=None if env is None else dict(env), capture_output=True,
                              text=True, timeout=timeout)
    if command[:2] != [sys.executable, "-m"] or len(command) < 3:
        raise ValueError(f"{command[:3]} is not a module_command: an inline worker runs a bench module's main")
    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run_main(command[2], command[3:])
    finally:
        if env is not None:
            os.environ.clear()
            os.environ.update(saved)
    return subprocess.CompletedProcess(command, code, out.getvalue(), err.getvalue())


def checkout_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a `module_command` process started with `cwd` another checkout (`--compare`, `--root`).

    Under `python -m` the working directory leads the child's `sys.path`, so the checkout's `omnijax` is the one it
    imports; `PYTHONPATH` names this repository, so `bench` comes from here when the checkout's own `bench/` is not a
    package (a checkout from before `bench` became one). Only that child process sees the setting.

    Args:
        env: the environment to start from (default: this process's).

    Returns:
        A copy of `env` with `PYTHONPATH` set to `ROOT`.
    """
    return dict(os.environ if env is None else env, PYTHONPATH=str(ROOT))


def output_dir(args) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def block(x):
    """Waits for `x` when it holds jax arrays (a no-op for anything else)."""
    if "jax" in sys.modules:
        import jax

        return jax.block_until_ready(x)
    return x


@dataclasses.dataclass
class Case:
    """One timed candidate: `fn(*prepare())`; only `fn` is timed. Cases sharing a `key` (a compiled shape) share
    their warm-up calls (`key=None`: the case is its own key)."""

    fn: Callable
    prepare: Callable[[], tuple] = tuple
    key: Hashable = None


def interleaved(cases, rounds: int, *, warmup: int = 1, rotate: bool = True, label: str | None = None,
                after: Callable[[int, Any], None] | None = None):
    """Times `cases` in `rounds` interleaved rounds after `warmup` untimed calls per distinct key.

    `cases`: a sequence of `Case` (or of callables) -> ms array `[rounds, len(cases)]`; a mapping name -> `Case` or
    callable -> name -> ms array `[rounds]`. `rotate`: round r starts at case r mod n. `label`: prints one progress
    line per round. `after(i, result)` sees every call's result (checks, the last output).
    """
    named = isinstance(cases, Mapping)
    items = [c if isinstance(c, Case) else Case(c) for c in (cases.values() if named else cases)]
    seen = set()
    for i, c in enumerate(items):
        key = ("case", i) if c.key is None else c.key
        if key not in seen:
            seen.add(key)
            for _ in range(warmup):
                block(c.fn(*c.prepare()))
    ms = np.zeros((rounds, len(items)))
    for r in range(rounds):
        start_round = time.perf_counter()
        order = list(range(len(items)))
        if rotate and order:
            k = r % len(order)
            order = order[k:] + order[:k]
        for i in order:
            args = block(items[i].prepare())
            start = time.perf_counter()
            result = block(items[i].fn(*args))
            ms[r, i] = 1e3 * (time.perf_counter() - start)
            if after is not None:
                after(i, result)
        if label:
            print(f"  {label} round {r + 1}/{rounds}: {time.perf_counter() - start_round:.1f} s", flush=True)
    return {name: ms[:, i] for i, name in enumerate(cases)} if named else ms


def stats(ms) -> dict:
    """Median, 10th / 90th percentiles, min and max of one case's times."""
    ms = np.asarray(ms, float)
    return {"median": float(np.median(ms)), "p10": float(np.percentile(ms, 10)),
            "p90": float(np.percentile(ms, 90)), "min": float(ms.min()), "max": float(ms.max())}


def same_round_ratio(a, b) -> float:
    """Median over rounds of `a / b` in the same round: robust to the machine's speed drifting between rounds."""
    return float(np.median(np.asarray(a, float) / np.asarray(b, float)))


def write_json(out: Path, stem: str, obj, *, indent: int | None = 1) -> Path:
    """Writes `obj` to OUT/STEM.json atomically (a temporary file beside it, then renamed over it): a run killed
    mid-write leaves the previous file whole, which the resumable tables (`--append`, `--skip-done`) read back."""
    path = Path(out) / f"{stem}.json"
    text = json.dumps(obj, indent=indent)
    fd, tmp = tempfile.mkstemp(prefix=f".{stem}.", suffix=".json.tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    print(f"wrote {path}", flush=True)
    return path


def pyplot():
    """`matplotlib.pyplot` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, out: Path, stem: str, *, dpi: int = 120) -> Path:
    path = Path(out) / f"{stem}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    print(f"wrote {path}", flush=True)
    return path


def print_table(rows: Sequence[Mapping], columns: Sequence[tuple[str, str | Callable, str]]) -> None:
    """One line per row: `columns` are `(header, key or fn(row), format spec)`, right-aligned to the header's width
    (at least 6); `None` prints as "-"."""
    widths = [max(6, len(h)) for h, _, _ in columns]
    print(" ".join(f"{h:>{w}}" for (h, _, _), w in zip(columns, widths)))
    for row in rows:
        cells = []
        for (_, key, spec), w in zip(columns, widths):
            value = key(row) if callable(key) else row[key]
            cells.append(f"{'-' if value is None else format(value, spec):>{w}}")
        print(" ".join(cells))


SMOKE_BEGIN = "== smoke begin"
"""`smoke_all`'s line before a script's output: `== smoke begin NAME`."""
SMOKE_END = "== smoke end"
"""`smoke_all`'s line after a script's output: `== smoke end NAME rc=N seconds=S cpu=C` (C: the CPU seconds of this
process and of the worker processes the script waited for, while it ran)."""


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its children that ended and were waited for."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


def run_main(name: str, argv: Sequence[str]) -> int:
    """Runs the bench module `name`'s `main(argv)` in this process and gives the exit status that
    `python -m name *argv` would have ended with (an exception prints its traceback and gives 1).

    Args:
        name: the module's dotted name ("bench.tidekv.prefill_fidelity").
        argv: its command line.

    Returns:
        0 when `main` returned `None` or 0; `main`'s integer or `SystemExit`'s code otherwise (a message is printed
        to stderr and gives 1, as Python does).
    """
    try:
        result = importlib.import_module(name).main(list(argv))
    except SystemExit as stop:
        result = stop.code
    except Exception:  # the script's failure is reported, the next script still runs
        traceback.print_exc()
        return 1
    if result is None or isinstance(result, int):
        return int(result or 0)
    print(result, file=sys.stderr)
    return 1


def smoke_all(names: Iterable[str], out: str | Path) -> dict[str, int]:
    """Runs `python -m NAME --smoke --out OUT` for every name in `names`, one after another in this process.

    Args:
        names: the bench modules' dotted names, in the order to run them (an iterable read as it goes: a caller can
            hand the next name once the previous script's `SMOKE_END` line is out).
        out: the shared output directory.

    Returns:
        Each name's exit status (`run_main`).
    """
    codes = {}
    for name in names:
        if not name.startswith("bench.") or name == "bench.harness":
            raise ValueError(f"{name!r} is not a bench script: give bench.<group>.<script>")
        for stream in (sys.stdout, sys.stderr):  # each marker on a line of its own, whatever came before
            print(f"\n{SMOKE_BEGIN} {name}", file=stream, flush=True)
        start, cpu = time.perf_counter(), cpu_seconds()
        codes[name] = run_main(name, ["--smoke", "--out", str(out)])
        seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
        for stream in (sys.stdout, sys.stderr):
            print(f"\n{SMOKE_END} {name} rc={codes[name]} seconds={seconds:.1f} cpu={cpu:.1f}", file=stream,
                  flush=True)
    return codes


def _main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Runs several bench scripts' --smoke in one process, one after another.")
    p.add_argument("--smoke-all", nargs="+", required=True, metavar="NAME",
                   help="bench modules to run, in this order (bench.<group>.<script>); `-`: read one name per line "
                        "from stdin until it closes")
    p.add_argument("--out", required=True, help="the scripts' shared --out")
    args = p.parse_args(argv)
    names = args.smoke_all
    if names == ["-"]:
        names = (line.strip() for line in sys.stdin if line.strip())
    else:
        bad = [n for n in names if not n.startswith("bench.") or n == "bench.harness"]
        if bad:
            p.error(f"not bench scripts: {', '.join(bad)} (give bench.<group>.<script>)")
    codes = smoke_all(names, args.out)
    return max(codes.values(), default=0)


if __name__ == "__main__":
    sys.exit(_main())
