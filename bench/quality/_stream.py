"""Pass-key sessions streamed through omnijax's `chunk_step` (a `Session`, one jitted call per chunk) under a
retention policy: the policies at a matched cell budget, the two prompt shapes, and one run's outcome.

Matched budget B (cells): every policy holds at most B cells after each step. The watermark policies (OmniPick,
UnitFIFO, TokenSliding, StreamingLLM, H2O) trim when they pass B, down to 3B/4 (one hysteresis for all of them);
the fixed-budget ones (SinkWindow, StreamingVLM, InfiniPot-V, StreamMem) hold B. `policy_at` is the one place
these settings are chosen; `NoSlide` keeps everything.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from bench.quality._common import (
    ANSWER_TOKENS,
    FILLER,
    FILLER_ACK,
    INTRO,
    MULTI_ACK,
    MULTI_QUESTION,
    QUESTION,
    contains_key,
    haystack,
    key_sentence,
)

POLICIES = ("no_slide", "omnipick", "unit_fifo", "token_sliding", "streaming_llm", "h2o", "sink_window",
            "streaming_vlm", "infinipot_v", "streammem")
TEXT_ONLY_LIMITS = {"infinipot_v": "compresses visual spans only (IMAGE, SLICE, VIDEO): a text-only stream has "
                                   "none, so it keeps every cell and never meets the budget"}


def policy_at(name: str, budget: int):
    """The retention policy `name` at a matched budget of `budget` cells (see the module docstring)."""
    from omnijax import retention as r

    low = 3 * budget // 4
    make = {
        "no_slide": lambda: r.NoSlide(),
        "omnipick": lambda: r.OmniPick(high_watermark=budget, low_watermark=low, text_budget=budget // 4),
        "unit_fifo": lambda: r.UnitFIFO(high_watermark=budget, low_watermark=low),
        "token_sliding": lambda: r.TokenSliding(window=low, high_watermark=budget),
        "streaming_llm": lambda: r.StreamingLLM(sink_tokens=4, window=low - 4, high_watermark=budget),
        "h2o": lambda: r.H2O(heavy=low // 2, recent=low - low // 2, high_watermark=budget),
        "sink_window": lambda: r.SinkWindow(sink=4, window=budget - 4),
        "streaming_vlm": lambda: r.StreamingVLM(sink=budget // 2, text_window=budget - budget // 2, vision_window=0),
        "infinipot_v": lambda: r.InfiniPotV(budget=budget),
        "streammem": lambda: r.StreamMem(budget=budget),
    }
    if name not in make:
        raise SystemExit(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    return make[name]()


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One pass-key session as chunks to feed: `parts` (each a batch-1 `Chunk`, the last asking for the answer),
    the stream orders of the key sentence's tokens `[first, last)`, and the tokens fed in all."""

    parts: list
    key_orders: tuple[int, int]
    tokens: int
    key: str
    depth: float


def _token_spans(tokenizer, ids: list[int]) -> np.ndarray:
    """`[n + 1]` character offsets of each token's start (byte-level BPE on ASCII text)."""
    return np.concatenate([[0], np.cumsum([len(tokenizer.decode([i])) for i in ids])])


def _key_tokens(tokenizer, ids: list[int], text: str, key: str) -> tuple[int, int]:
    """`[first, last)` indices of the tokens of `ids` (the encoding of `text`) that cover the key sentence."""
    start = text.index(key_sentence(key).strip())
    end = start + len(key_sentence(key).strip())
    spans = _token_spans(tokenizer, ids)
    inside = np.flatnonzero((spans[1:] > start) & (spans[:-1] < end))
    return int(inside[0]), int(inside[-1]) + 1


def filler_lines_for(tokenizer, tokens: int) -> int:
    """Filler lines that make a haystack of about `tokens` tokens."""
    per_line = len(tokenizer.encode(FILLER * 20)) / 20
    return max(1, int((tokens - len(tokenizer.encode(INTRO)) - 40) / per_line))


def single_prompt(model, length: int, depth: float, key: str, chunk: int) -> Prompt:
    """The haystack and question as one user message, streamed in units of `chunk` tokens.

    The chat template's text before the message (system prompt and markers) is the SYSTEM unit; the message's text
    is cut into TEXT units of `chunk` tokens; the question with the template's generation prompt is the last unit,
    which asks for the answer.
    """
    from omnijax.chunks.chunk import text_chunk
    from omnijax.chunks.spans import SpanKind

    tok = model.tokenizer
    body = haystack(filler_lines_for(tok, length), depth, key)
    rendered = tok.render([{"role": "user", "content": body + QUESTION}], add_generation_prompt=True)
    at = rendered.index(body)
    head_ids, body_ids = tok.encode(rendered[:at]), tok.encode(body)
    tail_ids = tok.encode(rendered[at + len(body):])
    first, last = _key_tokens(tok, body_ids, body, key)
    parts = [text_chunk(head_ids[i:i + chunk], unit=0, span=SpanKind.SYSTEM) for i in range(0, len(head_ids), chunk)]
    unit = 1
    for i in range(0, len(body_ids), chunk):
        parts.append(text_chunk(body_ids[i:i + chunk], unit=unit))
        unit += 1
    parts.append(text_chunk(tail_ids, unit=unit, answer_tokens=ANSWER_TOKENS))
    base = len(head_ids)
    return Prompt(parts, (base + first, base + last), len(head_ids) + len(body_ids) + len(tail_ids), key, depth)


