"""Modality-windowed streaming baselines (2025-26): StreamingVLM's cache rule and OmniMem-style modality budgets.

Both policies sort each live token into a modality group by its span kind and keep the newest tokens of every group
up to that group's window (oldest-first eviction inside a modality), ranking age by `view.order` (never the slot
index). They read slot metadata only, like every policy here (`omnijax.retention.base`): neither the published
StreamingVLM nor OmniMem rule can be reproduced beyond that, see the class docstrings for what is chosen.

Modality groups (`omnijax.chunks.spans.SpanKind`):

    text side   SYSTEM, BOUNDARY, TEXT, RESPONSE
    visual      IMAGE, SLICE, VIDEO
    audio       AUDIO

Budgets (retained cells after a trim):

    StreamingVLM(sink, text_window, vision_window, audio_window)
        sink + text_window + vision_window (+ audio_window)                  re-indexed (contiguous positions)
    OmniMemBudgets(visual_budget, audio_budget, text_budget)
        SYSTEM + visual_budget + audio_budget + (text_budget or every text-side token)     re-indexed

Both trigger as soon as some group holds more than its window, so after every trim each group is within it (the
stream trims after every chunk that overflows one; the methods evict continuously too). Re-indexing closes the
freed position gaps with the shared rule of `omnijax.retention.base.apply` (the StreamingVLM paper's "contiguous
RoPE": survivors keep their order and get consecutive positions; Qwen's TMRoPE keeps each survivor's t/h/w shape).
Every plan is a few sorts over `[B, S]`, vmapped over the batch; hyperparameters are static.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import ClassVar

import jax
import jax.numpy as jnp

from omnijax.chunks.spans import SpanKind as K
from omnijax.retention.base import SequenceView, register

__all__ = ["OmniMemBudgets", "StreamingVLM", "TEXT_SIDE", "VISUAL", "group_ranks", "modality_group"]

TEXT_SIDE = (K.SYSTEM, K.BOUNDARY, K.TEXT, K.RESPONSE)
VISUAL = (K.IMAGE, K.SLICE, K.VIDEO)

# Group ids of `modality_group`.
_TEXT, _VISUAL, _AUDIO = 0, 1, 2


def _is(span: jax.Array, kinds) -> jax.Array:
    out = jnp.zeros(span.shape, bool)
    for kind in kinds:
        out = out | (span == int(kind))
    return out


def modality_group(view: SequenceView) -> jax.Array:
    """`[B, S]` int32 group of each live slot: 0 text side, 1 visual, 2 audio; -1 for dead slots (and any span
    value outside `SpanKind`)."""
    span = view.span
    group = jnp.where(_is(span, TEXT_SIDE), _TEXT, jnp.where(_is(span, VISUAL), _VISUAL,
                                                             jnp.where(span == K.AUDIO, _AUDIO, -1)))
    return jnp.where(view.live, group, -1).astype(jnp.int32)


def _ranks_one(group, order, num_groups):
    S = group.shape[0]
    g = jnp.where((group >= 0) & (group < num_groups), group, num_groups)  # outsiders form the last group
    idx = jnp.lexsort((order, g))  # by group, oldest first inside it
    g_s = g[idx]
    counts = jnp.zeros((num_groups + 1,), jnp.int32).at[g].add(1)
    start = jnp.cumsum(counts) - counts
    oldest_s = jnp.arange(S, dtype=jnp.int32) - start[g_s]
    newest_s = counts[g_s] - 1 - oldest_s
    from_oldest = jnp.zeros((S,), jnp.int32).at[idx].set(oldest_s)
    from_newest = jnp.zeros((S,), jnp.int32).at[idx].set(newest_s)
    return from_oldest, from_newest


def group_ranks(group: jax.Array, order: jax.Array, num_groups: int) -> tuple[jax.Array, jax.Array]:
    """Age ranks inside groups: `(from_oldest, from_newest)`, each `[B, S]` int32.

    Args:
        group: `[B, S]` group ids; slots outside `[0, num_groups)` are ranked among themselves (ignore them).
        order: `[B, S]` write order (larger is newer).
        num_groups: number of groups.

    Returns:
        0 for the oldest (resp. newest) token of its group; ties in `order` (never produced by the cache) are
        broken by slot index.
    """
    return jax.vmap(_ranks_one, in_axes=(0, 0, None))(group, order, num_groups)


def _check_int(cls: str, minimum: int, **values) -> None:
    for label, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{cls}: {label} must be an int, got {value!r}")
        if value < minimum:
            raise ValueError(f"{cls}: {label} must be >= {minimum}, got {value}")


@register
@dataclasses.dataclass(frozen=True)
class StreamingVLM:
    """StreamingVLM's inference cache (Xu et al., 2025): attention sinks, a long window of recent text tokens and a
    short window of recent vision tokens; evicted tokens leave no gap in position space (contiguous RoPE).

    Plan, per sequence: keep the `sink` oldest sink tokens (with `text_sink`, the oldest text-side tokens: SYSTEM,
    BOUNDARY, TEXT, RESPONSE, i.e. the system prompt and early text; otherwise the oldest tokens of any kind), then
    among the rest the newest `text_window` text-side tokens, the newest `vision_window` visual tokens (IMAGE, SLICE,
    VIDEO) and the newest audio tokens: `audio_window` of them, or, with `audio_window=None`, audio shares the
    vision window (one short window over all media, in age order). Triggers whenever that plan would drop a token,
    so the cache never holds more than `budget` cells after a trim.

    Chosen details (not fixed by the paper for an omni model; all parameters): windows count tokens, not seconds
    (16 s of vision is `16 * tokens_per_second`); BOUNDARY markers belong to the text window, as the chat-format
    tokens of the paper's text stream do; audio joins the vision window by default. Defaults: the paper's 512 sink
    and 512 text tokens; a vision window of 1024 tokens, about 16 s of this library's default Qwen2.5-Omni 2 s
    units (35 video + 25 audio tokens per second).

    Args:
        sink: sink tokens kept, `>= 0`.
        text_window: newest text-side tokens kept beyond the sinks, `>= 0`.
        vision_window: newest visual tokens (and audio, when `audio_window` is None) kept, `>= 0`.
        audio_window: newest audio tokens kept, `>= 0`; None: audio counts in the vision window.
        text_sink: sinks are the oldest text-side tokens (True) or the oldest tokens of any kind (False).
    """

    sink: int = 512
    text_window: int = 512
    vision_window: int = 1024
    audio_window: int | None = None
    text_sink: bool = True

    name: ClassVar[str] = "streaming_vlm"
    reindex: ClassVar[bool] = True

    def __post_init__(self):
        _check_int("StreamingVLM", 0, sink=self.sink, text_window=self.text_window, vision_window=self.vision_window)
        if self.audio_window is not None:
            _check_int("StreamingVLM", 0, audio_window=self.audio_window)
        if not isinstance(self.text_sink, bool):
            raise ValueError(f"StreamingVLM: text_sink must be a bool, got {self.text_sink!r}")
        if self.budget < 1:
            raise ValueError("StreamingVLM: sink + windows must keep at least one token")

    @property
    def budget(self) -> int:
        """Most retained cells after a trim."""
        return self.sink + self.text_window + self.vision_window + (self.audio_window or 0)

    def _groups(self, view: SequenceView) -> jax.Array:
        group = modality_group(view)
        if self.audio_window is None:
            group = jnp.where(group == _AUDIO, _VISUAL, group)
        return group

    def trigger(self, view: SequenceView) -> jax.Array:
        """Trims whenever the plan would drop a live token."""
        return jnp.any(view.live & ~self.plan(view), axis=1)

    def max_untrimmed_cells(self) -> int:
        """Retained cells up to which `trigger` never fires: a group no larger than its window (text: with its
        sinks) loses nothing, and no group holds more cells than are retained."""
        text = self.text_window + (self.sink if self.text_sink else 0)
        media = [self.vision_window] if self.audio_window is None else [self.vision_window, self.audio_window]
        return min(text, *media)

    def plan(self, view: SequenceView) -> jax.Array:
        group = self._groups(view)
        from_oldest, from_newest = group_ranks(group, view.order, 3)
        if self.text_sink:
            sink = (group == _TEXT) & (from_oldest < self.sink)
        else:
            live_ranks, _ = group_ranks(jnp.where(view.live, 0, -1), view.order, 1)
            sink = view.live & (live_ranks < self.sink)
        # A group's sinks are its oldest tokens, so its newest `window` non-sink tokens are its newest `window`
        # tokens less the sinks among them: the ranks over the whole group serve.
        windows = jnp.asarray([self.text_window, self.vision_window, self.audio_window or 0], jnp.int32)
        window = jnp.where(group >= 0, windows[jnp.clip(group, 0, 2)], 0)
        return view.live & (sink | ((group >= 0) & (from_newest < window)))


@register
@dataclasses.dataclass(frozen=True)
class OmniMemBudgets:
    """OmniMem-style modality budgets (OmniMem, 2026: separate visual and audio memory allocations for audio-visual
    LLMs): the visual and audio contexts are budgeted apart, so dense video cannot crowd out sparse audio.

    Plan, per sequence: keep the SYSTEM prefix (never counted); keep the newest `visual_budget` visual tokens
    (IMAGE, SLICE, VIDEO) and the newest `audio_budget` AUDIO tokens, i.e. oldest-first eviction inside each
    modality; keep every other text-side token (BOUNDARY, TEXT, RESPONSE) or, with a `text_budget`, the newest
    `text_budget` of them. Triggers when some modality exceeds its budget.

    Chosen details: OmniMem picks the survivors inside a modality by perturbation of the model's output, which needs
    the model in the loop and is not available to a policy (it sees slot metadata only); this baseline keeps the
    newest instead, as the issue asks. Budgets count tokens; the defaults are this library's choice (about 30 s of
    the default Qwen2.5-Omni 2 s units: 35 video and 25 audio tokens per second). BOUNDARY markers count as text.

    Args:
        visual_budget: visual tokens kept, `>= 0`.
        audio_budget: audio tokens kept, `>= 0`.
        text_budget: BOUNDARY + TEXT + RESPONSE tokens kept, `>= 0`; None keeps them all.
    """

    visual_budget: int = 1024
    audio_budget: int = 768
    text_budget: int | None = None

    name: ClassVar[str] = "omnimem_budgets"
    reindex: ClassVar[bool] = True

    def __post_init__(self):
        _check_int("OmniMemBudgets", 0, visual_budget=self.visual_budget, audio_budget=self.audio_budget)
        if self.text_budget is not None:
            _check_int("OmniMemBudgets", 0, text_budget=self.text_budget)

    @property
    def budget(self) -> int | None:
        """Most retained cells after a trim beside the SYSTEM prefix (None: text is unbounded)."""
        if self.text_budget is None:
            return None
        return self.visual_budget + self.audio_budget + self.text_budget

    def _windows(self) -> jax.Array:
        text = jnp.iinfo(jnp.int32).max if self.text_budget is None else self.text_budget
        return jnp.asarray([text, self.visual_budget, self.audio_budget], jnp.int32)

    def _groups(self, view: SequenceView) -> jax.Array:
        group = modality_group(view)
        return jnp.where(view.span == K.SYSTEM, -1, group)  # pinned, never counted

    def trigger(self, view: SequenceView) -> jax.Array:
        group = self._groups(view)
        windows = self._windows()
        over = jnp.zeros(view.retained.shape, bool)
        for g in range(3):
            over = over | (jnp.sum(group == g, axis=1) > windows[g])
        return over

    def max_untrimmed_cells(self) -> int:
        """Retained cells up to which `trigger` never fires: the smallest budget (no modality holds more cells than
        are retained)."""
        budgets = [self.visual_budget, self.audio_budget] + ([] if self.text_budget is None else [self.text_budget])
        return min(budgets)

    def plan(self, view: SequenceView) -> jax.Array:
        group = self._groups(view)
        _, from_newest = group_ranks(group, view.order, 3)
        windows = self._windows()
        window = jnp.where(group >= 0, windows[jnp.clip(group, 0, 2)], 0)
        system = view.live & (view.span == K.SYSTEM)
        return system | (view.live & (group >= 0) & (from_newest < window))
