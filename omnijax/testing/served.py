"""`omnijax serve --demo-model` in a subprocess, for tests and benchmarks that need a real server process (one they
can SIGKILL and restart): start it on a free loopback port, wait until it listens, read its log, check its health and
memory, stop or kill it.

The test suite (`tests/serve/`) and the hostile-input probe (`bench/metronome/hostile_probe.py`) both use `Served`;
it needs nothing beyond the standard library (the health check uses `urllib`).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

__all__ = ["Served"]


class Served:
    """`python -m omnijax.cli serve --demo-model --port 0 <args>` in a subprocess.

    Once it listens: `base` is `http://host:port`, `base_url` the OpenAI base `http://host:port/v1`, `ws_url` (also
    `ws`) `ws://host:port`. Its output is kept in `lines` (a pump thread reads it); `instance_start` is the index in
    `lines` where the running instance's output begins (a restart appends to the same list).

    Args:
        args: the other command-line arguments.
        start_timeout_s: how long it may take to listen (loading, warm-up compilation); None: do not start it here
            (call `start`).
        new_session: run it in its own process group (a Ctrl-C in the terminal then reaches only the caller).
    """

    def __init__(self, *args: str, start_timeout_s: float | None = 300.0, new_session: bool = False):
        self.args, self.new_session = tuple(args), new_session
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []
        self.base = ""
        self.starts = 0
        self.start_s: list[float] = []
        self.instance_start = 0
        if start_timeout_s is not None:
            self.start(start_timeout_s)

    @property
    def command(self) -> list[str]:
        """The command line it runs."""
        return [sys.executable, "-m", "omnijax.cli", "serve", "--demo-model", "--port", "0", *self.args]

    def start(self, timeout_s: float = 600.0) -> None:
        """Starts the server (again, after a kill or stop) and waits until it listens.

        Raises:
            RuntimeError: it exited, or did not listen within `timeout_s` (the message holds its last output).
        """
        began = time.perf_counter()
        self.instance_start = len(self.lines)
        proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=self.new_session)
        self.proc, lines, ready = proc, self.lines, threading.Event()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line.rstrip())
                if "listening on" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        # the pump also sets `ready` when the output ends: a server that exited before listening (its stdout closed
        # a moment before the process is reaped, so `poll()` may not see the exit yet) is told by the missing line
        listening = ready.wait(timeout_s) and proc.poll() is None
        line = next((x for x in reversed(self.lines[self.instance_start:]) if "listening on" in x), None)
        if not listening or line is None:
            proc.kill()
            proc.wait(60)
            raise RuntimeError(f"omnijax serve did not start (exit status {proc.returncode}):\n" + self.log(30))
        match = re.search(r"(http://[^\s/]+:[0-9]+)", line)
        if match is None:
            raise RuntimeError(f"omnijax serve's listening line names no address: {line!r}")
        self.base = match.group(1)
        self.starts += 1
        self.start_s.append(time.perf_counter() - began)

    @property
    def base_url(self) -> str:
        return self.base + "/v1"

    @property
    def ws_url(self) -> str:
        return "ws" + self.base[len("http"):]

    ws = ws_url

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self, last: int = 40) -> str:
        """The last `last` lines of its output."""
        return "\n".join(self.lines[-last:])

    def log_since(self, index: int) -> list[str]:
        """Its output from line `index` on."""
        return self.lines[index:]

    def healthy(self, headers: dict | None = None, timeout_s: float = 2.0) -> float | None:
        """Seconds `GET /v1/models` took when it answered 200 within `timeout_s`, else None."""
        began = time.perf_counter()
        request = urllib.request.Request(self.base_url + "/models", headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                ok = response.status == 200
                response.read()
        except (urllib.error.URLError, OSError, ValueError):
            return None
        return time.perf_counter() - began if ok else None

    def rss_mb(self) -> float | None:
        """Its resident memory in MB (Linux /proc), or None."""
        if self.proc is None:
            return None
        try:
            text = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return None
        m = re.search(r"VmRSS:\s+(\d+) kB", text)
        return int(m.group(1)) / 1024 if m else None

    def kill(self, sig: int = signal.SIGKILL, timeout_s: float = 120.0) -> int | None:
        """Sends `sig` (SIGKILL: no shutdown, no snapshot at the end) and waits for the exit, SIGKILLing it when it
        has not exited within `timeout_s`; returns the exit status (None: never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(60)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, then SIGKILL when it does not exit within `timeout_s`; returns the exit status."""
        return self.kill(signal.SIGTERM, timeout_s)
