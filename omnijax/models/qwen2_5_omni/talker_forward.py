"""The Qwen2.5-Omni talker's math (`talker.py` holds its config and parameters): pure functions of a pure-dict
parameter tree (`talker_params`) and the static `TalkerConfig`, jit-compiled.

- `talker_chunk`: projects a chunk of input rows `[B, T, Dt]` (`thinker_to_talker_proj`) and writes it through the
  talker decoder over a paged KV cache (`omnijax.kv.paged`) at TMRoPE positions `[3, B, T]`; codec logits out.
- `talker_logits`: a one-shot forward through a temporary cache (what transformers' talker forward returns for given
  `inputs_embeds`).
- `thinker_rows`: the thinker's embedding-layer rows and final-normed hidden states of a token sequence (one-shot),
  whose sum is what the reference's talker reads per thinker token.
- `talker_prompt`: the talker's prefill rows and trailing text rows, as `Qwen2_5OmniForConditionalGeneration.generate`
  builds them.
- `generate_greedy`: the reference talker's `generate` under greedy decoding (repetition penalty included).

What the reference's `generate` feeds the talker (one sequence, a text-only prompt of T0 tokens, an answer a_0 ..
a_{n-1} of which the thinker's generate returns the rows of all but the last):

    prefill:  r_0 .. r_{T0-1}, e(voice bos) + c(codec_pad), r_{T0} + c(codec_bos)   (T0 + 2 rows)
    step k:   c(token_k) + (r_{T0+1+k} while answer rows last; then e(text_eos) once; then e(text_pad) forever)

with r_i = thinker hidden_i (after the final norm) + thinker embedding_i, e() the thinker's embedding, c() the
talker's codec embedding. Positions: `get_rope_index` over the thinker-side ids (consecutive for a text prompt),
continued one per step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omnijax.chunks.spans import SpanKind
from omnijax.kept_executables import cached_jit
from omnijax.kv import attention as attention_lib
from omnijax.kv import layout
from omnijax.kv import paged as paged_lib
from omnijax.kv.paged import write_layer
from omnijax.models.decoder import Decoder, chunk_rotation, layer_finish, layer_qkv
from omnijax.models.encoders.common import dense
from omnijax.models.forward import write_chunk
from omnijax.models.layers import rms_norm
from omnijax.models.qwen2_5_omni.talker import Talker, TalkerConfig
from omnijax.models.speech import talker_cache
from omnijax.models.talker_kv import MIN_TALKER_WINDOW, bounded_capacity
from omnijax.retention import base as retention_base

__all__ = ["MIN_TALKER_WINDOW", "TalkerDecode", "TalkerKVReport", "generate_greedy", "greedy_tokens", "init_cache",
           "talker_chunk", "talker_logits", "talker_params", "talker_prompt", "thinker_rows"]

Params = dict[str, Any]


def talker_params(model: Talker) -> Params:
    """The module's parameters as the pure-dict tree these functions take."""
    return nnx.to_pure_dict(nnx.state(model))


def init_cache(config: TalkerConfig, batch: int, tokens: int, page_size: int = 64) -> paged_lib.PagedKV:
    """An empty paged cache holding `tokens` talker tokens per sequence."""
    return talker_cache(config.decoder, batch, tokens, page_size)


def talker_chunk(config: TalkerConfig, params: Params, kv: paged_lib.PagedKV, rows: jax.Array, valid: jax.Array,
                 positions: jax.Array) -> tuple[paged_lib.PagedKV, jax.Array]:
    """Writes a chunk of talker input rows through every layer (traceable; call under jit).

    Args:
        rows: `[B, T, Dt]` input rows at the thinker's width (thinker rows and codec embeddings summed).
        valid: `[B, T]` real tokens.
        positions: `[3, B, T]` TMRoPE positions.

    Returns:
        `(kv, logits [B, T, V] float32)`.
    """
    c = config.decoder
    x = dense(rows.astype(c.jnp_dtype), params["proj"], params["proj_bias"], c.jnp_dtype)
    zeros = jnp.zeros(valid.shape, jnp.int32)
    meta = paged_lib.SlotMeta(pos=positions.astype(jnp.int32), unit=zeros, span=zeros + int(SpanKind.TEXT),
                              offset=zeros)
    kv, slots, q_order = paged_lib.reserve(kv, valid, meta)
    cache = attention_lib.index_pages(attention_lib.CacheView.of(kv, slots, q_order))
    rot = chunk_rotation(c, positions)

    def layer(carry, p):
        h, k_pages, v_pages, i = carry
        q, k, v = layer_qkv(c, p, h, rot)
        k_pages = write_layer(k_pages, cache.write_slots, k, layer=i)
        v_pages = write_layer(v_pages, cache.write_slots, v, layer=i)
        h = layer_finish(c, p, h, attention_lib.attend(q, k_pages, v_pages, cache, layer=i))
        return (h, k_pages, v_pages, i + 1), None

    (h, k, v, _), _ = jax.lax.scan(layer, (x, kv.k, kv.v, jnp.int32(0)), params["layers"])
    normed = rms_norm(h, params["final_norm"], c.rms_norm_eps)
    logits = jnp.einsum("...d,dv->...v", normed, params["codec_head"], preferred_element_type=jnp.float32)
    return kv.replace(k=k, v=v), logits


