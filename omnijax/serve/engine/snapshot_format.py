"""The session snapshot: what it holds (`SessionSnapshot`, `SnapshotSpec`), the checks it passes, and its form on
disk (`save_snapshot`, `load_snapshot`). `omnijax.serve.engine.snapshot` copies snapshots out of and into the rows of
a batched `StreamState` (and re-exports every name here).

A `SessionSnapshot` holds one row of the state as host numpy arrays: the contents of the pages its page-table row
names (in table order, with the table position of each, so the restored row has the same logical layout), the row's
page-table bookkeeping, its position cursor, sampling key and last logits, the facts of the pool and model it was
taken from (`SnapshotSpec`), and free-form JSON metadata (`meta`) for the caller (conversation items, counters).

Shapes (L layers, E saved pages, P page size, G kv heads, d head dim, A position axes, V vocabulary):

    entries     [E] int32             page-table position of each saved page (ascending)
    k, v        [L, E, P, G, d]       keys (post-RoPE) and values, in the pool's dtype (int8 codes for an int8 pool)
    k_scale, v_scale [L, E, P, G]     float32 scales of an int8 pool (`omnijax.kv.quant_kv.QuantPages`); [0] else
    valid       [E, P] bool           and pos [A, E, P], order, unit, span, offset, score [E, P], page_class [E]
    seq_slots, next_order, dropped, next_pos   [] int32;   exhausted [] bool
    key         [2] uint32            sampling key data
    last_logits [V] float32
    counts      [V] int32             the answer's token counts, and seen [V] bool, the tokens the session wrote
                                      (`StreamState.counts` / `seen`: the history per-row penalties read)

On disk a snapshot is a directory: `session.json` (format, spec, meta, the shape and dtype of every array) and
`arrays/`, an orbax checkpoint of the non-empty arrays. In an object store it is one object of the same manifest and
the raw arrays (`omnijax.serve.engine.snapshot_blob`, read and checked by the same `read_manifest` and
`SessionSnapshot.check`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from omnijax.kv.quant_kv import QuantPages
from omnijax.serve.engine.snapshot_paths import local_path
from omnijax.serve.engine.snapshot_tier import TIER_FILE, read_tier, write_tier
from omnijax.streaming.step import StreamState

FORMAT = "omnijax-session"
FORMAT_VERSION = 3  # 2 added `counts` and `seen` (a version-1 snapshot loads with both empty: no penalty history);
# 3 added int8 pools (`SnapshotSpec.kv_dtype`, `k_scale` / `v_scale`; an older snapshot is of a float pool)
READABLE_VERSIONS = (1, 2, 3)
MANIFEST = "session.json"
ARRAYS_DIR = "arrays"

# Pool fields saved per page, with their page axis.
PAGE_AXES = {"k": 1, "v": 1, "valid": 0, "pos": 1, "order": 0, "unit": 0, "span": 0, "offset": 0, "score": 0,
             "page_class": 0}
KV_ROW_FIELDS = ("seq_slots", "next_order", "exhausted", "dropped")  # per-row fields of `PagedKV`
STATE_ROW_FIELDS = ("next_pos", "key", "last_logits", "counts", "seen")  # per-row fields of `StreamState`
SCALE_FIELDS = {"k_scale": "k", "v_scale": "v"}  # an int8 pool's per-token scales (page axis 1), of its k and v
ARRAY_FIELDS = ("entries",) + tuple(PAGE_AXES) + KV_ROW_FIELDS + STATE_ROW_FIELDS + tuple(SCALE_FIELDS)
# The largest counter (positions, tokens written, units) a snapshot may hold: far beyond any real session, far enough
# below the int32 limit that the session can go on counting; a larger one is a damaged or tampered snapshot.
COUNTER_LIMIT = 2 ** 30


class SnapshotError(ValueError):
    """Base of the snapshot errors (a `ValueError`)."""


class SnapshotMismatch(SnapshotError):
    """The snapshot was taken from a pool or model of another shape (page size, layers, heads, dtype, ...)."""


class NotEnoughPages(SnapshotError):
    """The pool has too few free pages for the snapshot, or the target's page-table row is too narrow."""


class SnapshotFormatError(SnapshotError):
    """A path does not hold a readable session snapshot."""


