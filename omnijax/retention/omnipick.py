"""OmniPick (OmniTide §5): structure-aware retention of recent whole units and typed sink spans of older units.

Trigger: retained cells > `high_watermark`. Plan, per sequence (units and their age ranks as in
`omnijax.retention.units`: distinct unit ids of live non-SYSTEM tokens, aged by their oldest token's `order`):

1. The SYSTEM prefix is always kept.
2. The `recent_units` newest units are kept whole.
3. From each older unit (visited oldest to newest) keep
   - every BOUNDARY token;
   - the sink prefix of each span run, i.e. tokens with `offset` < the sink of their kind (`offset` is the index
     within the span run): `image_sink` for IMAGE, `slice_sink` for SLICE, `audio_sink` for AUDIO, `video_sink` for
     VIDEO. With `source_image_whole` (MiniCPM-o layouts) IMAGE (the source image) is kept whole and only SLICE runs
     are cut to their prefix;
   - TEXT and RESPONSE tokens in (unit age, order) order, i.e. oldest unit first and oldest token first inside a
     unit, while the shared `text_budget` lasts;
   - nothing else (any other span kind of an older unit is dropped).
4. If SYSTEM + selection still exceeds `low_watermark`, drop whole units oldest first, the fewest that meet the
   target, never the newest unit. The paper's priority "partially kept units before whole ones" is this same order:
   every older (partially kept) unit is older than every recent (whole) unit, so the older units go first, oldest
   first, then the recent ones, oldest first, stopping when SYSTEM + kept <= low or only the newest unit is left.
   The low watermark is therefore a target, not a bound.

Ties: units of equal age are ordered by unit id; tokens of equal order by slot (the cache never produces either).
Re-indexed (`reindex = True`): survivors close up the freed positions and their keys are re-rotated (§5.2).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from omnijax.chunks.spans import SpanKind as K
from omnijax.retention.base import SequenceView, register
from omnijax.retention.units import check_watermarks, drop_oldest_units, unit_ranks


@register
@dataclasses.dataclass(frozen=True)
class OmniPick:
    """OmniPick retention (see the module docstring for the exact plan).

    Attributes:
        high_watermark: trim when retained cells exceed this.
        low_watermark: trimming target for SYSTEM + kept.
        recent_units: newest units kept whole (>= 1).
        image_sink, audio_sink, slice_sink, video_sink: sink prefix length per span run of an older unit.
        text_budget: TEXT + RESPONSE tokens kept over all older units together, oldest first.
        source_image_whole: keep IMAGE spans (MiniCPM-o source image) of older units whole; None (the default)
            follows the session's model family: True for MiniCPM-o, whose source image the paper keeps whole, False
            otherwise (`stream`, `Session`, `evaluate` and the engine fill it in from the model; a plan run
            directly treats None as False).
    """

    high_watermark: int = 2500
    low_watermark: int = 1800
    recent_units: int = 2
    image_sink: int = 4
    audio_sink: int = 4
    slice_sink: int = 4
    video_sink: int = 4
    text_budget: int = 256
    source_image_whole: bool | None = None

    name: ClassVar[str] = "omnipick"
    reindex: ClassVar[bool] = True

    def __post_init__(self):
        check_watermarks(self.high_watermark, self.low_watermark)
        for label in ("recent_units", "image_sink", "audio_sink", "slice_sink", "video_sink", "text_budget"):
            value = getattr(self, label)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{label} must be an int, got {value!r}")
            if value < (1 if label == "recent_units" else 0):
                raise ValueError(f"{label} must be >= {1 if label == 'recent_units' else 0}, got {value}")
        if self.source_image_whole is not None and not isinstance(self.source_image_whole, bool):
            raise ValueError(f"source_image_whole must be a bool or None, got {self.source_image_whole!r}")

    def for_model(self, whole_source_image: bool) -> "OmniPick":
        """This policy for a model whose family does (or does not) keep a unit's source image whole (MiniCPM-o's
        slices refer to it): `source_image_whole=None` takes the family's answer."""
        if self.source_image_whole is not None:
            return self
        return dataclasses.replace(self, source_image_whole=bool(whole_source_image))

    def trigger(self, view: SequenceView) -> jax.Array:
        return view.retained > self.high_watermark

    def max_untrimmed_cells(self) -> int:
        """Retained cells up to which `trigger` never fires: the high watermark."""
        return self.high_watermark

    def plan(self, view: SequenceView) -> jax.Array:
        units = unit_ranks(view)
        span, offset = view.span, view.offset
        recent = units.rank >= (units.count[:, None] - self.recent_units)
        older = units.member & ~recent
        image_sink = jnp.iinfo(jnp.int32).max if self.source_image_whole is True else self.image_sink
        sink = ((span == K.BOUNDARY)
                | ((span == K.IMAGE) & (offset < image_sink))
                | ((span == K.SLICE) & (offset < self.slice_sink))
                | ((span == K.AUDIO) & (offset < self.audio_sink))
                | ((span == K.VIDEO) & (offset < self.video_sink)))
        text = older & ((span == K.TEXT) | (span == K.RESPONSE))
        text_kept = jax.vmap(self._text_one)(text, units.rank, view.order)
        select = units.member & (recent | (older & sink) | text_kept)
        return drop_oldest_units(view, units, select, self.low_watermark)

    def _text_one(self, text, rank, order):
        """`[S]` text tokens within the shared budget, taken in (unit rank, order) order."""
        idx = jnp.lexsort((order, rank, ~text))
        within = jnp.cumsum(text[idx]) <= self.text_budget
        return jnp.zeros_like(text).at[idx].set(text[idx] & within)
