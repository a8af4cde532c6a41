"""`SessionAwareRouter` (the request router of `omnijax serve --replicas N`) and a replica's headroom, without a Ray
cluster: the router is Ray Serve's own `RequestRouter` subclass, given stand-in replicas (an id and the routing stats
a replica reports) and real `PendingRequest`s, as Ray Serve's proxy and handles would give them. Checked against
what the module docstring promises, case by case: a named replica, the holder of a resume token, the most headroom
(the AIMD cap, capped by the session limit, less open sessions, less requests in flight since the last report, less
reservations), a burst spread by reservations, draining replicas skipped unless all drain.

Ray Serve (and the router module, which imports it) is imported by the first test, not when the module is collected:
every xdist worker collects every module, and `import ray.serve` costs ~1.2 CPU s that only the worker running these
tests needs (`_ray`)."""

import asyncio
import functools
import importlib.util
import pickle
import types
from dataclasses import dataclass

import pytest

if importlib.util.find_spec("ray") is None:  # as pytest.importorskip("ray.serve"), without importing Ray Serve
    pytest.skip("Ray Serve (the `ray` and `test` extras) is not installed", allow_module_level=True)

from omnijax.serve.cluster.replica import EngineReplica  # noqa: E402  (imports no Ray)


@functools.cache
def _ray() -> types.SimpleNamespace:
    """Ray Serve's names the tests use, the router module and the deployment its stand-in replicas belong to."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
    from ray.serve.request_router import PendingRequest

    from omnijax.serve.cluster import router

    return types.SimpleNamespace(DeploymentHandleSource=DeploymentHandleSource, ReplicaID=ReplicaID,
                                 RequestMetadata=RequestMetadata, PendingRequest=PendingRequest, router=router,
                                 deployment=DeploymentID(name="omnijax", app_name="omnijax"))


@dataclass
class ProxyRequest:
    """What Ray Serve's HTTP proxy sends a replica (pickled): an object with the ASGI scope."""

    asgi_scope: dict


