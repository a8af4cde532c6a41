"""Putting units from the host tier (`omnijax.kv.host_tier`) back into the device cache (issue 40, first piece).

A stored unit's keys are rotated at the positions they had when it was evicted. Recalled, the unit takes new
positions consistent with the cache's current indexing, and its keys are re-rotated by the position delta exactly as
the re-indexing of `omnijax.retention.base.apply` re-rotates survivors: `rope_angles` of the (signed) delta, applied
by `apply_rope`, angles in float32. Rotations compose additively per frequency, so a key rotated at p and re-rotated
by q - p equals the raw key rotated at q (per axis for mrope: each frequency reads one axis).

Placement (`recall_positions`): the recalled units are laid after the position cursor, oldest unit first, each
shifted uniformly on every axis so its lowest position lands on the cursor; the cursor then moves past its highest.
A uniform shift keeps a TMRoPE unit's internal t/h/w geometry and audio-video alignment, like the re-indexing rule.
A policy that never re-indexes (SinkWindow: positions keep growing) leaves every evicted unit's own positions free and
consistent with the current indexing, so with `Recall(placement="own")` (the default) its units come back there
(`at_original=True`): no re-rotation at all, and the question then sees exactly the keys a full-context cache holds.
`placement="compact"` (`Recall.preset`'s) re-lays them next to the cache as for a re-indexing policy instead.

`Recall` is the setting `omnijax.StreamConfig(recall=...)` takes (what `omnijax.Session` does with it:
`omnijax.streaming.recall_session`).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from omnijax.kept_executables import cached_jit
from omnijax.kv import rope as rope_lib
from omnijax.kv.host_tier import UnitKV
from omnijax.kv.host_tier_scoring import RECALL_SCORINGS
from omnijax.kv.paged import PagedKV, SlotMeta, append
from omnijax.retention.base import RetentionPolicy


@dataclasses.dataclass(frozen=True)
class Recall:
    """Question-time recall of evicted units from a host tier (`StreamConfig(recall=Recall(...))`).

    Attributes:
        budget: most cache cells recalled at one question (> 0; at most the pool's cells).
        top_units: most stored units recalled at one question (> 0).
        host_bytes: host memory budget of the tier (> 0): the oldest stored units are dropped (and reported) beyond it.
        keep: what happens to recalled units after the answer. False (default): they are released (invalidated in
            the cache) and stay in the tier; True: they stay in the cache as ordinary content, leave the tier, and
            are stored again if the policy evicts them later.
        scoring: how stored units are ranked against the question: "mass" (default;
            `omnijax.kv.host_tier_scoring.score_units_mass`, the position-free attention mass a unit would draw),
            "max" (each head's strongest logit over a unit's tokens) or "mean" (the mean logit, from the per-unit
            summaries alone) (`omnijax.kv.host_tier_scoring.score_units`), "peak" (the strongest preference
            any one head shows for the unit over the average stored unit, `score_units_peak`: the heads that read
            one sentence strongly decide, not the many that read the stream's opening a little more than the rest),
            or "two_stage": "mean" picks `shortlist`
            units from the summaries, "mass" ranks them, the rest are never recalled
            (`omnijax.kv.host_tier_two_stage.score_units_two_stage`; with a shortlist covering the whole tier it
            ranks exactly as "mass").
        shortlist: units "two_stage" reads the keys of (> 0; unused by the other scorings, refused with them
            unless left at its default).
        disk_dir: a directory to spill to (`omnijax.kv.host_tier_disk`): when the host budget is full the oldest
            units' keys and values move to files there (the session's own subdirectory) instead of being dropped,
            and are recalled from there. None (default): no disk tier, the oldest units are dropped. A directory
            that cannot be created or written is refused by name when the session starts.
        disk_bytes: most bytes of spilled keys and values (> 0 with `disk_dir`; 0 without): the oldest spilled units
            are dropped (and reported) beyond it.
        block: most tokens per stored record (> 0), or None (default): one record per unit (or per piece of a unit
            evicted in several steps). With a block size, every evicted unit is cut into blocks on the grid of
            write orders (`omnijax.kv.host_tier.split_blocks`) that are stored, scored and recalled each on its own,
            so a question brings back the part of a long unit that draws its attention rather than the whole unit
            (`budget` then counts the blocks' cells, `top_units` the blocks).
        window: records scored and recalled together (> 0; default 1, each record alone). With `window=W` the
            question scores, for every stored record, the run of up to W records that follow one another token by
            token from it (`omnijax.kv.host_tier_scoring.window_members`: their attention mass summed), and
            recalls the best windows' records (`select_windows`; `top_units` still counts records). With
            `block=B` a window of 2 is a 2B-token record at a B-token stride: a sentence the block grid cuts comes
            back whole at the cost of one more block. "mass" and "peak" scoring only. Windows are ranked by what
            each adds (`omnijax.kv.host_tier_scoring.rank_windows_marginal`): a window overlapping a better one
            scores by its records not taken yet.
        placement: where a policy that never re-indexes (`reindex = False`: SinkWindow) lays recalled units.
            "own" (default): at their own positions (no re-rotation; the question reads them at their full-context
            distance). "compact": re-laid as for a re-indexing policy (`omnijax.streaming.recall_session`,
            Placement): the positions nothing cached or recalled covers are closed up, the cached tokens' keys
            re-rotated, so the question reads the recalled units at the distance a re-indexing policy gives them;
            the release's re-indexing closes their positions again, so the cache stays compacted afterwards.
            Re-indexing policies always re-lay (the setting changes nothing for them). Recalling everything equals
            the full context either way.
    """

    budget: int
    top_units: int = 8
    host_bytes: int = 1 << 30
    keep: bool = False
    scoring: str = "mass"
    shortlist: int = 16
    disk_dir: str | None = None
    disk_bytes: int = 0
    block: int | None = None
    window: int = 1
    placement: str = "own"

    def __post_init__(self):
        for name in ("budget", "top_units", "host_bytes", "shortlist"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
                raise ValueError(f"Recall: {name} must be a positive int, got {value!r}" + (
                    " (a host tier of zero bytes cannot store what recall brings back)" if name == "host_bytes"
                    else ""))
        if self.block is not None and (isinstance(self.block, bool) or not isinstance(self.block, numbers.Integral)
                                       or self.block <= 0):
            raise ValueError(f"Recall: block must be a positive int (tokens per stored record) or None (whole "
                             f"units), got {self.block!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, numbers.Integral) or self.window <= 0:
            raise ValueError(f"Recall: window must be a positive int (records scored together), got "
                             f"{self.window!r}")
        if self.window > 1 and self.scoring not in ("mass", "peak"):
            raise ValueError(f"Recall: window={self.window} sums the attention mass of neighbouring records, which "
                             f"scoring 'mass' and 'peak' compute; got scoring={self.scoring!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"Recall: placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if not isinstance(self.keep, bool):
            raise ValueError(f"Recall: keep must be a bool, got {self.keep!r}")
        if self.scoring not in RECALL_SCORINGS:
            raise ValueError(f"Recall: scoring must be one of {RECALL_SCORINGS}, got {self.scoring!r}")
        if self.disk_dir is not None and (not isinstance(self.disk_dir, str) or not self.disk_dir):
            raise ValueError(f"Recall: disk_dir must be a directory path (str) or None, got {self.disk_dir!r}")
        if isinstance(self.disk_bytes, bool) or not isinstance(self.disk_bytes, numbers.Integral) or \
                self.disk_bytes < 0 or (self.disk_dir is None) != (self.disk_bytes == 0):
            raise ValueError(f"Recall: disk_bytes must be a positive int with disk_dir and 0 without, got "
                             f"disk_bytes={self.disk_bytes!r}, disk_dir={self.disk_dir!r}")
        if self.scoring != "two_stage" and self.shortlist != 16:
            raise ValueError(f"Recall: shortlist={self.shortlist} is read by scoring='two_stage' only, got "
                             f"scoring={self.scoring!r}")

    @classmethod
    def preset(cls, budget: int = 64, **fields: Any) -> "Recall":
        """The recommended setting: `budget` cells (default 64) recalled as 16-token blocks scored in windows of two
        by "peak" and laid next to the cache (`PRESET`), other `fields` as given (e.g. `host_bytes`, `keep`).

        Measured on SmolLM2-135M (`bench/quality/RESULTS.md`, "Recall of evicted units"): with 128 device cells + 64
        recalled, SinkWindow, StreamingLLM and OmniPick answer the multi-turn and the single-prompt pass key at the
        full context's accuracy or better, the issue's goal, at 15-22 % of the context's cells at 1K tokens
        (`recall_marginal_1k.json`) and at 7-10 % at 2K (`recall_preset_2k.json`). Why these fields: whole units
        ("mass") cost a unit's every cell and missed the single prompt; 32-token blocks missed the single prompt and
        16-token blocks the multi-turn one under OmniPick, each where the block grid cut the key sentence, which
        windows of two blocks bring back whole; windows ranked whole spent the 2K budget on overlapping pairs (they
        are ranked by what each adds); at its own positions (`placement="own"`) SinkWindow missed the 2K multi-turn
        prompt, the number recalled ~1,900 positions behind the question."""
        return cls(budget=budget, **{**PRESET, **fields})

    def at_own_positions(self, policy: RetentionPolicy) -> bool:
        """Whether units recalled under `policy` come back at their own positions (`placement`)."""
        return self.placement == "own" and not policy.reindex

    def check_pool(self, cells: int) -> None:
        """Refuses a recall budget larger than a pool of `cells` cells."""
        if self.budget > cells:
            raise ValueError(f"Recall: budget ({self.budget} cells) is larger than the KV pool ({cells} cells: "
                             f"num_pages x page_size); lower Recall(budget=...) or give more num_pages")


PLACEMENTS = ("own", "compact")
"""What `Recall(placement=...)` takes."""
PRESET = {"block": 16, "window": 2, "scoring": "peak", "placement": "compact"}
"""`Recall.preset`'s fields beside its budget (`omnijax serve --recall preset`)."""

_RECALL_FIELDS = {"budget": int, "top_units": int, "host_bytes": int, "keep": bool, "scoring": str, "shortlist": int,
                  "disk_dir": str, "disk_bytes": int, "block": int, "window": int,
                  "placement": str}


def parse_recall(spec: str) -> Recall:
    """`key=value,...` -> `Recall` (the command lines' `--recall`: `omnijax serve`, the eval harnesses), e.g.
    `"budget=2048,top_units=8,scoring=two_stage,shortlist=16"`; `keep` takes true / false. The word `preset` starts
    from `Recall.preset` (budget 64 unless given; `"preset,budget=128"`). An unknown key or a bad value is refused
    naming it."""
    fields: dict[str, Any] = {}
    parts = [p for p in spec.split(",") if p]
    if "preset" in parts:
        parts.remove("preset")
        fields.update(PRESET, budget=64)
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq or key not in _RECALL_FIELDS:
            raise ValueError(f"--recall: {part!r} is not key=value with a key among {sorted(_RECALL_FIELDS)}")
        kind = _RECALL_FIELDS[key]
        if kind is bool:
            if value.lower() not in ("true", "false"):
                raise ValueError(f"--recall: keep must be true or false, got {value!r}")
            fields[key] = value.lower() == "true"
        elif kind is int:
            if not value.isdigit():
                raise ValueError(f"--recall: {key} must be a non-negative integer, got {value!r}")
            fields[key] = int(value)
        else:
            fields[key] = value
    if "budget" not in fields:
        raise ValueError("--recall needs budget=CELLS (the most cache cells recalled at one question)")
    return Recall(**fields)


def rerotate(k: jnp.ndarray, from_pos: jnp.ndarray, to_pos: jnp.ndarray, *, theta: float | rope_lib.ScaledTheta,
             mrope_section: tuple[int, int, int] | None, interleaved: bool = False) -> jnp.ndarray:
    """Keys rotated at `from_pos`, re-rotated to `to_pos`.

    Args:
        k: `[L, G, n, d]` keys (a unit's `UnitKV.k`).
        from_pos, to_pos: `[A, n]` positions (A = 1, or 3 for mrope; a 1-axis array drives every axis).
        theta, mrope_section, interleaved: the model's RoPE (as `rope_lib.rope_angles` takes them).

    Returns:
        `[L, G, n, d]` keys in `k`'s dtype.
    """
    from_pos, to_pos = jnp.asarray(from_pos), jnp.asarray(to_pos)
    if from_pos.ndim != 2 or to_pos.ndim != 2 or from_pos.shape[1] != k.shape[2] or to_pos.shape[1] != k.shape[2]:
        raise ValueError(f"from_pos and to_pos must be [A, n={k.shape[2]}], got {from_pos.shape} and {to_pos.shape}")
    delta = to_pos.astype(jnp.int32) - from_pos.astype(jnp.int32)  # [A, n], broadcast where one has 1 axis
    angles = rope_lib.rope_angles(delta, k.shape[-1], theta, mrope_section, interleaved)  # [n, d/2]
    turned = rope_lib.apply_rope(jnp.swapaxes(jnp.asarray(k), 1, 2), angles)  # [L, n, G, d]
    return jnp.swapaxes(turned, 1, 2)


def recall_positions(units: Sequence[UnitKV], cursor: int) -> tuple[list[np.ndarray], int]:
    """`(new positions [A, n] per unit, new cursor)`: the units laid after `cursor` in the given order, each shifted
    uniformly so its lowest position value lands on the cursor, the cursor moving past its highest (module
    docstring)."""
    out = []
    for u in units:
        lo, hi = int(u.pos.min()), int(u.pos.max())
        out.append((u.pos.astype(np.int64) + (cursor - lo)).astype(np.int32))
        cursor += hi - lo + 1
    return out, cursor


def recall_into(kv: PagedKV, units: Sequence[UnitKV], next_pos: jnp.ndarray, *, seq: int = 0,
                rope: tuple[float | rope_lib.ScaledTheta, tuple[int, int, int] | None], interleaved: bool = False,
                at_original: bool = False, positions: Sequence[np.ndarray] | None = None,
                cursor: int | None = None, donate: bool = False) -> tuple[PagedKV, jnp.ndarray]:
    """Writes `units` into sequence `seq` of the cache at `recall_positions(units, next_pos[seq])`, keys re-rotated
    (or, with `at_original`, at their stored positions, keys as stored and the cursor unchanged: for a policy that
    never re-indexes, module docstring).

    The tokens are appended (`omnijax.kv.paged.append`: open slots first, then free pages) with fresh write orders,
    so everything written later sees them; their unit ids, span kinds and offsets are the stored ones. A unit that
    finds no room is dropped by `append`'s own rule (`kv.exhausted`, `kv.dropped`), never silently: check those.

    Args:
        kv: the cache.
        units: records from `HostTier.take`, in the order to lay them.
        next_pos: `[B]` position cursors.
        seq: the sequence to recall into.
        rope: `(theta, mrope_section)` of the model, as `omnijax.retention.base.apply` takes it.
        interleaved: Qwen3-Omni's interleaved mrope.
        at_original: lay the units at their stored positions (see above).
        positions, cursor: lay unit i at `positions[i]` (`[A, n]`, keys re-rotated to them) and set the cursor to
            `cursor` instead (both or neither; a caller that re-lays the whole sequence,
            `omnijax.streaming.recall_session`).
        donate: `kv` is donated and written in place (its pages are not copied; do not use it afterwards).

    Returns:
        `(kv, next_pos)` with `next_pos[seq]` past the recalled units.
    """
    if not units:
        return kv, next_pos
    if not 0 <= seq < kv.batch:
        raise ValueError(f"seq must lie in [0, {kv.batch}), got {seq}")
    A = kv.pos.shape[0]
    for u in units:
        if u.pos.shape[0] != A or u.k.shape[0] != kv.k.shape[0] or u.k.shape[1] != kv.k.shape[3] or \
                u.k.shape[3] != kv.k.shape[4]:
            raise ValueError(f"unit {u.unit}: k {u.k.shape} / pos {u.pos.shape} do not fit the cache's "
                             f"[L, G, n, d] = {kv.k.shape[0], kv.k.shape[3], '*', kv.k.shape[4]} with {A} axes")
    if (positions is None) != (cursor is None) or (positions is not None and at_original):
        raise ValueError("recall_into: give positions and cursor together, and not with at_original")
    if positions is not None:
        if len(positions) != len(units) or any(np.shape(p) != u.pos.shape for p, u in zip(positions, units)):
            raise ValueError("recall_into: positions must hold one [A, n] array per unit, shaped like its pos")
        new_pos = [np.asarray(p, np.int32) for p in positions]
    elif at_original:
        new_pos, cursor = [u.pos for u in units], int(next_pos[seq])
    else:
        new_pos, cursor = recall_positions(units, int(next_pos[seq]))
    # Host arrays padded to a power of two of tokens: one compiled write per size bucket, whatever the units' sizes.
    T = sum(u.size for u in units)
    pad = 1 << max(0, (T - 1).bit_length())

    def cat(parts, axis):
        x = np.concatenate(parts, axis=axis)
        return np.pad(x, [(0, pad - T) if a == axis % x.ndim else (0, 0) for a in range(x.ndim)])

    write = _write_in_place if donate else _write
    kv = write(kv, cat([u.k for u in units], 2), cat([u.v for u in units], 2), cat([u.pos for u in units], 1),
               cat(new_pos, 1), cat([np.full(u.size, u.unit, np.int32) for u in units], 0),
               cat([u.span for u in units], 0), cat([u.offset for u in units], 0), np.arange(pad) < T,
               jnp.int32(seq), rope=(rope[0], rope[1], interleaved), turn=not at_original)
    return kv, jnp.asarray(next_pos).at[seq].set(cursor)


def warm_writes(kv: PagedKV, max_tokens: int, *, rope: tuple[float | rope_lib.ScaledTheta, tuple[int, int, int] | None],
                interleaved: bool = False, turn: bool = True) -> PagedKV:
    """Compiles `recall_into(..., donate=True)`'s write for each power-of-two bucket of recalled tokens up to
    `max_tokens` by writing no token (none valid) into the donated `kv`, which comes back holding what it held: a
    server's warm-up. `turn`: the keys are re-rotated (False: a policy that recalls at the stored positions)."""
    L, _, _, G, d = kv.k.shape
    A = kv.pos.shape[0]
    for k in range(max(0, int(max_tokens) - 1).bit_length() + 1):
        n = 1 << k
        zeros = np.zeros((L, G, n, d), kv.k.dtype)
        kv = _write_in_place(kv, zeros, zeros, np.zeros((A, n), np.int32), np.zeros((A, n), np.int32),
                             np.zeros(n, np.int32), np.zeros(n, np.int8), np.zeros(n, np.int32), np.zeros(n, bool),
                             jnp.int32(0), rope=(rope[0], rope[1], interleaved), turn=turn)
    return kv


def _write_tokens(kv: PagedKV, k, v, from_pos, to_pos, unit, span, offset, valid, seq, *, rope,
                  turn: bool) -> PagedKV:
    """`recall_into`'s device part: `k, v [L, G, T, d]` re-rotated from `from_pos` to `to_pos` (`turn`) and appended
    to sequence `seq` where `valid [T]`."""
    theta, section, interleaved = rope
    if turn:
        k = rerotate(k, from_pos, to_pos, theta=theta, mrope_section=section, interleaved=interleaved)
    B = kv.batch
    rows = jnp.arange(B) == seq

    def batched(x):  # [L, G, T, d] -> [L, B, T, G, d], zeros outside `seq`
        x = jnp.swapaxes(x, 1, 2)[:, None]
        return jnp.where(rows[None, :, None, None, None], x, 0).astype(kv.k.dtype)

    def per_seq(x):  # [..., T] -> [..., B, T]
        return jnp.where(rows[:, None], jnp.asarray(x)[..., None, :], 0)

    meta = SlotMeta(pos=per_seq(to_pos), unit=per_seq(unit), span=per_seq(span), offset=per_seq(offset))
    token_valid = rows[:, None] & valid[None, :]
    kv, _ = append(kv, batched(k), batched(v), token_valid, meta)
    return kv


_write = cached_jit(_write_tokens, static_argnames=("rope", "turn"))
_write_in_place = cached_jit(_write_tokens, static_argnames=("rope", "turn"), donate_argnames=("kv",))
