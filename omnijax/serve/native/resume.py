"""Resumable native `/session` connections (with `--snapshot-dir`): the token, the snapshot's metadata, the plan.

A native session's state is its engine session (KV pages, cursor, sampling key, last logits: the
`omnijax.serve.engine.snapshot.SessionSnapshot`) plus two counters: `seq`, the next frame's number as the client
sees it, and `unit`, the audio unit the next frame is encoded as. Both go in the snapshot's `meta` under
`"native"`, with the frame budget and the served model name, and are checked by name before anything is opened: a
Realtime session's snapshot (no `"native"` entry) is refused here, as a native one is by the Realtime resume.

Full-duplex sessions (MiniCPM-o) do not resume: their streaming audio encoder keeps state outside the engine.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from omnijax.serve.engine.snapshot import COUNTER_LIMIT, SessionSnapshot
from omnijax.serve.realtime.resume import ResumeRefused, lease_snapshot
from omnijax.serve.realtime.snapshot_store import Lease, SnapshotStore

if TYPE_CHECKING:
    from omnijax.serve.context import ServeContext

KEY = "native"


def native_meta(seq: int, unit: int, frame_ms: float, model_name: str) -> dict:
    """The `meta` of a native session's snapshot (module docstring)."""
    return {KEY: {"seq": int(seq), "unit": int(unit), "frame_ms": float(frame_ms), "model": model_name}}


def restored_counters(snapshot: SessionSnapshot, frame_ms: float, model_name: str) -> tuple[int, int]:
    """`(seq, unit)` of a native snapshot, checked against this server (ResumeRefused naming the field)."""
    meta = snapshot.meta.get(KEY) if isinstance(snapshot.meta, dict) else None
    if not isinstance(meta, dict):
        raise ResumeRefused("this resume token's snapshot is not a native session's (a Realtime session resumes "
                            "through the Realtime API)")
    for name in ("seq", "unit"):
        value = meta.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= COUNTER_LIMIT:
            raise ResumeRefused(f"the snapshot's native {name!r} is not a counter in [0, {COUNTER_LIMIT}]: {value!r}")
    if meta.get("frame_ms") != float(frame_ms):
        raise ResumeRefused(f"the snapshot was taken with frames of {meta.get('frame_ms')!r} ms; this server's are "
                            f"{frame_ms:g} ms (--frame-ms)")
    if meta.get("model") != model_name:
        raise ResumeRefused(f"the snapshot is of model {meta.get('model')!r}; this server serves {model_name!r}")
    return meta["seq"], meta["unit"]


@dataclasses.dataclass(frozen=True)
class NativePlan:
    """A native connection's token and lease (None without a store) and, when it resumes, the snapshot and its
    counters."""

    store: SnapshotStore | None
    token: str | None
    lease: Lease | None = None
    snapshot: SessionSnapshot | None = None
    seq: int = 0
    unit: int = 0


async def native_plan(context: ServeContext, token: str | None, duplex: bool) -> NativePlan:
    """Leases a fresh token, or leases, loads and checks the snapshot of `token` (`?resume=`).

    Raises:
        ResumeRefused: the server does not resume, the session is full duplex, the token is malformed, held by
            another connection or has no readable native snapshot; named without server paths, nothing held.
    """
    if duplex:  # never snapshotted, so its connection neither leases a token nor reads the snapshot directory
        if token is not None:
            raise ResumeRefused("full-duplex sessions do not resume (their audio encoder's state is not snapshotted)")
        return NativePlan(None, None)
    leased = await lease_snapshot(context, token, lambda snapshot: restored_counters(
        snapshot, context.options.frame_ms, context.options.model_name))
    seq, unit = leased.checked if leased.checked is not None else (0, 0)
    return NativePlan(leased.store, leased.token, leased.lease, leased.snapshot, seq, unit)
