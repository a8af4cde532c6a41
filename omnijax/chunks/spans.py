"""Units and span kinds: the structural metadata every cached token carries.

A unit is the token sequence of one streaming event (an audiovisual chunk, a user text, a model response) with its
structural markers. Each token records its span kind, its unit id and its offset within its span.
"""

from __future__ import annotations

import enum


class SpanKind(enum.IntEnum):
    SYSTEM = 0
    BOUNDARY = 1
    IMAGE = 2
    SLICE = 3
    VIDEO = 4
    AUDIO = 5
    TEXT = 6
    RESPONSE = 7