@dataclasses.dataclass(frozen=True)
class SnapshotSpec:
    """The facts of the pool and model a snapshot was taken from; a restore target must match every one."""

    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    position_axes: int
    vocab_size: int
    dtype: str
    kv_dtype: str = "float"  # the pool's storage (`StreamConfig.kv_dtype`): "float" (`dtype`) or "int8"

    @classmethod
    def of_state(cls, state: StreamState) -> "SnapshotSpec":
        """The spec of a batched state (its pool's shape and dtype, its logits' vocabulary)."""
        kv = state.kv
        L, _, P, G, d = kv.k.shape
        return cls(page_size=int(P), num_layers=int(L), num_kv_heads=int(G), head_dim=int(d),
                   position_axes=int(kv.pos.shape[0]), vocab_size=int(state.last_logits.shape[-1]),
                   dtype=jnp.dtype(kv.k.dtype).name, kv_dtype="int8" if isinstance(kv.k, QuantPages) else "float")

    def mismatches(self, target: "SnapshotSpec") -> list[str]:
        """`"<field> <snapshot's> (target: <target's>)"` for every field that differs."""
        return [f"{f.name} {getattr(self, f.name)} (target: {getattr(target, f.name)})"
                for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(target, f.name)]


def _page_shape(spec: SnapshotSpec, name: str, count: int) -> tuple[int, ...]:
    """Expected shape of a page field of `count` saved pages."""
    L, P, G, d, A = spec.num_layers, spec.page_size, spec.num_kv_heads, spec.head_dim, spec.position_axes
    scales = (L, count, P, G) if spec.kv_dtype == "int8" else (0,)
    return {"k": (L, count, P, G, d), "v": (L, count, P, G, d), "pos": (A, count, P), "page_class": (count,),
            "k_scale": scales, "v_scale": scales}.get(name, (count, P))