def multi_turn(model, length: int, key: str, chunk: int) -> Prompt:
    """A conversation: turn 1 states the key (in a short haystack), filler turns of about `chunk` tokens follow,
    each acknowledged by a scripted assistant turn, and the question is the last turn. Built by
    `omnijax.conversation.Conversation` (the checkpoint's chat template and the family's text units)."""
    from omnijax.conversation import Conversation

    tok = model.tokenizer
    conv = Conversation(model, tok, chunk_tokens=chunk)
    first_text = haystack(filler_lines_for(tok, chunk), 0.5, key)
    parts = conv.message("user", first_text)  # the first unit: its tokens are the stream's first orders
    ids = [int(t) for p in parts for t, v in zip(np.asarray(p.token_ids[0]), np.asarray(p.valid[0])) if v]
    rendered = tok.decode(ids)
    first, last = _key_tokens(tok, ids, rendered, key)
    key_orders = (first, last)
    parts += conv.message("assistant", MULTI_ACK)
    line = FILLER.strip() + "\n"
    lines = max(1, filler_lines_for(tok, chunk - 16))
    turn = line * lines
    while conv.tokens_fed < length - chunk:
        parts += conv.message("user", turn)
        parts += conv.message("assistant", FILLER_ACK)
    prompt = conv.ask(MULTI_QUESTION, ANSWER_TOKENS)
    parts += prompt.parts
    return Prompt(pack_parts(parts, chunk), key_orders, conv.tokens_fed, key, 0.0)


def pack_parts(parts: list, length: int) -> list:
    """Consecutive text parts packed into chunks of at most `length` tokens (each token keeps its unit, span and
    offset; positions continue across the parts), so short turns do not each cost a step. A part that asks for an
    answer closes its chunk."""
    from omnijax.chunks.chunk import Chunk

    packed, group, size = [], [], 0

    def close():
        if not group:
            return
        cuts = [np.asarray(p.valid[0]).sum() for p in group]
        shift, positions = 0, []
        for p, n in zip(group, cuts):
            positions.append(np.asarray(p.positions)[:, :, :n] + shift)
            shift += int(np.asarray(p.advance)[0])
        cat = lambda field: np.concatenate([np.asarray(getattr(p, field))[:, :n] for p, n in zip(group, cuts)], 1)  # noqa: E731
        last = group[-1]
        packed.append(Chunk(token_ids=cat("token_ids"), valid=cat("valid"), positions=np.concatenate(positions, 2),
                            unit=cat("unit"), span=cat("span"), offset=cat("offset"),
                            answer_tokens=np.asarray(last.answer_tokens), answer_unit=np.asarray(last.answer_unit),
                            advance=np.asarray([shift], np.int32)))
        group.clear()

    for part in parts:
        if any(getattr(part, f) is not None for f in ("embeds", "embed_mask", "deepstack", "sampling")):
            raise ValueError("pack_parts packs text parts only")
        n = int(np.asarray(part.valid[0]).sum())
        if group and size + n > length:
            close()
            size = 0
        group.append(part)
        size += n
        if int(np.asarray(part.answer_tokens)[0]) > 0:
            close()
            size = 0
    close()
    return packed


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One session's result: the answer, whether it holds the key, cells held (peak after a step, mean, at the
    question), the key sentence's cells still held at the question, and wall seconds."""

    answer: str
    correct: bool
    peak_cells: int
    mean_cells: float
    final_cells: int
    key_cells_kept: int
    key_cells: int
    seconds: float


def run_session(model, prompt: Prompt, config, *, pad_to: int = 0) -> Outcome:
    """Feeds `prompt` through a `Session` (every part padded to one chunk length, the longest part's or `pad_to`
    if that is longer, so one compiled step serves the whole session, and sessions of both shapes share it) and
    decodes the answer's tokens."""
    from omnijax.chunks.chunk import pad_chunk
    from omnijax.streaming.session import Session

    length = max([pad_to] + [p.length for p in prompt.parts])
    session = Session(model, config)
    started = time.perf_counter()
    cells, answer, key_kept = [], [], 0
    for i, part in enumerate(prompt.parts):
        last = i == len(prompt.parts) - 1
        if last:  # the key's cells held when the question arrives (before the question's own trim)
            kv = session.state.kv
            order, valid = np.asarray(kv.order), np.asarray(kv.valid)
            a, b = prompt.key_orders
            key_kept = int(np.sum(valid & (order >= a) & (order < b)))
        out = session.feed(pad_chunk(part, length))
        cells.append(int(np.asarray(out.stats.layout.retained_cells)[0]))
        if last:
            answer = [int(t) for t in np.asarray(out.tokens[0]) if t >= 0]
    seconds = time.perf_counter() - started
    text = model.tokenizer.decode(answer, skip_special_tokens=True).strip()
    return Outcome(answer=text, correct=contains_key(text, prompt.key), peak_cells=max(cells),
                   mean_cells=float(np.mean(cells)), final_cells=cells[-1], key_cells_kept=key_kept,
                   key_cells=prompt.key_orders[1] - prompt.key_orders[0], seconds=seconds)


def stream_config(policy, *, tokens: int, budget: int, chunk: int, page_size: int):
    """A `StreamConfig` for one session: greedy answers of `ANSWER_TOKENS`, a pool that holds the policy's peak
    (the whole session for NoSlide and a policy that cannot meet the budget), H2O on the reference attention (the
    only one that computes its attention mass)."""
    from omnijax.streaming.config import StreamConfig

    bounded = policy.name not in ("no_slide",) + tuple(TEXT_ONLY_LIMITS)
    held = budget + 2 * chunk + ANSWER_TOKENS if bounded else tokens + chunk + ANSWER_TOKENS
    pages = -(-held // page_size) + 2
    return StreamConfig(policy=policy, num_pages=pages, page_size=page_size, max_answer_tokens=ANSWER_TOKENS,
                        impl="reference" if policy.name == "h2o" else "xla")
