"""MiniCPM-o chunk builders (2.6 omni streaming and 4.5 duplex unit layouts): tokens, 1D positions, span metadata.

MiniCPM-o uses plain 1D RoPE: position = index in the session, so every chunk's offsets are 0..T-1 (one position
axis) and the cursor advances by the token count. Layouts (MODELS.md):

- 2.6 omni streaming, one unit per second: `<unit> <image> E64 </image> <|audio_start|> A25 <|audio_end|>`.
- 4.5 duplex: `<unit> [<image> E64 </image> (<slice> E64 </slice>)*] A10 {text | <|listen|> | <|chunk_eos|>} </unit>`.

A high-resolution image is a source image plus a grid of slices (`slice_grid`; 1344×1344 gives 3×3), each 64
resampler tokens: 10 × 64 = 640. Span kinds: markers (`<unit>`, `</unit>`, `<image>`, `</image>`, `<slice>`,
`</slice>`, `<|audio_start|>`, `<|audio_end|>`, `<|listen|>`, `<|speak|>`, `<|chunk_eos|>`, chat markers) BOUNDARY,
source image IMAGE, slices SLICE (each slice its own run, offsets from 0), audio AUDIO, user text TEXT, generated text
RESPONSE, system prompt SYSTEM. Placeholders are set in `embed_mask`; features fill them in order.

Token ids are configurable (`MiniCPMTokens`): the 4.5 marker ids are those of MODELS.md; ids marked (?) below are
not verified against a tokenizer and only need to be valid vocabulary ids (placeholders are replaced by embeddings).
A converted checkpoint carries its tokenizer's ids (`model.tokens`, from the `special_tokens` entry
`omnijax-convert` writes); pass `tokens=model.tokens` so chunks use the checkpoint's ids, not the release's.
The model itself is a later step; this module only lays out units.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np
import numpy.typing as npt

from omnijax.chunks import builders as adapters
from omnijax.chunks.builders import concat, token_layout  # noqa: F401  (re-exported)
from omnijax.chunks.chunk import Chunk
from omnijax.chunks.spans import SpanKind

QUERY_NUM = 64  # resampler queries: tokens per image or slice


@dataclasses.dataclass(frozen=True)
class MiniCPMTokens:
    """Special token ids of a MiniCPM-o tokenizer.

    `slice_row_separator`: MiniCPM-V's processor joins rows of slices with a newline token; MODELS.md's layout has
    no separator, so the default is None (set it, e.g. to 198 = "\\n" in Qwen tokenizers, to insert one, as a
    BOUNDARY token, between slice rows).
    """

    unit_start: int
    unit_end: int
    image_start: int
    image_end: int
    slice_start: int
    slice_end: int
    image_placeholder: int
    audio_start: int
    audio_end: int
    audio_placeholder: int
    listen: int
    speak: int
    chunk_eos: int
    im_start: int = 151644
    im_end: int = 151645
    slice_row_separator: int | None = None

    @property
    def boundary_ids(self) -> frozenset[int]:
        ids = {self.unit_start, self.unit_end, self.image_start, self.image_end, self.slice_start, self.slice_end,
               self.audio_start, self.audio_end, self.listen, self.speak, self.chunk_eos, self.im_start, self.im_end}
        return frozenset(ids)

    @property
    def placeholder_ids(self) -> frozenset[int]:
        return frozenset({self.image_placeholder, self.audio_placeholder})

    @classmethod
    def from_special_tokens(cls, special_tokens: dict[str, int], base: "MiniCPMTokens | None" = None
                            ) -> "MiniCPMTokens":
        """`base` (default the 4.5 release's ids) with every id the tokenizer map (token text -> id) declares."""
        base = MINICPMO_4_5 if base is None else base
        changes = {field: int(special_tokens[text]) for field, text in TOKEN_TEXT.items() if text in special_tokens}
        return dataclasses.replace(base, **changes)


# The tokenizer's text of each `MiniCPMTokens` field. `<unk>` is both placeholders: the release's processor fills image
# and audio spans with it (the golden vectors' turn-based prompt does), and embeddings replace them either way.
TOKEN_TEXT = {
    "unit_start": "<unit>", "unit_end": "</unit>", "image_start": "<image>", "image_end": "</image>",
    "slice_start": "<slice>", "slice_end": "</slice>", "image_placeholder": "<unk>", "audio_placeholder": "<unk>",
    "audio_start": "<|audio_start|>", "audio_end": "<|audio_end|>", "listen": "<|listen|>", "speak": "<|speak|>",
    "chunk_eos": "<|chunk_eos|>", "im_start": "<|im_start|>", "im_end": "<|im_end|>",
}


# MiniCPM-o 4.5 (Qwen3 LLM, vocab 151748). Markers from MODELS.md; <|chunk_eos|> 151718 (?) from public serving
# code; image placeholder `<unk>` 128244 (?) and audio placeholder 151698 (?, between <|audio_start|> and
# <|audio_end|>) unverified.
MINICPMO_4_5 = MiniCPMTokens(
    unit_start=151683, unit_end=151684, image_start=151669, image_end=151670, slice_start=151679, slice_end=151680,
    image_placeholder=128244, audio_start=151697, audio_end=151699, audio_placeholder=151698, listen=151705,
    speak=151706, chunk_eos=151718)

# MiniCPM-o 2.6 (Qwen2.5 LLM, vocab 151700). All ids (?) unverified: image/slice markers follow MiniCPM-V 2.6's
# added tokens (<image> 151646 … <slice> 151656), the rest are placeholders to override with the checkpoint's
# tokenizer. `<unk>` (128244) is both the image and the audio placeholder in the documented 2.6 layout.
MINICPMO_2_6 = MiniCPMTokens(
    unit_start=151660, unit_end=151661, image_start=151646, image_end=151647, slice_start=151656, slice_end=151657,
    image_placeholder=128244, audio_start=151662, audio_end=151663, audio_placeholder=128244, listen=151664,
    speak=151665, chunk_eos=151666)


def slice_grid(width: int, height: int, *, max_slice_nums: int = 9,
               scale_resolution: int = 448) -> tuple[int, int] | None:
    """(columns, rows) of the slice grid MiniCPM-V cuts an image into, or None when it is not sliced.

    ratio = w·h / scale_resolution²; n = min(ceil(ratio), max_slice_nums); no slicing when n <= 1; otherwise among
    the factorisations m × k of n - 1, n, n + 1 (excluding 1 and counts above max_slice_nums) the one whose log
    aspect ratio is closest to the image's (first best wins). 1344×1344 → (3, 3); 448×448 → None.
    """
    ratio = width * height / (scale_resolution * scale_resolution)
    multiple = min(math.ceil(ratio), max_slice_nums)
    if multiple <= 1:
        return None
    log_ratio = math.log(width / height)
    best, best_error = None, float("inf")
    for count in (multiple - 1, multiple, multiple + 1):
        if count == 1 or count > max_slice_nums:
            continue
        for cols in range(1, count + 1):
            if count % cols == 0:
                error = abs(log_ratio - math.log(cols / (count // cols)))
                if error < best_error:
                    best, best_error = (cols, count // cols), error
    return best


def image_token_count(slices: tuple[int, int] | None, query_num: int = QUERY_NUM) -> int:
    """Embedding tokens of an image: (1 + columns · rows) · query_num (markers not counted)."""
    return (1 + (0 if slices is None else slices[0] * slices[1])) * query_num


def unit_chunk(unit: int, *, tokens: MiniCPMTokens = MINICPMO_4_5, image: bool = False,
               slices: tuple[int, int] | None = None, audio_tokens: int = 0, audio_markers: bool = True,
               tail: Sequence[int] | str | None = None, close: bool = True, query_num: int = QUERY_NUM,
               image_embeds: np.ndarray | None = None, audio_embeds: np.ndarray | None = None,
               hidden_size: int | None = None, answer_tokens: int = 0, answer_unit: int | None = None) -> Chunk:
    """`<unit> [image] [audio] [tail] [</unit>]`, the general MiniCPM-o unit.

    Args:
        unit: unit id.
        tokens: the tokenizer's ids.
        image: include `<image> E(query_num) </image>` (the source image).
        slices: `(columns, rows)` of slices after the source image (`slice_grid`), each `<slice> E </slice>`,
            row-major; requires `image`.
        audio_tokens: audio embedding tokens (2.6: 25 per second, 4.5: 10 per second); 0 for none.
        audio_markers: wrap audio in `<|audio_start|> … <|audio_end|>`.
        tail: what follows the inputs: None, "listen", "chunk_eos", "speak" (one marker) or token ids (generated
            text: RESPONSE, except marker ids which are BOUNDARY).
        close: end with `</unit>` (a unit whose tail the model is about to generate stays open).
        image_embeds: `[(1 + slices) * query_num, D]` (or `[1 + slices, query_num, D]`): source, then slices.
        audio_embeds: `[audio_tokens, D]`.
        hidden_size: embedding width when no features are given (zeros are placed).
        answer_tokens: greedy tokens to generate after the chunk.
        answer_unit: unit of the generated tokens; default `unit` (duplex output belongs to its unit).
    """
    if slices is not None and not image:
        raise ValueError("slices need the source image (image=True)")
    ids: list[int] = [tokens.unit_start]
    span: list[int] = [SpanKind.BOUNDARY]

    def add(values, kind):
        ids.extend(int(v) for v in values)
        span.extend([int(kind)] * len(values))

    if image:
        add([tokens.image_start], SpanKind.BOUNDARY)
        add([tokens.image_placeholder] * query_num, SpanKind.IMAGE)
        add([tokens.image_end], SpanKind.BOUNDARY)
        if slices is not None:
            cols, rows = (int(v) for v in slices)
            if cols < 1 or rows < 1:
                raise ValueError(f"slices must be positive (columns, rows), got {slices!r}")
            for r in range(rows):
                if r and tokens.slice_row_separator is not None:
                    add([tokens.slice_row_separator], SpanKind.BOUNDARY)
                for _ in range(cols):
                    add([tokens.slice_start], SpanKind.BOUNDARY)
                    add([tokens.image_placeholder] * query_num, SpanKind.SLICE)
                    add([tokens.slice_end], SpanKind.BOUNDARY)
    image_mask = np.isin(np.asarray(span), [SpanKind.IMAGE, SpanKind.SLICE])
    if audio_tokens < 0:
        raise ValueError(f"audio_tokens must be >= 0, got {audio_tokens}")
    if audio_tokens and audio_markers:
        add([tokens.audio_start], SpanKind.BOUNDARY)
    audio_from = len(ids)
    add([tokens.audio_placeholder] * audio_tokens, SpanKind.AUDIO)
    if audio_tokens and audio_markers:
        add([tokens.audio_end], SpanKind.BOUNDARY)
    if isinstance(tail, str):
        marker = {"listen": tokens.listen, "chunk_eos": tokens.chunk_eos, "speak": tokens.speak}.get(tail)
        if marker is None:
            raise ValueError(f"tail must be 'listen', 'chunk_eos', 'speak', token ids or None, got {tail!r}")
        add([marker], SpanKind.BOUNDARY)
    elif tail is not None:
        for t in np.asarray(tail, np.int64).reshape(-1):
            add([t], SpanKind.BOUNDARY if int(t) in tokens.boundary_ids else SpanKind.RESPONSE)
    if close:
        add([tokens.unit_end], SpanKind.BOUNDARY)
    ids_arr = np.asarray(ids, np.int64)
    n = ids_arr.shape[0]
    image_mask = np.concatenate([image_mask, np.zeros(n - image_mask.shape[0], bool)])
    audio_mask = np.zeros(n, bool)
    audio_mask[audio_from:audio_from + audio_tokens] = True
    embeds, mask = adapters.place_embeds(ids_arr, [(image_mask, image_embeds), (audio_mask, audio_embeds)],
                                         hidden_size)
    return adapters.make_chunk(ids_arr, _positions(n), span, unit, answer_tokens=answer_tokens,
                               answer_unit=unit if answer_unit is None else answer_unit, embeds=embeds,
                               embed_mask=mask)


def omni_unit_2_6(unit: int, *, audio_tokens: int = 25, image: bool = True, slices: tuple[int, int] | None = None,
                  tokens: MiniCPMTokens = MINICPMO_2_6, **kwargs: Any) -> Chunk:
    """MiniCPM-o 2.6 streaming unit (one second): `<unit><image>E64</image><|audio_start|>A25<|audio_end|>`.

    No `</unit>` (the documented layout has none). `kwargs` go to `unit_chunk` (embeddings, answers, tail).
    """
    kwargs.setdefault("close", False)
    return unit_chunk(unit, tokens=tokens, image=image, slices=slices, audio_tokens=audio_tokens,
                      audio_markers=True, **kwargs)


def duplex_unit(unit: int, *, audio_tokens: int = 10, image: bool = True, slices: tuple[int, int] | None = None,
                tail: Sequence[int] | str | None = None, close: bool = True, tokens: MiniCPMTokens = MINICPMO_4_5,
                **kwargs: Any) -> Chunk:
    """MiniCPM-o 4.5 duplex unit: `<unit> [<image>E64</image> (<slice>E64</slice>)*] A10 {tail} </unit>`.

    Audio has no start/end markers here (pass `audio_markers=True` to add them). For a unit whose decision the model
    generates, pass `tail=None, close=False, answer_tokens=k`; for history, the generated `tail` and `close=True`.
    """
    kwargs.setdefault("audio_markers", False)
    return unit_chunk(unit, tokens=tokens, image=image, slices=slices, audio_tokens=audio_tokens, tail=tail,
                      close=close, **kwargs)


def system_unit(token_ids: Sequence[int], unit: int, *, hidden_size: int | None = None) -> Chunk:
    """The system prompt: every token SYSTEM."""
    return _text(token_ids, unit, SpanKind.SYSTEM, 0, None, hidden_size, None)


def text_unit(token_ids: Sequence[int], unit: int, answer_tokens: int = 0, *, answer_unit: int | None = None,
              hidden_size: int | None = None, tokens: MiniCPMTokens = MINICPMO_4_5) -> Chunk:
    """User text: TEXT, marker ids BOUNDARY; generated answer as unit `answer_unit` (default `unit + 1`)."""
    return _text(token_ids, unit, SpanKind.TEXT, answer_tokens, answer_unit, hidden_size, tokens)


def response_unit(token_ids: Sequence[int], unit: int, *, hidden_size: int | None = None,
                  tokens: MiniCPMTokens = MINICPMO_4_5) -> Chunk:
    """A model response fed back as input: RESPONSE, marker ids BOUNDARY."""
    return _text(token_ids, unit, SpanKind.RESPONSE, 0, None, hidden_size, tokens)


def with_embeds(chunk: Chunk, hidden_size: int, tokens: MiniCPMTokens = MINICPMO_4_5,
                dtype: npt.DTypeLike = np.float32) -> Chunk:
    """Adds zero embeddings and the placeholder mask to a chunk built without them.

    The mask is taken from the placeholder ids, so use it on text chunks (or build multimodal units with
    `hidden_size`): a 2.6 unit's `<unk>` stands for both image and audio.
    """
    return adapters.with_embeds(chunk, hidden_size, tokens.placeholder_ids, dtype)


def _text(token_ids, unit, kind, answer_tokens, answer_unit, hidden_size, tokens) -> Chunk:
    ids = np.asarray(token_ids, np.int64).reshape(-1)
    span = np.full(ids.shape, int(kind), np.int32)
    if tokens is not None:
        span[np.isin(ids, list(tokens.boundary_ids))] = SpanKind.BOUNDARY
    embeds, mask = adapters.place_embeds(ids, [], hidden_size)
    return adapters.make_chunk(ids, _positions(ids.shape[0]), span, unit, answer_tokens=answer_tokens,
                               answer_unit=answer_unit, embeds=embeds, embed_mask=mask)


def _positions(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int32)[None]  # [1, n]: one position axis


__all__ = [
    "MINICPMO_2_6", "MINICPMO_4_5", "MiniCPMTokens", "QUERY_NUM", "TOKEN_TEXT", "concat", "duplex_unit",
    "image_token_count", "omni_unit_2_6", "response_unit", "slice_grid", "system_unit", "text_unit", "token_layout",
    "unit_chunk", "with_embeds",
]
