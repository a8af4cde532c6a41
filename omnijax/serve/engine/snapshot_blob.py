"""One session snapshot as one byte string: how the snapshot store writes a generation to an object store
(`omnijax.serve.realtime.snapshot_store_kv`), as a single object, so that it becomes visible whole or not at all.

Why one object per snapshot and not one per array: an object store makes a single object write atomic (a GCS or S3
PUT, tensorstore's file driver's rename), but offers nothing that makes several objects appear at once; one object per
array would need a commit object written last and readers that ignore arrays without one, and leave orphans to
collect after a kill. A snapshot is held whole on the host anyway (`SessionSnapshot`'s numpy arrays), so the encoding
costs one copy of its bytes. (A single S3 PUT takes up to 5 GB; a session's snapshot is megabytes.)

Layout:

    MAGIC (21 bytes)  header length (8 bytes, little-endian)  header (JSON, UTF-8)  payload

The header is the directory format's manifest (`snapshot_format.manifest_of`: format, format version, spec, meta,
every array's shape and dtype) plus `blob`: each array's `[offset, nbytes]` in the payload, the recall tier's
(`snapshot_tier`'s `.npz` bytes, when the session has one), the payload's length and its CRC-32. Arrays are stored
raw, C order, in their dtype (bfloat16 included). Reading checks the magic, the lengths, the checksum, the manifest
(`read_manifest`: the same format versions as a directory) and the snapshot (`SessionSnapshot.check`), and refuses
anything else by name (`SnapshotFormatError`).
"""

from __future__ import annotations

import io
import json
import zlib

import jax.numpy as jnp
import numpy as np

from omnijax.serve.engine.snapshot_format import (
    ARRAY_FIELDS,
    SessionSnapshot,
    SnapshotError,
    SnapshotFormatError,
    manifest_of,
    read_manifest,
)
from omnijax.serve.engine.snapshot_tier import read_tier, write_tier

MAGIC = b"omnijax-session-blob\n"
_LENGTH = 8


def encode(snapshot: SessionSnapshot) -> bytes:
    """The snapshot as one byte string (module docstring).

    Raises:
        SnapshotError: the snapshot is inconsistent. ValueError: its recall tier has units spilled to disk.
    """
    snapshot.check()
    manifest = manifest_of(snapshot)
    parts, segments, offset = [], {}, 0
    for name, array in snapshot.arrays().items():
        data = np.ascontiguousarray(array).tobytes()
        segments[name] = [offset, len(data)]
        parts.append(data)
        offset += len(data)
    tier = None
    if snapshot.tier is not None:
        buffer = io.BytesIO()
        write_tier(buffer, snapshot.tier)
        data = buffer.getvalue()
        tier = [offset, len(data)]
        parts.append(data)
        offset += len(data)
    payload = b"".join(parts)
    manifest["blob"] = {"arrays": segments, "recall_tier": tier, "payload_bytes": len(payload),
                        "crc32": zlib.crc32(payload)}
    header = json.dumps(manifest, sort_keys=True).encode("utf-8")
    return b"".join([MAGIC, len(header).to_bytes(_LENGTH, "little"), header, payload])


def decode(data: bytes, where: str = "the snapshot object") -> SessionSnapshot:
    """The snapshot `encode` wrote.

    Args:
        data: the object's bytes.
        where: how errors name the object (its URL).

    Raises:
        SnapshotFormatError: not a session snapshot object, truncated or damaged (checksum), another format or
            version, arrays or tier at odds with the manifest; the message names `where` and the cause.
    """
    view = memoryview(data)
    if bytes(view[:len(MAGIC)]) != MAGIC:
        raise SnapshotFormatError(f"{where} is not a session snapshot object (it does not start with {MAGIC!r})")
    start = len(MAGIC) + _LENGTH
    size = int.from_bytes(view[len(MAGIC):start], "little")
    if len(view) < start + size:
        raise SnapshotFormatError(f"{where}: the snapshot object is truncated ({len(view)} bytes, its header alone "
                                  f"needs {start + size})")
    try:
        manifest = json.loads(bytes(view[start:start + size]).decode("utf-8"))
        spec, layout, missing, meta, tier_file = read_manifest(manifest)
        blob = manifest["blob"]
        segments = {n: (int(blob["arrays"][n][0]), int(blob["arrays"][n][1])) for n in ARRAY_FIELDS
                    if n not in missing}
        tier_at = None if blob.get("recall_tier") is None else tuple(int(x) for x in blob["recall_tier"])
        payload_bytes, crc = int(blob["payload_bytes"]), int(blob["crc32"])
    except (UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
        raise SnapshotFormatError(f"{where}: cannot read the snapshot header: {e}") from e
    payload = view[start + size:]
    if len(payload) != payload_bytes:
        raise SnapshotFormatError(f"{where}: the snapshot object holds {len(payload)} payload bytes, its header says "
                                  f"{payload_bytes} (truncated or damaged)")
    if zlib.crc32(payload) != crc:
        raise SnapshotFormatError(f"{where}: the snapshot object's checksum does not match (damaged)")
    arrays = {n: np.zeros(shape, dtype) for n, (shape, dtype) in layout.items() if n in missing}
    for name, (offset, nbytes) in segments.items():
        shape, dtype = layout[name]
        want = int(np.prod(shape, dtype=np.int64)) * jnp.dtype(dtype).itemsize
        if nbytes != want or offset < 0 or offset + nbytes > len(payload):
            raise SnapshotFormatError(f"{where}: array {name} holds {nbytes} bytes at {offset}, expected {want} for "
                                      f"{shape} {jnp.dtype(dtype).name}")
        arrays[name] = np.frombuffer(payload[offset:offset + nbytes], dtype=dtype).reshape(shape).copy()
    if (tier_file is None) != (tier_at is None):
        raise SnapshotFormatError(f"{where}: the manifest and the object disagree on whether a recall tier is held")
    try:
        tier = None if tier_at is None else read_tier(io.BytesIO(bytes(payload[tier_at[0]:tier_at[0] + tier_at[1]])))
    except ValueError as e:
        raise SnapshotFormatError(f"{where}: the snapshot's recall host tier is corrupt: {e}") from e
    try:
        snapshot = SessionSnapshot(**arrays, spec=spec, meta=meta, tier=tier)
        snapshot.check()
    except (TypeError, SnapshotError) as e:
        raise SnapshotFormatError(f"{where}: {e}") from e
    return snapshot
