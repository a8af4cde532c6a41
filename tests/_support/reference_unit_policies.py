"""Plain-Python reference planners for the unit policies: each takes one stream (a list of `Token`) and returns the set
of kept `order`s. Written as loops over units and tokens, independent of the vectorised plans."""

from __future__ import annotations

from omnijax.chunks.spans import SpanKind as K


def _split(stream):
    """`(system orders, units)`: units oldest first, each a list of its tokens oldest first."""
    system = [t.order for t in stream if t.span == K.SYSTEM]
    groups = {}
    for t in stream:
        if t.span != K.SYSTEM:
            groups.setdefault(t.unit, []).append(t)
    units = []
    for unit_id, tokens in groups.items():
        tokens = sorted(tokens, key=lambda t: t.order)
        units.append((tokens[0].order, unit_id, tokens))
    units.sort(key=lambda item: (item[0], item[1]))  # by age, then unit id
    return system, [tokens for _, _, tokens in units]


def _drop_units(system, kept_per_unit, low):
    """Drops whole units oldest first until system + kept <= low or only the newest unit is left."""
    kept_per_unit = list(kept_per_unit)
    while len(kept_per_unit) > 1 and len(system) + sum(len(k) for k in kept_per_unit) > low:
        kept_per_unit.pop(0)
    result = set(system)
    for k in kept_per_unit:
        result.update(k)
    return result


def unit_fifo(stream, *, low):
    system, units = _split(stream)
    return _drop_units(system, [[t.order for t in unit] for unit in units], low)


def official_unit_window(stream, *, low):
    return unit_fifo(stream, low=low)


def omnipick(stream, *, low, recent_units, image_sink, audio_sink, slice_sink, video_sink, text_budget,
             source_image_whole=False):
    system, units = _split(stream)
    first_recent = len(units) - recent_units
    text_left = text_budget
    kept_per_unit = []
    for index, unit in enumerate(units):
        kept = []
        for t in unit:
            if index >= first_recent:
                keep = True
            elif t.span == K.BOUNDARY:
                keep = True
            elif t.span == K.IMAGE:
                keep = source_image_whole or t.offset < image_sink
            elif t.span == K.SLICE:
                keep = t.offset < slice_sink
            elif t.span == K.AUDIO:
                keep = t.offset < audio_sink
            elif t.span == K.VIDEO:
                keep = t.offset < video_sink
            elif t.span in (K.TEXT, K.RESPONSE):
                keep = text_left > 0
                if keep:
                    text_left -= 1
            else:
                keep = False
            if keep:
                kept.append(t.order)
        kept_per_unit.append(kept)
    return _drop_units(system, kept_per_unit, low)
