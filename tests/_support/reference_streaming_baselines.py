"""Plain-Python / numpy references for the 2025-26 streaming baselines: `StreamingVLM` and `OmniMemBudgets` planners
over one stream of `Token` records (returning kept `order`s) and TimeChat-Online's differential token drop over
chunk arrays (loops over tokens, a dict per frame). Nothing here shares code with `omnijax.retention`."""

from __future__ import annotations

import numpy as np

from omnijax.chunks.spans import SpanKind as K

TEXT_SIDE = {int(K.SYSTEM), int(K.BOUNDARY), int(K.TEXT), int(K.RESPONSE)}
VISUAL = {int(K.IMAGE), int(K.SLICE), int(K.VIDEO)}
AUDIO = {int(K.AUDIO)}


def _kind(span: int, audio_joins_visual: bool) -> str:
    if span in TEXT_SIDE:
        return "text"
    if span in VISUAL or (audio_joins_visual and span in AUDIO):
        return "visual"
    return "audio"


def _newest(tokens, n):
    """Orders of the `n` newest tokens."""
    return {t.order for t in sorted(tokens, key=lambda t: t.order, reverse=True)[:n]}


def streaming_vlm(stream, *, sink, text_window, vision_window, audio_window, text_sink) -> set[int]:
    tokens = sorted(stream, key=lambda t: t.order)
    join = audio_window is None
    pool = [t for t in tokens if _kind(t.span, join) == "text"] if text_sink else tokens
    sinks = {t.order for t in pool[:sink]}
    kept = set(sinks)
    windows = {"text": text_window, "visual": vision_window, "audio": audio_window or 0}
    for kind, window in windows.items():
        rest = [t for t in tokens if _kind(t.span, join) == kind and t.order not in sinks]
        kept |= _newest(rest, window)
    return kept


def omnimem_budgets(stream, *, visual_budget, audio_budget, text_budget) -> set[int]:
    kept = {t.order for t in stream if t.span == K.SYSTEM}
    visual = [t for t in stream if t.span in VISUAL]
    audio = [t for t in stream if t.span in AUDIO]
    text = [t for t in stream if t.span in TEXT_SIDE and t.span != K.SYSTEM]
    kept |= _newest(visual, visual_budget) | _newest(audio, audio_budget)
    kept |= {t.order for t in text} if text_budget is None else _newest(text, text_budget)
    return kept


def reference_plan(policy, stream) -> set[int]:
    if policy.name == "streaming_vlm":
        return streaming_vlm(stream, sink=policy.sink, text_window=policy.text_window,
                             vision_window=policy.vision_window, audio_window=policy.audio_window,
                             text_sink=policy.text_sink)
    if policy.name == "omnimem_budgets":
        return omnimem_budgets(stream, visual_budget=policy.visual_budget, audio_budget=policy.audio_budget,
                               text_budget=policy.text_budget)
    raise KeyError(policy.name)


def reference_trigger(policy, stream) -> bool:
    if policy.name == "streaming_vlm":
        return len(reference_plan(policy, stream)) < len(stream)
    visual = sum(t.span in VISUAL for t in stream)
    audio = sum(t.span in AUDIO for t in stream)
    text = sum(t.span in TEXT_SIDE and t.span != K.SYSTEM for t in stream)
    return visual > policy.visual_budget or audio > policy.audio_budget or (
        policy.text_budget is not None and text > policy.text_budget)


def differential_token_drop(valid, embed_mask, span, offset, embeds, *, threshold, frame_tokens, kinds,
                            band=1e-5):
    """Reference DTD over one sequence's tokens in stream order (1D arrays, `embeds [L, D]`).

    Returns `(drop, marginal)`: bool arrays `[L]`; `marginal` marks the compared tokens whose float64 similarity lies
    within `band` of the threshold (float32 rounding may decide those either way)."""
    L = len(valid)
    drop = np.zeros(L, bool)
    marginal = np.zeros(L, bool)
    for kind in kinds:
        prev, cur, started = {}, {}, False
        for i in range(L):
            if not (valid[i] and embed_mask[i] and span[i] == kind):
                continue
            off = int(offset[i])
            s = off if frame_tokens is None else off % frame_tokens
            opens = off == 0 if frame_tokens is None else off % frame_tokens == 0
            if opens or not started:
                prev, cur, started = cur, {}, True
            if s in prev:
                a = np.asarray(embeds[i], np.float64)
                b = np.asarray(prev[s], np.float64)
                norm = np.linalg.norm(a) * np.linalg.norm(b)
                sim = float(a @ b) / max(norm, 1e-12)
                drop[i] = sim > threshold
                marginal[i] = abs(sim - threshold) < band
            cur.setdefault(s, embeds[i])
    return drop, marginal