@dataclasses.dataclass(frozen=True, eq=False)
class SessionSnapshot:
    """One session's state as host numpy arrays (module docstring: fields and shapes); a pytree whose leaves are
    the arrays of `ARRAY_FIELDS` (`spec` and `meta` are static).

    Attributes:
        spec: the pool and model facts the snapshot was taken from.
        meta: free-form JSON data (copied through JSON on construction: tuples come back as lists, keys as strings).
    """

    entries: np.ndarray
    k: np.ndarray
    v: np.ndarray
    valid: np.ndarray
    pos: np.ndarray
    order: np.ndarray
    unit: np.ndarray
    span: np.ndarray
    offset: np.ndarray
    score: np.ndarray
    page_class: np.ndarray
    seq_slots: np.ndarray
    next_order: np.ndarray
    exhausted: np.ndarray
    dropped: np.ndarray
    next_pos: np.ndarray
    key: np.ndarray
    last_logits: np.ndarray
    spec: SnapshotSpec
    meta: dict = dataclasses.field(default_factory=dict)
    counts: np.ndarray | None = None  # None: empty (zeros of the spec's vocabulary)
    seen: np.ndarray | None = None
    k_scale: np.ndarray | None = None  # None: none (a float pool's snapshot)
    v_scale: np.ndarray | None = None
    # the session's recall side (`omnijax.streaming.recall_session.RecallSnapshot`: its host tier) when the engine
    # has StreamConfig(recall=...); written beside the arrays (`omnijax.serve.engine.snapshot_tier`)
    tier: Any = None

    def __post_init__(self):
        object.__setattr__(self, "meta", json.loads(_meta_json(self.meta)))
        V = self.spec.vocab_size
        if self.counts is None:
            object.__setattr__(self, "counts", np.zeros((V,), np.int32))
        if self.seen is None:
            object.__setattr__(self, "seen", np.zeros((V,), bool))
        for name in SCALE_FIELDS:
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.zeros((0,), np.float32))

    @property
    def num_pages(self) -> int:
        """Pages the snapshot holds (E): the free pages a restore takes."""
        return int(np.shape(self.entries)[0])

    @property
    def table_width(self) -> int:
        """The narrowest page-table row that holds the snapshot's layout (last entry + 1)."""
        return int(np.max(self.entries)) + 1 if self.num_pages else 0

    def arrays(self) -> dict[str, np.ndarray]:
        """The array fields by name."""
        return {name: getattr(self, name) for name in ARRAY_FIELDS}

    def check(self) -> None:
        """Refuses a snapshot whose arrays do not agree with each other and with its spec (`SnapshotError`)."""
        spec, E = self.spec, self.num_pages
        want = {name: _page_shape(spec, name, E) for name in tuple(PAGE_AXES) + tuple(SCALE_FIELDS)}
        want.update(entries=(E,), last_logits=(spec.vocab_size,), counts=(spec.vocab_size,), seen=(spec.vocab_size,),
                    **{name: () for name in KV_ROW_FIELDS + ("next_pos",)})
        bad = [f"{n} {tuple(np.shape(getattr(self, n)))} (expected {w})" for n, w in want.items()
               if tuple(np.shape(getattr(self, n))) != w]
        if np.ndim(self.key) != 1:
            bad.append(f"key {tuple(np.shape(self.key))} (expected one row of key data)")
        if spec.kv_dtype not in ("float", "int8"):
            bad.append(f"kv_dtype {spec.kv_dtype!r} (expected 'float' or 'int8')")
        stored = "int8" if spec.kv_dtype == "int8" else spec.dtype
        for name in ("k", "v"):
            if jnp.dtype(getattr(self, name).dtype).name != stored:
                bad.append(f"{name} dtype {getattr(self, name).dtype} (spec: {stored})")
        for name in SCALE_FIELDS:
            if jnp.dtype(getattr(self, name).dtype).name != "float32":
                bad.append(f"{name} dtype {getattr(self, name).dtype} (expected float32)")
        if bad:
            raise SnapshotError("inconsistent session snapshot: " + "; ".join(bad))
        entries = np.asarray(self.entries)
        if E and (entries[0] < 0 or np.any(np.diff(entries) <= 0)):
            raise SnapshotError(f"snapshot page-table entries must be distinct, ascending and >= 0, got {entries}")
        self._check_counters()

    def _check_counters(self) -> None:
        """Refuses counters out of range (`COUNTER_LIMIT`) or at odds with the pages held (`SnapshotError`)."""
        bad = [f"{name} {int(getattr(self, name))}" for name in ("seq_slots", "next_order", "dropped", "next_pos")
               if not 0 <= int(getattr(self, name)) <= COUNTER_LIMIT]
        valid = np.asarray(self.valid, bool)
        for name in ("unit", "order"):
            held = np.asarray(getattr(self, name))[valid]
            if held.size and not (held.min() >= -1 and held.max() <= COUNTER_LIMIT):  # -1: the pool's "none"
                bad.append(f"{name} of the held tokens in [{held.min()}, {held.max()}]")
        counts = np.asarray(self.counts)
        if counts.size and not (counts.min() >= 0 and counts.max() <= COUNTER_LIMIT):
            bad.append(f"counts in [{counts.min()}, {counts.max()}]")
        if bad:
            raise SnapshotError(f"session snapshot counters out of range [0, {COUNTER_LIMIT}]: " + "; ".join(bad))
        held_entries = -(-int(self.seq_slots) // self.spec.page_size)
        if self.table_width > held_entries:
            raise SnapshotError(f"the snapshot's pages sit at page-table entries up to {self.table_width - 1}, but its "
                                f"seq_slots {int(self.seq_slots)} holds only {held_entries} entries")


def _meta_json(meta) -> str:
    if not isinstance(meta, dict):
        raise TypeError(f"snapshot meta must be a dict of JSON data, got {type(meta).__name__}")
    try:
        return json.dumps(meta, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise TypeError(f"snapshot meta must be JSON-serialisable: {e}") from e


def _flatten(snapshot: SessionSnapshot):
    children = tuple((jax.tree_util.GetAttrKey(n), getattr(snapshot, n)) for n in ARRAY_FIELDS)
    return children, (snapshot.spec, _meta_json(snapshot.meta), _Opaque(snapshot.tier))  # hashable static data


class _Opaque:
    """A static pytree field held by identity (the recall tier: immutable, not hashable by value)."""

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Opaque) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


def _unflatten(aux, children) -> SessionSnapshot:
    spec, meta, tier = aux
    return SessionSnapshot(**dict(zip(ARRAY_FIELDS, children)), spec=spec, meta=json.loads(meta), tier=tier.value)


jax.tree_util.register_pytree_with_keys(SessionSnapshot, _flatten, _unflatten)


# ------------------------------------------------------------------------------------------------------- disk
def manifest_of(snapshot: SessionSnapshot) -> dict:
    """The manifest of a snapshot (`session.json` of a directory; the header of `snapshot_blob`): format, version,
    spec, meta, the shape and dtype of every array, and whether a recall tier comes with it."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "spec": dataclasses.asdict(snapshot.spec),
            "meta": snapshot.meta, **({} if snapshot.tier is None else {"recall_tier": TIER_FILE}),
            "arrays": {n: {"shape": list(a.shape), "dtype": jnp.dtype(a.dtype).name}
                       for n, a in snapshot.arrays().items()}}


def read_manifest(manifest: Any) -> tuple[SnapshotSpec, dict[str, tuple[tuple[int, ...], Any]], tuple[str, ...],
                                          dict, str | None]:
    """`(spec, layout, missing, meta, tier_file)` of a manifest: `layout` maps every array field to its shape and
    dtype, `missing` names the fields an older version did not store (empty when read).

    Raises:
        ValueError, TypeError, KeyError, AttributeError: not this format, a version not readable, a field malformed.
    """
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"format is not {FORMAT!r}")
    version = manifest.get("format_version")
    if version not in READABLE_VERSIONS:
        raise ValueError(f"format_version {version!r} is not one of {READABLE_VERSIONS}")
    spec = SnapshotSpec(**manifest["spec"])
    fields = dict(manifest["arrays"])
    if version == 1:  # before the penalty history: empty, as a session that never wrote a token has it
        V = spec.vocab_size
        fields.update(counts={"shape": [V], "dtype": "int32"}, seen={"shape": [V], "dtype": "bool"})
    if version < 3:  # before int8 pools: a float pool's snapshot, no scales
        fields.update({n: {"shape": [0], "dtype": "float32"} for n in SCALE_FIELDS})
    layout = {n: (tuple(int(x) for x in fields[n]["shape"]), jnp.dtype(fields[n]["dtype"])) for n in ARRAY_FIELDS}
    missing = (("counts", "seen") if version == 1 else ()) + (tuple(SCALE_FIELDS) if version < 3 else ())
    return spec, layout, missing, manifest.get("meta", {}), manifest.get("recall_tier")


def _is_snapshot_dir(path: Path) -> bool:
    try:
        return json.loads((path / MANIFEST).read_text(encoding="utf-8")).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def save_snapshot(path: str | os.PathLike, snapshot: SessionSnapshot, *, overwrite: bool = False) -> Path:
    """Writes a snapshot to the directory `path` atomically: into a temporary directory beside it, then renamed.

    Every file is synced to disk before the rename, and the parent after it: once this returns, the snapshot
    survives a crash. `path` never holds a partial snapshot; when overwriting, the old one is moved aside first, so
    `path` is briefly absent between the two renames (a concurrent `load_snapshot` then sees nothing, never a mix).
    A writer that must never be without a snapshot writes each one to a new path instead and deletes the older ones
    afterwards, as `omnijax.serve.realtime.snapshot_store` does.

    Args:
        path: the snapshot directory (its parent is created when missing).
        snapshot: the session.
        overwrite: replace an existing snapshot at `path` (anything else there is never replaced).

    Returns:
        The absolute path written.

    Raises:
        FileExistsError: `path` exists and `overwrite` is False, or it exists and is not a session snapshot.
        SnapshotError: the snapshot is inconsistent.
        ValueError: `path` is a URL (`gs://...`): a snapshot directory is a local path (`snapshot_paths.local_path`;
            the snapshot store writes object-store URLs as one object per snapshot, `snapshot_blob`).
    """
    snapshot.check()
    if snapshot.tier is not None and any(u.on_disk for u in snapshot.tier.tier.units):
        raise ValueError("the snapshot's host tier has units spilled to disk (Recall(disk_dir=...)), which a snapshot "
                         "on disk does not carry yet; keep it in memory")
    path = local_path(path)
    if path.exists() or path.is_symlink():
        if not overwrite:
            raise FileExistsError(f"{path} already exists; pass overwrite=True to replace the snapshot there")
        if not path.is_dir() or path.is_symlink() or not _is_snapshot_dir(path):
            raise FileExistsError(f"{path} exists and is not a session snapshot; refusing to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = snapshot.arrays()
    manifest = manifest_of(snapshot)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        stored = {n: np.asarray(a) for n, a in arrays.items() if a.size}  # orbax refuses zero-size arrays
        with _ORBAX_LOCK, ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp / ARRAYS_DIR, stored)
            checkpointer.wait_until_finished()
        if snapshot.tier is not None:  # the recall side (`omnijax.serve.engine.snapshot_tier`)
            write_tier(tmp / TIER_FILE, snapshot.tier)
        with open(tmp / MANIFEST, "w", encoding="utf-8") as f:
            f.write(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        _fsync_tree(tmp)  # every file and folder on disk before the rename makes the snapshot visible
        if path.exists():  # overwrite: move the old one aside, put the new one in place, then delete the old one
            old = path.parent / f".{path.name}.{uuid.uuid4().hex}.old"
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
        _fsync(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


# orbax's StandardCheckpointer is not safe to run from several threads at once (two sessions' writes at the same
# moment, as a busy server's periodic snapshots are, failed with 'Directory not empty', FileExistsError on its tmp
# folder, missing arrays, or hung): every checkpointer of this module runs under this process-wide lock.
_ORBAX_LOCK = threading.Lock()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Syncs every file and folder under `root` (and `root`) to disk."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            _fsync(Path(folder) / name)
        _fsync(Path(folder))


def load_snapshot(path: str | os.PathLike) -> SessionSnapshot:
    """Reads a snapshot written by `save_snapshot`.

    Raises:
        FileNotFoundError: nothing at `path`.
        ValueError: `path` is a URL (`snapshot_paths.local_path`).
        SnapshotFormatError: `path` is not a readable session snapshot (no or garbled manifest, another format or
            version, missing or damaged arrays); the message names the path.
    """
    path = local_path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no session snapshot there (the path does not exist)")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise SnapshotFormatError(f"{path} is not a session snapshot: {MANIFEST} is missing")
    try:
        spec, layout, missing, meta, tier_file = read_manifest(json.loads(manifest_path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise SnapshotFormatError(f"{manifest_path}: cannot read the snapshot manifest: {e}") from e
    arrays = {n: np.zeros(shape, dtype) for n, (shape, dtype) in layout.items()
              if not int(np.prod(shape)) or n in missing}
    stored = [n for n in ARRAY_FIELDS if n not in arrays]
    arrays_path = path / ARRAYS_DIR
    try:
        with _ORBAX_LOCK, ocp.StandardCheckpointer() as checkpointer:
            found = checkpointer.metadata(arrays_path).item_metadata.tree
            problems = [f"{n}: stored {_describe(found.get(n))}, expected {layout[n][0]} {layout[n][1].name}"
                        for n in stored if _describe(found.get(n)) != f"{layout[n][0]} {layout[n][1].name}"]
            if problems:
                raise ValueError("; ".join(problems))
            restored = checkpointer.restore(arrays_path)
        arrays.update({n: np.asarray(restored[n]) for n in stored})
    except Exception as e:  # orbax and TensorStore raise many types for missing or damaged files
        raise SnapshotFormatError(f"{arrays_path}: cannot read the snapshot's arrays ({_brief(e)})") from e
    try:
        tier = None if tier_file is None else read_tier(path / TIER_FILE)
    except ValueError as e:
        raise SnapshotFormatError(f"{path}: the snapshot's recall host tier is missing or corrupt: {e}") from e
    try:
        snapshot = SessionSnapshot(**arrays, spec=spec, meta=meta, tier=tier)
        snapshot.check()
    except (TypeError, SnapshotError) as e:
        raise SnapshotFormatError(f"{path}: {e}") from e
    return snapshot


def _describe(leaf: Any) -> str:
    if leaf is None or not hasattr(leaf, "shape"):
        return "nothing"
    return f"{tuple(leaf.shape)} {jnp.dtype(leaf.dtype).name}"


def _brief(error: BaseException) -> str:
    """Type and first line of an error, at most 200 characters (TensorStore's messages run long)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}"[:200]