@cached_jit(static_argnames=("config", "page_size"))
def talker_logits(config: TalkerConfig, params: Params, rows: jax.Array, positions: jax.Array, *,
                  page_size: int = 64) -> jax.Array:
    """One-shot talker forward: input rows `[B, T, Dt]`, positions `[3, B, T]` -> codec logits `[B, T, V]`."""
    B, T, _ = rows.shape
    kv = init_cache(config, B, T, page_size)
    return talker_chunk(config, params, kv, rows, jnp.ones((B, T), bool), positions)[1]


@cached_jit(static_argnames="graphdef")
def _thinker_rows(graphdef: nnx.GraphDef, state: nnx.State, ids: jax.Array, inputs: jax.Array | None,
                  positions: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    decoder = nnx.merge(graphdef, state)
    c = decoder.config
    T = ids.shape[0]
    page = 64
    pages = -(-T // page)
    kv = paged_lib.init(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, num_pages=pages,
                        page_size=page, batch=1, max_pages=pages, position_axes=c.position_axes, dtype=c.jnp_dtype)
    positions = (jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (c.position_axes, 1, T)) if positions is None
                 else positions.astype(jnp.int32)[:, None])
    zeros = jnp.zeros((1, T), jnp.int32)
    meta = paged_lib.SlotMeta(pos=positions[0], unit=zeros, span=zeros + int(SpanKind.TEXT), offset=zeros)
    x = decoder.embed_tokens(ids[None]) if inputs is None else inputs[None].astype(c.jnp_dtype)
    _, hidden = write_chunk(decoder, kv, x, jnp.ones((1, T), bool), positions, meta)
    return x[0], rms_norm(hidden, decoder.final_norm[...], c.rms_norm_eps)[0]


def thinker_rows(decoder: Decoder, ids: np.ndarray, inputs: jax.Array | None = None,
                 positions: np.ndarray | None = None) -> tuple[jax.Array, jax.Array]:
    """The thinker's embedding-layer rows and final-normed last-layer hidden states of a sequence `ids [T]`:
    `(embeds [T, Dt], hidden [T, Dt])`. `inputs [T, Dt]`: the input rows (the embeddings with the encoders'
    features at the placeholders) in place of the token embeddings. `positions [3, T]`: the TMRoPE positions
    (None: consecutive, as `get_rope_index` numbers text and audio)."""
    graphdef, state = nnx.split(decoder)
    return _thinker_rows(graphdef, state, jnp.asarray(ids, jnp.int32), inputs,
                         None if positions is None else jnp.asarray(positions, jnp.int32))


def talker_prompt(config: TalkerConfig, params: Params, embeds: jax.Array, hidden: jax.Array, prompt_len: int,
                  voice_bos: jax.Array, text_eos: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The talker's prefill rows and the text rows its decoding steps add (module docstring).

    Args:
        embeds, hidden: `[T, Dt]` the thinker's rows of prompt and answer (`thinker_rows`), T > prompt_len.
        prompt_len: T0, the prompt's tokens.
        voice_bos: `[Dt]` the thinker's embedding of the voice's start token.
        text_eos: `[Dt]` the thinker's embedding of `text_eos_id`.

    Returns:
        `(prefill [T0 + 2, Dt], trailing [T - T0, Dt])`: trailing holds answer rows 1 .. and then `text_eos`.
    """
    if embeds.shape[0] <= prompt_len:
        raise ValueError(f"the thinker rows hold {embeds.shape[0]} tokens: no answer row after the prompt's "
                         f"{prompt_len}")
    rows = (hidden + embeds).astype(jnp.float32)
    codec = params["codec_embedding"]
    pad_row = voice_bos.astype(jnp.float32) + codec[config.codec_pad_id].astype(jnp.float32)
    bos_row = rows[prompt_len] + codec[config.codec_bos_id].astype(jnp.float32)
    prefill = jnp.concatenate([rows[:prompt_len], pad_row[None], bos_row[None]])
    return prefill, jnp.concatenate([rows[prompt_len + 1:], text_eos.astype(jnp.float32)[None]])


@cached_jit(static_argnames="config")
def _prefill(config: TalkerConfig, params: Params, kv: paged_lib.PagedKV, rows: jax.Array, positions: jax.Array
             ) -> tuple[paged_lib.PagedKV, jax.Array]:
    kv, logits = talker_chunk(config, params, kv, rows[None], jnp.ones((1, rows.shape[0]), bool), positions[:, None])
    return kv, logits[0, -1]


@cached_jit(static_argnames="config")
def _step(config: TalkerConfig, params: Params, kv: paged_lib.PagedKV, token: jax.Array, row: jax.Array,
          position: jax.Array) -> tuple[paged_lib.PagedKV, jax.Array]:
    x = params["codec_embedding"][token].astype(jnp.float32) + row.astype(jnp.float32)
    pos = jnp.broadcast_to(position.astype(jnp.int32), (3, 1, 1))
    kv, logits = talker_chunk(config, params, kv, x[None, None], jnp.ones((1, 1), bool), pos)
    return kv, logits[0, 0]


def _pick(logits: np.ndarray, seen: np.ndarray, penalty: float, banned: np.ndarray) -> int:
    """transformers' greedy choice: the repetition penalty on every id of the talker's input so far (negative
    logits multiplied, positive ones divided), the suppressed ids at -inf, then argmax."""
    scores = logits.astype(np.float32).copy()
    if penalty != 1.0:
        picked = scores[seen]
        scores[seen] = np.where(picked < 0, picked * np.float32(penalty), picked / np.float32(penalty))
    scores[banned] = -np.inf
    return int(np.argmax(scores))


@dataclasses.dataclass
class TalkerKVReport:
    """What a bounded talker cache did (`greedy_tokens(..., report=...)`), updated as tokens are decoded.

    Attributes:
        retained: live cells after each write and trim (the prefill's first, then one per step).
        evicted: cells the policy dropped in all.
        capacity: cells the cache was built with (its pages x page size): memory does not grow past it.
        exhausted: a write found no room (sticky; the talker's later rows were not kept).
        dropped: rows not written because of exhaustion.
    """

    retained: list[int] = dataclasses.field(default_factory=list)
    evicted: int = 0
    capacity: int = 0
    exhausted: bool = False
    dropped: int = 0


@cached_jit(static_argnames=("config", "policy"))
def _trim(config: TalkerConfig, policy: Any, kv: paged_lib.PagedKV, next_pos: jax.Array
          ) -> tuple[paged_lib.PagedKV, jax.Array, jax.Array]:
    c = config.decoder
    kv, _, evicted = retention_base.trim(policy, kv, next_pos, rope=(c.rope_base, c.mrope_section))
    return kv, evicted[0], layout.layout_stats(kv).retained_cells[0]


class TalkerDecode:
    """The greedy talker of `greedy_tokens`, advanced one step at a time by its caller: built with the prefill (the
    first token chosen at once, `tokens[0]`), then `step(row)` per later token with the row that step adds. The
    early-starting spoken answer (`speech_stream.AnswerSpeech`) steps it as the thinker's rows arrive;
    `greedy_tokens` steps it with every row known: the same calls, so the same tokens.

    Args (as `greedy_tokens`'): the prefill rows `[T, Dt]` and their positions `[3, T]`, the limits, penalty,
    suppressed ids, page size, KV policy and report.
    """

    def __init__(self, config: TalkerConfig, params: Params, prefill: jax.Array, positions: np.ndarray, *,
                 prompt_ids: Sequence[int], max_new_tokens: int, repetition_penalty: float = 1.05,
                 suppress: Sequence[int] = (), page_size: int = 64, policy: Any = None,
                 report: TalkerKVReport | None = None):
        V = config.decoder.vocab_size
        self.config, self.params, self.policy, self.report = config, params, policy, report
        self.max_new_tokens, self.penalty = int(max_new_tokens), float(repetition_penalty)
        self.banned = np.zeros((V,), bool)
        self.banned[list(suppress)] = True
        self.seen = np.zeros((V,), bool)
        self.seen[np.asarray(prompt_ids, np.int64)] = True
        T = prefill.shape[0]
        cells = T + max_new_tokens if policy is None else bounded_capacity(policy, T, page_size)
        kv = init_cache(config, 1, cells, page_size)
        if report is not None:
            report.capacity = kv.num_pages * kv.page_size
        kv, logits = _prefill(config, params, kv, prefill, jnp.asarray(positions, jnp.int32))
        self.start = int(np.max(positions)) + 1
        self.kv = self._trimmed(kv, self.start)
        self.tokens: list[int] = [_pick(np.asarray(logits), self.seen, self.penalty, self.banned)]

    @property
    def done(self) -> bool:
        """The last token is a stop id, or `max_new_tokens` were chosen."""
        return self.tokens[-1] in self.config.stop_ids or len(self.tokens) >= self.max_new_tokens

    def step(self, row: jax.Array) -> int:
        """Feeds the last token with `row [Dt]` (the step's trailing row, or `text_pad`) and returns the next."""
        if self.done:
            raise ValueError("the talker has ended (a stop id or max_new_tokens): no further step")
        step, token = len(self.tokens) - 1, self.tokens[-1]
        self.seen[token] = True
        kv, logits = _step(self.config, self.params, self.kv, jnp.int32(token), row, jnp.int32(self.start + step))
        self.kv = self._trimmed(kv, self.start + step + 1)
        self.tokens.append(_pick(np.asarray(logits), self.seen, self.penalty, self.banned))
        return self.tokens[-1]

    def _trimmed(self, kv: paged_lib.PagedKV, next_pos: int) -> paged_lib.PagedKV:
        policy, report = self.policy, self.report
        if policy is not None:
            kv, evicted, retained = _trim(self.config, policy, kv, jnp.asarray([next_pos], jnp.int32))
        if report is not None:
            if policy is not None:
                report.evicted += int(evicted)
                report.retained.append(int(retained))
            else:
                report.retained.append(int(layout.layout_stats(kv).retained_cells[0]))
            report.exhausted, report.dropped = bool(kv.exhausted[0]), int(kv.dropped[0])
        return kv


def greedy_tokens(config: TalkerConfig, params: Params, prefill: jax.Array, positions: np.ndarray,
                  trailing: jax.Array, text_pad: jax.Array, *, prompt_ids: Sequence[int], max_new_tokens: int,
                  repetition_penalty: float = 1.05, suppress: Sequence[int] = (), page_size: int = 64,
                  policy: Any = None, report: TalkerKVReport | None = None) -> Iterator[int]:
    """`generate_greedy`'s tokens one at a time, each yielded as soon as it is chosen (the spoken path hands the
    codes to Token2Wav while the talker goes on; `TalkerDecode` steps). Arguments as `generate_greedy`, and:

    Args:
        policy: None (the cache holds the prefill and every step: what equals the reference), or a retention
            policy with a cell budget (`omnijax.retention.SinkWindow(sink, window)`, as the thinker's): the cache
            is built for the budget (`talker_kv.bounded_capacity`) and trimmed after the prefill and after every
            step, so its memory stays bounded over any length of speech.
        report: a `TalkerKVReport` filled as tokens are decoded (cells retained, evicted, exhaustion).

    Raises:
        ValueError: a policy without a budget, or keeping fewer than `MIN_TALKER_WINDOW` newest cells.
    """
    decode = TalkerDecode(config, params, prefill, positions, prompt_ids=prompt_ids, max_new_tokens=max_new_tokens,
                          repetition_penalty=repetition_penalty, suppress=suppress, page_size=page_size,
                          policy=policy, report=report)
    yield decode.tokens[0]
    while not decode.done:
        step = len(decode.tokens) - 1
        yield decode.step(trailing[step] if step < trailing.shape[0] else text_pad)


def generate_greedy(config: TalkerConfig, params: Params, prefill: jax.Array, positions: np.ndarray,
                    trailing: jax.Array, text_pad: jax.Array, *, prompt_ids: Sequence[int], max_new_tokens: int,
                    repetition_penalty: float = 1.05, suppress: Sequence[int] = (), page_size: int = 64,
                    policy: Any = None, report: TalkerKVReport | None = None) -> np.ndarray:
    """The reference talker's `generate` under greedy decoding, one sequence (`policy` / `report`: a bounded
    cache, as `greedy_tokens`).

    Args:
        prefill: `[T, Dt]` the prefill rows (`talker_prompt`); positions `[3, T]` theirs; decoding continues at
            `positions.max() + 1`, one per token.
        trailing: `[N, Dt]` rows added at decoding steps 0 .. N-1; `text_pad [Dt]` afterwards.
        prompt_ids: the talker's input ids of the prefill (codec mask ids, then codec pad and bos): what the
            repetition penalty reads besides the generated tokens.
        max_new_tokens: talker tokens at most (the reference's count: the prefill's token included).
        repetition_penalty: transformers' `repetition_penalty` (its `generate` passes 1.05 for the talker).
        suppress: codec ids never chosen (the reference suppresses the codec bos).

    Returns:
        `tokens [n] int32`: the generated codec tokens, ending with a stop id (`config.stop_ids`) when one came.
    """
    return np.asarray(list(greedy_tokens(config, params, prefill, positions, trailing, text_pad,
                                         prompt_ids=prompt_ids, max_new_tokens=max_new_tokens,
                                         repetition_penalty=repetition_penalty, suppress=suppress,
                                         page_size=page_size, policy=policy, report=report)), np.int32)
