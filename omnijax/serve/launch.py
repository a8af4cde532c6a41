"""What `omnijax serve` does around the server: refuse a busy port before loading anything, and let SIGTERM unwind."""

from __future__ import annotations

import contextlib
import errno
import signal
import socket
import threading
from collections.abc import Iterator


class _Terminated(Exception):
    """SIGTERM arrived (raised by the handler `terminated_on_sigterm` installs)."""


@contextlib.contextmanager
def terminated_on_sigterm() -> Iterator[list[bool]]:
    """While the server loads, warms up and serves, SIGTERM unwinds the stack (so the demo model's temporary folder is
    removed: its default action killed the process at once, leaving ~90 MB behind each time) instead of killing the
    process. Yields a list that holds True once SIGTERM came. uvicorn handles the signal itself while it serves and
    raises it again when it has shut down, which lands here."""
    happened: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield happened
        return

    def handler(signum, frame):
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield happened
    except _Terminated:
        happened.append(True)
    finally:
        signal.signal(signal.SIGTERM, previous)


def port_in_use(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on (another process holds it, or the address is not this machine's), or
    None when it can (port 0 always can). Checked before the model loads: a busy port once cost a 27-70 s warm-up and
    42 lines of tracebacks."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"--host {host!r} does not resolve ({e.strerror})"
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            try:
                probe.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return (f"port {port} on {host} is in use by another process; stop it or choose another port "
                            f"with --port")
                return f"cannot listen on {host}:{port}: {e.strerror}"
    return None
