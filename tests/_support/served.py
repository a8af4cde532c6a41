"""`omnijax serve --demo-model` in a subprocess for tests that kill it: start, wait until it listens, SIGKILL."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading


class Served:
    """`python -m omnijax.cli serve --demo-model --port 0 <args>`; `base_url` (`http://host:port/v1`) once it listens.

    Args:
        args: the other command-line arguments.
        start_timeout_s: how long it may take to listen (loading, warm-up compilation).
    """

    def __init__(self, *args: str, start_timeout_s: float = 300.0):
        cmd = [sys.executable, "-m", "omnijax.cli", "serve", "--demo-model", "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        ready = threading.Event()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line.rstrip())
                if "listening on" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(start_timeout_s) or self.proc.poll() is not None:
            self.proc.kill()
            raise AssertionError("the server did not start:\n" + "\n".join(self.lines[-30:]))
        match = re.search(r"(http://\S+/v1)", next(x for x in self.lines if "listening on" in x))
        assert match is not None, self.lines
        self.base_url = match.group(1)
        self.ws_url = "ws" + self.base_url[len("http"):-len("/v1")]

    def log(self, last: int = 40) -> str:
        return "\n".join(self.lines[-last:])

    def kill(self) -> int:
        """SIGKILL (no shutdown, no snapshot at the end); returns the exit status."""
        self.proc.send_signal(signal.SIGKILL)
        return self.proc.wait(60)

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then SIGKILL when it does not exit within `timeout_s`; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                return self.kill()
        return self.proc.returncode
