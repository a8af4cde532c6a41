"""`omnijax serve --replicas N`: the process a user starts. It starts a local Ray cluster (or joins the one
`RAY_ADDRESS` names: `ray start --head` on one node, `ray start --address=...` on the others), deploys N
`EngineReplica`s as one Ray Serve application behind Ray Serve's HTTP/WebSocket proxy on `--host`/`--port`, with
`SessionAwareRouter` as the request router, prints the same `listening on` line as the single-process server and
serves until SIGTERM/SIGINT. Then it drains every replica (each ends its responses and writes its sessions'
snapshots to the shared `--snapshot-dir` before their connections close) and shuts the application down.

Ray is imported inside these functions only: it is the optional `omnijax[ray]` extra, and the single-process server
imports this module without it.

Each replica asks Ray for one GPU when the cluster has GPUs, else one CPU, so `--replicas` above the cluster's
devices is refused by name before anything is deployed; refused so on a cluster it joined, it leaves the Serve
applications already running there alone (`serve.shutdown` would delete every one of them).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from omnijax.serve.cluster.replica import APP_NAME, DEPLOYMENT, EngineReplica, replica_ids

log = logging.getLogger("omnijax.serve")
ROUTER = "omnijax.serve.cluster.router.SessionAwareRouter"
RAY_MISSING = ("--replicas above 1 runs the replicas on Ray Serve, which is not installed: pip install "
               "'omnijax[ray]'")


def ray_installed() -> bool:
    """Whether Ray Serve can be imported (the `omnijax[ray]` extra)."""
    return importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.serve") is not None


def free_port(host: str) -> int:
    """A port on `host` nobody listens on now (for `--port 0`: Ray Serve's proxy needs a number)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def drain_all(timeout_s: float) -> list[dict]:
    """Drains every replica at once (`EngineReplica.drain`, routed to each by its id); returns their reports (a
    replica that failed to drain reports `{"replica", "error"}`)."""
    from ray import serve  # optional: the `omnijax[ray]` extra

    handle = serve.get_deployment_handle(DEPLOYMENT, app_name=APP_NAME)
    calls = [(rid, handle.drain.remote(rid)) for rid in replica_ids()]
    reports = []
    for rid, call in calls:
        try:
            reports.append(call.result(timeout_s=timeout_s))
        except Exception as e:  # noqa: BLE001 - one replica's failure must not stop the others' drain
            reports.append({"replica": rid, "error": f"{type(e).__name__}: {e}"})
    return reports


def serve_replicas(replicas: int, build: Callable[[], Any], *, host: str, port: int, max_ongoing: int,
                   stats_period_s: float = 1.0, drain_timeout_s: float = 30.0) -> int:
    """Serves `replicas` engines until SIGTERM/SIGINT (module docstring); returns the exit code (1: refused).

    Args:
        replicas: N >= 2.
        build: a picklable callable returning a replica's `(ServeContext, ASGI app)`
            (`omnijax.serve.app.replica_app` with its arguments bound); every replica calls it.
        host: the proxy's interface.
        port: the proxy's port (0: a free one).
        max_ongoing: the most requests and WebSocket connections one replica holds at once (Ray Serve's
            `max_ongoing_requests`; the replica's own admission refuses beyond its caps).
        stats_period_s: how often each replica reports its routing stats.
        drain_timeout_s: how long a drain waits for a replica's connections to end.
    """
    import ray  # optional: the `omnijax[ray]` extra
    from ray import serve  # optional: the `omnijax[ray]` extra
    from ray.serve.config import HTTPOptions, RequestRouterConfig  # optional: the `omnijax[ray]` extra

    if replicas < 2:
        raise ValueError(f"serve_replicas needs 2 or more replicas, got {replicas}")
    port = port or free_port(host)
    on_sigterm = signal.getsignal(signal.SIGTERM)
    # Ray Serve's proxy must answer its readiness check within 5 s by default, three times in a row; on a loaded
    # 2-core machine (the test suite beside it) it missed, Serve replaced it and the start failed. A cluster this
    # process starts inherits these (one set by the user wins; a joined cluster keeps its own).
    for name, seconds in (("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60"),
                          ("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")):
        os.environ.setdefault(name, seconds)
    ray.init(include_dashboard=False, log_to_driver=True)  # RAY_ADDRESS: join that cluster instead
    if callable(on_sigterm):  # Ray's own handler would end this process without draining the replicas
        signal.signal(signal.SIGTERM, on_sigterm)
    started = False  # Serve started by this process (only then shut down here: `serve.shutdown` ends every app)
    try:
        print(f"omnijax serve: Ray cluster at {ray.get_runtime_context().gcs_address} (RAY_ADDRESS to join it)",
              flush=True)
        resources = ray.cluster_resources()
        kind = "GPU" if resources.get("GPU", 0) >= 1 else "CPU"
        if replicas > int(resources.get(kind, 0)):
            print(f"omnijax serve: error: --replicas {replicas} needs {replicas} {kind}s (one per replica); the Ray "
                  f"cluster has {int(resources.get(kind, 0))}", file=sys.stderr)
            return 1
        started = True
        serve.start(http_options=HTTPOptions(host=host, port=port))
        deployment = serve.deployment(
            name=DEPLOYMENT, num_replicas=replicas, max_ongoing_requests=max_ongoing,
            ray_actor_options={"num_gpus": 1} if kind == "GPU" else {"num_cpus": 1},
            request_router_config=RequestRouterConfig(request_router_class=ROUTER,
                                                      request_routing_stats_period_s=stats_period_s),
            graceful_shutdown_timeout_s=drain_timeout_s + 10.0)(serve.ingress()(EngineReplica))
        began = time.perf_counter()
        try:
            serve.run(deployment.bind(build, stats_period_s, drain_timeout_s), name=APP_NAME, route_prefix="/")
        except RuntimeError as e:  # a replica's constructor failed (the checkpoint, the flags) after Serve's retries
            print(f"omnijax serve: error: the replicas did not start: {e}", file=sys.stderr)
            return 1
        ids = replica_ids()
        print(f"omnijax serve: {len(ids)} replicas on Ray Serve ({kind}; {', '.join(ids)}) ready in "
              f"{time.perf_counter() - began:.1f} s", flush=True)
        print(f"omnijax serve: listening on http://{host}:{port}/v1 (Realtime ws://{host}:{port}/v1/realtime); "
              f"native protocol on ws://{host}:{port}/session", flush=True)
        try:
            while True:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        finally:  # SIGTERM (raised as an exception by `terminated_on_sigterm`) or Ctrl-C
            began = time.perf_counter()
            reports = drain_all(drain_timeout_s + 15.0)
            print(f"omnijax serve: drained {len(reports)} replicas in {time.perf_counter() - began:.1f} s: "
                  f"{reports}", flush=True)
        return 0
    finally:
        if started:
            serve.shutdown()
        ray.shutdown()  # a joined cluster lives on: this only disconnects
