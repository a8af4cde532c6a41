"""Rolling restart (and upgrade) of a running `omnijax serve --replicas N`, one replica at a time, through its HTTP
routes: `python -m omnijax.serve.cluster.roll http://HOST:PORT [--api-key KEY]`.

For each replica alive when it starts, in turn:

1. `POST /v1/omnijax/drain?replica=<id>&restart=1`: the replica stops taking sessions, ends its responses, writes
   each Realtime session's snapshot to the shared `--snapshot-dir` and closes its connection with 1012 (clients
   reconnect with `?resume=<token>` and land on another replica, which resumes the session bit-exactly); then its
   process exits;
2. Ray Serve starts a replica in its place: a fresh process, which imports the omnijax installed on its node now and
   loads the checkpoint at the served path now;
3. the next replica is drained only once the application has N replicas again and every one of them answers
   (`GET /v1/omnijax/replica?replica=<id>`) without draining, so at most one replica is out at any time.

An upgrade is: install the new omnijax (and/or write the new checkpoint at the served path) on every node, then roll.
Sessions resume bit-exactly when the upgrade keeps the model and the pool settings; a snapshot the new version cannot
resume (another model shape, format) is refused by name on resume (`resume_failed`), never restarted afresh.

Only the standard library (the command runs wherever `curl` would).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

DRAIN_PATH = "/v1/omnijax/drain"
REPLICA_PATH = "/v1/omnijax/replica"
REPLICAS_PATH = "/v1/omnijax/replicas"


def _call(base: str, path: str, *, method: str = "GET", api_key: str | None = None, timeout_s: float = 120.0) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(base.rstrip("/") + path, method=method, headers=headers,
                                     data=b"" if method == "POST" else None)
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def replicas(base: str, api_key: str | None = None) -> list[str]:
    """The ids of the replicas alive now (`GET /v1/omnijax/replicas`)."""
    return list(_call(base, REPLICAS_PATH, api_key=api_key)["replicas"])


def _serving(base: str, rid: str, api_key: str | None) -> bool:
    try:
        answer = _call(base, f"{REPLICA_PATH}?replica={rid}", api_key=api_key, timeout_s=30.0)
    except (OSError, ValueError):  # urllib's errors are OSErrors: a replica still starting or just gone
        return False
    return answer.get("replica") == rid and not answer.get("draining")


def restart_one(base: str, rid: str, *, api_key: str | None = None, timeout_s: float = 900.0,
                poll_s: float = 1.0) -> dict:
    """Drains replica `rid` for a restart and waits until its replacement serves (module docstring, steps 1-3).

    Returns:
        `{"replica": rid, "drain": the drain's report, "replacements": the ids that were not there before,
        "seconds"}`.

    Raises:
        TimeoutError: the application did not have as many serving replicas again within `timeout_s`.
    """
    began = time.monotonic()
    before = replicas(base, api_key)
    if rid not in before:
        raise ValueError(f"no replica {rid!r} (alive: {', '.join(before)})")
    report = _call(base, f"{DRAIN_PATH}?replica={rid}&restart=1", method="POST", api_key=api_key,
                   timeout_s=timeout_s)
    while True:
        now = replicas(base, api_key)
        fresh = [r for r in now if r not in before]
        if rid not in now and len(now) >= len(before) and all(_serving(base, r, api_key) for r in now):
            return {"replica": rid, "drain": report, "replacements": fresh,
                    "seconds": round(time.monotonic() - began, 1)}
        if time.monotonic() - began > timeout_s:
            raise TimeoutError(f"replica {rid} drained, but {len(before)} replicas were not serving again within "
                               f"{timeout_s:g} s (alive: {', '.join(now)})")
        time.sleep(poll_s)


def rolling_restart(base: str, *, api_key: str | None = None, timeout_s: float = 900.0) -> list[dict]:
    """`restart_one` for every replica alive now, one after another; their reports."""
    return [restart_one(base, rid, api_key=api_key, timeout_s=timeout_s) for rid in replicas(base, api_key)]


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring)."""
    p = argparse.ArgumentParser(prog="python -m omnijax.serve.cluster.roll", description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="the server's address, http://HOST:PORT (what `omnijax serve` printed, less /v1)")
    p.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one replica may take to be replaced")
    args = p.parse_args(argv)
    try:
        for report in rolling_restart(args.base, api_key=args.api_key, timeout_s=args.timeout):
            print(json.dumps(report), flush=True)
    except (OSError, ValueError, TimeoutError) as e:
        print(f"omnijax roll: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