@pytest.fixture(autouse=True)
def loop():
    """An event loop for the module (a `PendingRequest` makes its future on it, as in Ray Serve's proxy)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    asyncio.set_event_loop(None)
    loop.close()


def _router():
    ray = _ray()
    return ray.router.SessionAwareRouter(ray.deployment, ray.DeploymentHandleSource.PROXY)


def _replica(rid: str, headroom: int, stamp: int = 1, draining: bool = False, tokens=()):
    stats = {"replica": rid, "headroom": headroom, "stamp": stamp, "draining": draining, "tokens": list(tokens)}
    return types.SimpleNamespace(replica_id=_ray().ReplicaID(rid, _ray().deployment), routing_stats=stats)


def _request(n: int, query: str = "", method: str = "__call__", args=None):
    if args is None:
        scope = {"type": "websocket", "path": "/session", "query_string": query.encode()}
        args = [pickle.dumps(ProxyRequest(scope))]
    ray = _ray()
    return ray.PendingRequest(args=args, kwargs={}, metadata=ray.RequestMetadata(request_id=f"r{n}",
                                                                                 internal_request_id=f"i{n}",
                                                                                 call_method=method))


def _ranks(router, replicas, request) -> list[list[str]]:
    ranked = asyncio.get_event_loop().run_until_complete(router.choose_replicas(replicas, request))
    return [[r.replica_id.unique_id for r in rank] for rank in ranked]


def test_most_headroom_first_and_requests_in_flight_count_until_the_next_report():
    router, a, b = _router(), _replica("a", 1), _replica("b", 3)
    router.curr_replicas.update({a.replica_id: a, b.replica_id: b})  # what Ray Serve's replica updates keep
    assert _ranks(router, [a, b], _request(0)) == [["b"], ["a"]]
    router.on_request_completed(b.replica_id, "i0")  # request 0 ends without being routed: its reservation goes
    for n in (1, 2):  # two requests routed to b (still running): 3 - 2 = 1, a tie with a
        _ranks(router, [a, b], _request(n))
        router.on_request_routed(_request(n), b.replica_id, None)
    assert not router._reserved  # routed requests are counted as in flight, no longer as reserved
    assert (router._room(a), router._room(b)) == (1, 1)
    router.on_request_completed(b.replica_id, "i1")  # one completed: b has 2 again
    assert (router._room(a), router._room(b)) == (1, 2)
    assert _ranks(router, [a, b], _request(4))[0] == ["b"]
    router._reserved.clear()
    b.routing_stats = {**b.routing_stats, "headroom": 0, "stamp": 2}  # a new report already counts the other one
    assert router._room(b) == 0 and _ranks(router, [a, b], _request(5)) == [["a"], ["b"]]


def test_a_burst_ranked_before_any_is_routed_is_spread_by_reservations(monkeypatch):
    router, a, b = _router(), _replica("a", 2), _replica("b", 2)
    firsts = [_ranks(router, [a, b], _request(n))[0] for n in range(4)]
    assert all(len(first) == 1 for first in firsts)
    assert sorted(first[0] for first in firsts) == ["a", "a", "b", "b"]  # 2 / 2, not 4 / 0
    assert (router._room(a), router._room(b)) == (0, 0)
    router_module = _ray().router
    now = router_module.time.monotonic()
    monkeypatch.setattr(router_module.time, "monotonic", lambda: now + router_module.RESERVE_S + 1)
    _ranks(router, [a, b], _request(9))  # reservations older than RESERVE_S (requests cancelled) are dropped
    assert sorted(r for r, _ in router._reserved.values()) in (["a"], ["b"])  # only request 9's own is left


def test_named_replica_then_token_holder_then_headroom_and_draining_skipped():
    router = _router()
    a, b = _replica("a", 2, tokens=["t" * 32]), _replica("b", 0)
    c = _replica("c", 5, draining=True)
    assert _ranks(router, [a, b, c], _request(0, "replica=b")) == [["b"]]  # named: even with no headroom
    assert _ranks(router, [a, b, c], _request(1, "replica=c")) == [["c"]]  # named: even draining
    assert _ranks(router, [a, b, c], _request(2, "replica=zz")) == [["a", "b", "c"]]  # no such id: it refuses itself
    b.routing_stats["tokens"] = ["u" * 32]
    assert _ranks(router, [a, b, c], _request(3, "resume=" + "u" * 32)) == [["b"]]  # the holder, headroom or not
    assert _ranks(router, [a, b, c], _request(4, "resume=" + "v" * 32))[0] == ["a"]  # nobody holds it: headroom
    c.routing_stats["tokens"] = ["w" * 32]
    assert _ranks(router, [a, b, c], _request(5, "resume=" + "w" * 32))[0] == ["a"]  # a draining holder is skipped
    assert "c" not in sum(_ranks(router, [a, b, c], _request(6)), [])  # never chosen by headroom
    a.routing_stats["draining"] = b.routing_stats["draining"] = True  # every replica drains: they refuse by name
    assert _ranks(router, [a, b, c], _request(7)) == [["a", "b", "c"]]
    handle_call = _request(8, method="drain", args=["b"])  # a deployment-handle call naming its replica
    assert _ranks(router, [a, b, c], handle_call) == [["b"]]


def test_a_replicas_headroom_is_the_aimd_cap_capped_by_the_session_limit_less_its_sessions():
    replica = EngineReplica.__new__(EngineReplica)  # no Ray replica context: only the state headroom reads
    worker = types.SimpleNamespace(max_sessions=4, lanes={"s1": 0}, admission=types.SimpleNamespace(cap=3))
    replica.context, replica.draining = types.SimpleNamespace(worker=worker), False
    assert replica.headroom() == 2  # AIMD's cap 3 binds: 3 - 1
    worker.admission.cap = 9
    assert replica.headroom() == 3  # the session limit binds: 4 - 1
    worker.admission = None
    worker.lanes = {f"s{i}": i for i in range(5)}
    assert replica.headroom() == 0  # over the limit: never negative
    worker.lanes, replica.draining = {}, True
    assert replica.headroom() == 0  # a draining replica takes nothing
