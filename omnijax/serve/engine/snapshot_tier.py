"""A session snapshot's recall tier on disk (issue 40): the `RecallSnapshot` an engine snapshot of a session with
`StreamConfig(recall=...)` carries (`omnijax.serve.engine.snapshot_format.SessionSnapshot.tier`), written beside the
snapshot's arrays as one `.npz` file (no pickles): every stored unit's keys, values, positions, span kinds, offsets,
write orders, summary and full-context positions, the session's full-context positions and cursor, and the figures.

Reading checks the file's form only (names, dtypes, a JSON header); whether the tier fits the session it comes with
(shapes, write orders, summaries equal to the mean of their keys) is checked when the session resumes
(`omnijax.streaming.recall_session.RecallSession.restore`), which refuses a corrupt tier by name. A tier with units
spilled to disk (`Recall(disk_dir=...)`) is not written yet (refused by name).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import BinaryIO

import jax.numpy as jnp
import numpy as np

from omnijax.kv import host_tier
from omnijax.streaming.recall_session import RecallSnapshot

TIER_FILE = "recall_tier.npz"
_UNIT_FIELDS = ("k", "v", "pos", "span", "offset", "order", "summary", "vpos")
_TIER_COUNTS = ("budget_bytes", "dropped_units", "dropped_bytes", "spilled_units", "spilled_bytes")


def write_tier(path: Path | BinaryIO, snapshot: RecallSnapshot) -> None:
    """Writes `snapshot` to the file `path`, or into a binary file object (ValueError, before writing anything, for
    a tier with spilled units)."""
    tier = snapshot.tier
    if any(u.on_disk for u in tier.units):
        raise ValueError("the snapshot's host tier has units spilled to disk (Recall(disk_dir=...)), which a snapshot "
                         "on disk does not carry yet; keep it in memory")
    header = {"units": [int(u.unit) for u in tier.units], "cursor": int(snapshot.cursor),
              "counts": [[str(k), int(v)] for k, v in snapshot.counts],
              "tier": {name: int(getattr(tier, name)) for name in _TIER_COUNTS},
              "kv_dtype": [jnp.dtype(u.k.dtype).name for u in tier.units]}
    arrays = {"header": np.frombuffer(json.dumps(header).encode("utf-8"), np.uint8), "vpos": np.asarray(snapshot.vpos)}
    for i, u in enumerate(tier.units):
        arrays.update({f"u{i}_{name}": np.asarray(getattr(u, name)) for name in _UNIT_FIELDS
                       if getattr(u, name) is not None})
        for name in ("k", "v"):  # raw bytes: .npz has no bfloat16
            arrays[f"u{i}_{name}"] = np.ascontiguousarray(arrays[f"u{i}_{name}"]).view(np.uint8)
    if not isinstance(path, (str, Path)):  # a file object (`omnijax.serve.engine.snapshot_blob`)
        np.savez(path, **arrays)
        return
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def read_tier(path: Path | BinaryIO) -> RecallSnapshot:
    """Reads a tier written by `write_tier` (a file, or a binary file object); ValueError naming what is missing or
    malformed."""
    try:
        with np.load(path, allow_pickle=False) as z:
            files = {name: np.array(z[name]) for name in z.files}
    # A truncated or damaged .npz raises zipfile.BadZipFile (not a file, or a member's CRC-32 does not match).
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: not a readable recall tier ({type(e).__name__}: {e})") from e
    try:
        header = json.loads(files.pop("header").tobytes().decode("utf-8"))
        units = []
        for i, unit in enumerate(header["units"]):
            fields = {name: files[f"u{i}_{name}"] for name in _UNIT_FIELDS}
            for name in ("k", "v"):
                fields[name] = fields[name].view(jnp.dtype(header["kv_dtype"][i]))
            for name, array in fields.items():
                array.flags.writeable = False
            units.append(host_tier.UnitKV(unit=int(unit), **fields))
        tier = host_tier.HostTier(units=tuple(units), **{k: int(header["tier"][k]) for k in _TIER_COUNTS})
        vpos = files["vpos"]
        vpos.flags.writeable = False
        return RecallSnapshot(tier=tier, vpos=vpos, cursor=int(header["cursor"]),
                              counts=tuple((str(k), int(v)) for k, v in header["counts"]))
    except (KeyError, TypeError, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: the recall tier is malformed ({type(e).__name__}: {e})") from e
