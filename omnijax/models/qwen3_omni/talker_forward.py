"""The Qwen3-Omni talker's math (`talker.py` holds its config and parameters): pure functions of a pure-dict
parameter tree (`talker_params`) and the static `TalkerConfig`, jit-compiled.

- `project_text` / `project_hidden`: the two ResizeMLPs (thinker width -> talker width).
- `talker_chunk`: writes a chunk of summed input embeddings `[B, T, D]` at mrope positions `[3, B, T]` through the
  talker decoder over a paged KV cache (`omnijax.kv.paged`), returning the final-normed hidden states and the codec
  logits (the shared decoder's `layer_qkv` / `layer_finish` / MoE with the talker's shared expert added).
- `talker_logits`: a one-shot forward through a temporary cache (what transformers' talker forward returns).
- `predictor_logits`: the code predictor on a whole sequence with head `g` (transformers' predictor forward).
- `predict_codes`: one frame's residual codebooks 1 .. Q-1, greedy, as one compiled loop over a dense KV buffer.
- `talker_step`: one frame: the predictor fills the previous token's frame, the frame's embeddings plus a text row
  become the talker's next input, the talker writes it and returns the next first-codebook logits. `rows_step` /
  `rows_prefill`: the same over the rows of a cache several sessions share (only active rows write): what the
  serving engine batches (`omnijax.serve.engine.speech`).
- `user_prompt`: a user turn's talker rows (projected thinker embedding rows; hidden rows at placeholders).
- `assistant_prompt`: the talker's assistant-turn prefix and the trailing text rows, as the reference builds them.
- `talker_prompt`: a whole conversation's talker input (system turns skipped, user turns, the answer's prefix).
- The decoding loops over these (greedy and sampled) are in `talker_decode`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omnijax.chunks.spans import SpanKind
from omnijax.decoding import Sampling
from omnijax.kept_executables import cached_jit
from omnijax.kv import attention as attention_lib
from omnijax.kv import paged as paged_lib
from omnijax.kv.paged import write_layer
from omnijax.models.config import DecoderConfig
from omnijax.models.decoder import chunk_rotation, layer_finish, layer_qkv, mlp
from omnijax.models.encoders.common import dense
from omnijax.models.layers import rms_norm
from omnijax.models.qwen3_omni.talker import Talker, TalkerConfig
from omnijax.models.speech import talker_cache

__all__ = ["ChatTokens", "assistant_prompt", "init_cache", "predict_codes", "predictor_logits", "project_hidden",
           "prefill", "project_text", "rows_prefill", "rows_step", "talker_chunk", "talker_logits", "talker_params",
           "talker_prompt", "talker_step", "user_prompt"]

Params = dict[str, Any]


def talker_params(model: Talker) -> Params:
    """The module's parameters as the pure-dict tree these functions take."""
    return nnx.to_pure_dict(nnx.state(model))


def _resize(p: Params, x: jax.Array, dtype) -> jax.Array:
    h = jax.nn.silu(dense(x.astype(dtype), p["fc1"], p["fc1_bias"], jnp.float32)).astype(dtype)
    return dense(h, p["fc2"], p["fc2_bias"], dtype)


@cached_jit(static_argnames="config")
def project_text(config: TalkerConfig, params: Params, thinker_embeds: jax.Array) -> jax.Array:
    """`text_projection` of thinker embedding-layer rows `[..., Dt]` -> `[..., D]`."""
    return _resize(params["text_projection"], thinker_embeds, config.jnp_dtype)


@cached_jit(static_argnames="config")
def project_hidden(config: TalkerConfig, params: Params, thinker_hidden: jax.Array) -> jax.Array:
    """`hidden_projection` of thinker layer-`accept_hidden_layer` rows `[..., Dt]` -> `[..., D]`."""
    return _resize(params["hidden_projection"], thinker_hidden, config.jnp_dtype)


# ------------------------------------------------------------------------------------------------- the decoder


def _shared_expert(c: DecoderConfig, p: Params, x: jax.Array) -> jax.Array:
    """The layer's shared SwiGLU expert, scaled by `sigmoid(x @ gate)` (normalised `x [B, T, D]`)."""
    dt = c.jnp_dtype
    gate = dense(x, p["shared_gate_proj"], None, jnp.float32)
    up = dense(x, p["shared_up_proj"], None, jnp.float32)
    out = dense(jax.nn.silu(gate.astype(dt)) * up.astype(dt), p["shared_down_proj"], None, dt)
    return jax.nn.sigmoid(dense(x, p["shared_gate"], None, dt)) * out


def _talker_layers(c: DecoderConfig, params: Params, x: jax.Array, positions: jax.Array,
                   cache: attention_lib.CacheView, k_pages: jax.Array, v_pages: jax.Array
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    rot = chunk_rotation(c, positions)
    cache = attention_lib.index_pages(cache)
    xs = {**params["layers"], **{"shared_" + k: v for k, v in params["shared"].items()}}

    def layer(carry, p):
        h, k_pages, v_pages, i = carry
        q, k, v = layer_qkv(c, p, h, rot)
        k_pages = write_layer(k_pages, cache.write_slots, k, layer=i)
        v_pages = write_layer(v_pages, cache.write_slots, v, layer=i)
        attn = attention_lib.attend(q, k_pages, v_pages, cache, layer=i)
        h = layer_finish(c, p, h, attn, lambda n: mlp(c, p, n) + _shared_expert(c, p, n))
        return (h, k_pages, v_pages, i + 1), None

    (h, k_pages, v_pages, _), _ = jax.lax.scan(layer, (x.astype(c.jnp_dtype), k_pages, v_pages, jnp.int32(0)), xs)
    return h, k_pages, v_pages


def init_cache(config: TalkerConfig, batch: int, tokens: int, page_size: int = 64) -> paged_lib.PagedKV:
    """An empty paged cache holding `tokens` talker tokens per sequence."""
    return talker_cache(config.decoder, batch, tokens, page_size)


def _codec_logits(c: DecoderConfig, params: Params, hidden: jax.Array) -> tuple[jax.Array, jax.Array]:
    normed = rms_norm(hidden, params["final_norm"], c.rms_norm_eps)
    return normed, jnp.einsum("...d,dv->...v", normed, params["codec_head"], preferred_element_type=jnp.float32)


def talker_chunk(config: TalkerConfig, params: Params, kv: paged_lib.PagedKV, embeds: jax.Array, valid: jax.Array,
                 positions: jax.Array) -> tuple[paged_lib.PagedKV, jax.Array, jax.Array]:
    """Writes a chunk of talker inputs through every layer (traceable; call under jit).

    Args:
        embeds: `[B, T, D]` summed input embeddings (projected thinker rows + codec embeddings).
        valid: `[B, T]` real tokens.
        positions: `[3, B, T]` mrope positions.

    Returns:
        `(kv, hidden [B, T, D] final-normed, logits [B, T, V] float32)`.
    """
    c = config.decoder
    zeros = jnp.zeros(valid.shape, jnp.int32)
    meta = paged_lib.SlotMeta(pos=jnp.floor(positions).astype(jnp.int32), unit=zeros,
                              span=zeros + int(SpanKind.TEXT), offset=zeros)
    kv, slots, q_order = paged_lib.reserve(kv, valid, meta)
    view = attention_lib.CacheView.of(kv, slots, q_order)
    hidden, k, v = _talker_layers(c, params, embeds, positions, view, kv.k, kv.v)
    normed, logits = _codec_logits(c, params, hidden)
    return kv.replace(k=k, v=v), normed, logits


@cached_jit(static_argnames=("config", "page_size"))
def talker_logits(config: TalkerConfig, params: Params, embeds: jax.Array, positions: jax.Array, *,
                  page_size: int = 64) -> jax.Array:
    """One-shot talker forward: `embeds [B, T, D]`, `positions [3, B, T]` -> codec logits `[B, T, V]` float32."""
    B, T, _ = embeds.shape
    kv = init_cache(config, B, T, page_size)
    return talker_chunk(config, params, kv, embeds, jnp.ones((B, T), bool), positions)[2]


# ------------------------------------------------------------------------------------------ the code predictor


def _predictor_layers(c: DecoderConfig, params: Params, x: jax.Array, start: jax.Array | int, keys: jax.Array,
                      values: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The predictor's layers on `x [B, T, D]` at positions `start ..`, over a dense KV buffer `[L, B, S, G, d]`
    (written at `start ..`; a query attends to the buffer's slots up to its own position)."""
    B, T, _ = x.shape
    S = keys.shape[2]
    pos = start + jnp.arange(T, dtype=jnp.int32)
    rot = chunk_rotation(c, jnp.broadcast_to(pos, (1, B, T)))
    visible = jnp.arange(S)[None, :] <= pos[:, None]  # [T, S]
    rep = c.num_heads // c.num_kv_heads

    def layer(carry, xs):
        h, i = carry
        p, k_all, v_all = xs
        q, k, v = layer_qkv(c, p, h, rot)
        k_all = jax.lax.dynamic_update_slice_in_dim(k_all, k.astype(k_all.dtype), start, axis=1)
        v_all = jax.lax.dynamic_update_slice_in_dim(v_all, v.astype(v_all.dtype), start, axis=1)
        qg = q.reshape(B, T, c.num_kv_heads, rep, c.head_dim)
        scores = jnp.einsum("btgrd,bsgd->bgrts", qg, k_all, preferred_element_type=jnp.float32) * c.head_dim ** -0.5
        probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
        attn = jnp.einsum("bgrts,bsgd->btgrd", probs.astype(v_all.dtype), v_all, preferred_element_type=jnp.float32)
        h = layer_finish(c, p, h, attn.astype(c.jnp_dtype).reshape(B, T, c.num_heads, c.head_dim))
        return (h, i + 1), (k_all, v_all)

    (h, _), (keys, values) = jax.lax.scan(layer, (x.astype(c.jnp_dtype), 0), (params["layers"], keys, values))
    return rms_norm(h, params["final_norm"], c.rms_norm_eps), keys, values


def _empty_buffer(c: DecoderConfig, batch: int, slots: int) -> jax.Array:
    return jnp.zeros((c.num_layers, batch, slots, c.num_kv_heads, c.head_dim), c.jnp_dtype)


def _head(params: Params, hidden: jax.Array, g: jax.Array | int) -> jax.Array:
    w = jax.lax.dynamic_index_in_dim(params["lm_head"], g, keepdims=False)
    return jnp.einsum("...d,dv->...v", hidden, w, preferred_element_type=jnp.float32)


@cached_jit(static_argnames="config")
def predictor_logits(config: TalkerConfig, params: Params, embeds: jax.Array, head: int | jax.Array) -> jax.Array:
    """The code predictor on a whole sequence `embeds [B, T, D]` (positions 0 .. T-1), logits of head `head`
    (codebook `head + 1`) at every position: `[B, T, Vp]` float32."""
    pred, c = params["code_predictor"], config.predictor
    B, T, _ = embeds.shape
    hidden, _, _ = _predictor_layers(c, pred, embeds, 0, _empty_buffer(c, B, T), _empty_buffer(c, B, T))
    return _head(pred, hidden, head)


def _choose(logits: jax.Array, g: jax.Array | int, key: jax.Array | None, sampling: Sampling | None) -> jax.Array:
    """`[B]` int32: the argmax of `logits [B, V]`, or a draw of `sampling` with keys `key [B]` folded with `g`."""
    if sampling is None or key is None:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return sampling.select(logits, None, jax.vmap(lambda k: jax.random.fold_in(k, g))(key))


def _frame_codes(config: TalkerConfig, params: Params, past_hidden: jax.Array, code0: jax.Array,
                 key: jax.Array | None = None, sampling: Sampling | None = None) -> tuple[jax.Array, jax.Array]:
    """Codebooks 1 .. Q-1 of a frame and the sum of its Q codebook embeddings (traceable): greedy, or drawn by
    `sampling` with the frame's PRNG keys `key [B]` (codebook g + 1 with `key` folded with g).

    Args:
        past_hidden: `[B, D]` the talker's final-normed hidden state at the position that produced `code0`.
        code0: `[B]` the frame's first codebook (the talker's token).

    Returns:
        `(codes [B, Q] int32, embedding sum [B, D])`.
    """
    pred, c, Q = params["code_predictor"], config.predictor, config.num_code_groups
    B = code0.shape[0]
    first = jnp.take(params["codec_embedding"], code0, axis=0)  # the talker's embedding of codebook 0
    x = jnp.stack([past_hidden.astype(c.jnp_dtype), first], axis=1)  # [B, 2, D]
    keys, values = _empty_buffer(c, B, Q), _empty_buffer(c, B, Q)
    hidden, keys, values = _predictor_layers(c, pred, x, 0, keys, values)
    code = _choose(_head(pred, hidden[:, -1], 0), 0, key, sampling)
    codes = jnp.zeros((B, Q), jnp.int32).at[:, 0].set(code0).at[:, 1].set(code)
    total = first.astype(jnp.float32)

    def step(g, carry):  # feeds codebook g, predicts g + 1
        codes, keys, values, total = carry
        emb = jnp.take(jax.lax.dynamic_index_in_dim(pred["codec_embedding"], g - 1, keepdims=False),
                       codes[:, g], axis=0)  # [B, D]
        hidden, keys, values = _predictor_layers(c, pred, emb[:, None], g + 1, keys, values)
        nxt = _choose(_head(pred, hidden[:, 0], g), g, key, sampling)
        return codes.at[:, g + 1].set(nxt), keys, values, total + emb.astype(jnp.float32)

    codes, _, _, total = jax.lax.fori_loop(1, Q - 1, step, (codes, keys, values, total))
    last = jnp.take(pred["codec_embedding"][Q - 2], codes[:, Q - 1], axis=0)
    return codes, (total + last.astype(jnp.float32)).astype(config.jnp_dtype)


@cached_jit(static_argnames="config")
def predict_codes(config: TalkerConfig, params: Params, past_hidden: jax.Array, code0: jax.Array) -> jax.Array:
    """A frame's Q codes `[B, Q]` int32: `code0 [B]` and the predictor's greedy codebooks 1 .. Q-1 given the talker's
    final-normed hidden state `past_hidden [B, D]` at the position that produced `code0`."""
    return _frame_codes(config, params, past_hidden, code0)[0]


def rows_step(config: TalkerConfig, params: Params, kv: paged_lib.PagedKV, past_hidden: jax.Array,
              code0: jax.Array, text_row: jax.Array, position: jax.Array, active: jax.Array | None = None,
              key: jax.Array | None = None, predictor: Sampling | None = None
              ) -> tuple[paged_lib.PagedKV, jax.Array, jax.Array, jax.Array]:
    """`talker_step` traceable (call under jit), over the rows of a shared cache: only the rows where `active [B]`
    is True write their token (None: every row), so sessions at different steps share one batched call; the other
    rows' outputs are computed and meaningless."""
    codes, frame = _frame_codes(config, params, past_hidden, code0, key, predictor)
    x = (frame + text_row.astype(frame.dtype))[:, None]
    B = code0.shape[0]
    pos = jnp.broadcast_to(position.astype(jnp.float32)[None, :, None], (3, B, 1))
    valid = jnp.ones((B, 1), bool) if active is None else active.astype(bool)[:, None]
    kv, hidden, logits = talker_chunk(config, params, kv, x, valid, pos)
    return kv, codes, hidden[:, 0], logits[:, 0]


@cached_jit(static_argnames=("config", "predictor"))
def talker_step(config: TalkerConfig, params: Params, kv: paged_lib.PagedKV, past_hidden: jax.Array,
                code0: jax.Array, text_row: jax.Array, position: jax.Array, key: jax.Array | None = None,
                predictor: Sampling | None = None) -> tuple[paged_lib.PagedKV, jax.Array, jax.Array, jax.Array]:
    """One talker frame, the predictor and the talker fused in one compiled call (the predictor greedy, or drawing
    with `predictor` and the frame's keys `key [B]`).

    Args:
        kv: the talker's cache after the previous token.
        past_hidden: `[B, D]` final-normed hidden state of the previous position (it produced `code0`).
        code0: `[B]` the previous token (the frame's first codebook).
        text_row: `[B, D]` the projected thinker text row for this step (or the projected `tts_pad`).
        position: `[B]` the new token's position (all three mrope axes).

    Returns:
        `(kv, codes [B, Q] of code0's frame, hidden [B, D] final-normed at the new position, logits [B, V])`.
    """
    return rows_step(config, params, kv, past_hidden, code0, text_row, position, key=key, predictor=predictor)


def rows_prefill(config: TalkerConfig, params: Params, kv: paged_lib.PagedKV, embeds: jax.Array, valid: jax.Array,
                 positions: jax.Array) -> tuple[paged_lib.PagedKV, jax.Array, jax.Array]:
    """Prompts written into some rows of a shared cache (traceable): `embeds [B, T, D]`, `valid [B, T]` (a row's
    prompt left-aligned; rows without one all False), `positions [3, B, T]`. Returns `(kv, hidden [B, D], logits
    [B, V])` at each row's last valid position (meaningless for rows without a prompt)."""
    kv, hidden, logits = talker_chunk(config, params, kv, embeds, valid, positions)
    last = jnp.maximum(jnp.sum(valid, axis=1) - 1, 0)
    take = lambda x: jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]  # noqa: E731
    return kv, take(hidden), take(logits)


@cached_jit(static_argnames="config")
def prefill(config: TalkerConfig, params: Params, kv: paged_lib.PagedKV, embeds: jax.Array, positions: jax.Array
            ) -> tuple[paged_lib.PagedKV, jax.Array, jax.Array]:
    """A talker prompt `embeds [B, T, D]` at mrope `positions [3, B, T]` written into `kv`; returns `(kv, hidden
    [B, D], logits [B, V])` at the last position (what a decoding loop starts from)."""
    B, T, _ = embeds.shape
    kv, hidden, logits = talker_chunk(config, params, kv, embeds, jnp.ones((B, T), bool), positions)
    return kv, hidden[:, -1], logits[:, -1]


# --------------------------------------------------------------------------------------------- prompt, generate


@cached_jit(static_argnames="config")
def user_prompt(config: TalkerConfig, params: Params, thinker_embeds: jax.Array, thinker_hidden: jax.Array,
                multimodal: jax.Array) -> jax.Array:
    """The talker input of a user turn, as the reference's `_get_talker_user_parts` builds it: per token, the
    projected layer-`accept_hidden_layer` row (`thinker_hidden`) at audio / image / video placeholders
    (`multimodal [T]` bool), else the projected embedding-layer row (`thinker_embeds`); rows `[T, Dt]` -> `[T, D]`.
    (No codec embedding is added to user rows.)"""
    return jnp.where(multimodal[:, None], _resize(params["hidden_projection"], thinker_hidden, config.jnp_dtype),
                     _resize(params["text_projection"], thinker_embeds, config.jnp_dtype))


def assistant_prompt(config: TalkerConfig, params: Params, thinker_embeds: jax.Array, speaker: str,
                     tts_embeds: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The talker input of the answered assistant turn, as the reference's `_get_talker_assistant_parts` builds it.

    Args:
        thinker_embeds: `[T, Dt]` the thinker's embedding-layer rows of the turn, from `<|im_start|>` on (the
            `assistant` role token and its newline, then the answer's text); T >= 4.
        speaker: a speaker name of the checkpoint (`TalkerConfig.speaker`).
        tts_embeds: `[3, Dt]` the thinker's embeddings of `tts_bos`, `tts_eos`, `tts_pad` (in that order).

    Returns:
        `(prompt [9, D], trailing [T - 3, D])`: the 9 prefix rows (3 role rows; 4 `tts_pad` rows with the codec's
        nothink / think_bos / think_eos / speaker; `tts_bos` with `codec_pad`; the first answer token with
        `codec_bos`) and the text rows the talker adds one per later step (answer tokens 2.., then `tts_eos`).
    """
    if thinker_embeds.shape[0] < 4:
        raise ValueError(f"thinker_embeds must hold >= 4 rows (<|im_start|>, role, newline, first text token), got "
                         f"{thinker_embeds.shape[0]}")
    speaker_id = config.speaker(speaker)
    text = project_text(config, params, thinker_embeds)
    bos, eos, pad = project_text(config, params, tts_embeds)
    rows = jnp.concatenate([text[:3], jnp.broadcast_to(pad, (4, pad.shape[-1])), bos[None], text[3:4]])
    codec_ids = jnp.asarray([config.codec_nothink_id, config.codec_think_bos_id, config.codec_think_eos_id,
                             speaker_id, config.codec_pad_id, config.codec_bos_id])
    codec = jnp.take(params["codec_embedding"], codec_ids, axis=0)
    codec = jnp.concatenate([jnp.zeros((3, codec.shape[-1]), codec.dtype), codec])
    return rows + codec, jnp.concatenate([text[4:], eos[None]])


@dataclasses.dataclass(frozen=True)
class ChatTokens:
    """The thinker-side ids that cut a conversation into turns for the talker (the full config's, not the talker's).

    Attributes:
        im_start, system, user, assistant: `<|im_start|>` and the role tokens after it.
        tts_pad: the id the reference gives the assistant prefix in the talker's input ids (positions only).
        multimodal: the thinker's audio / image / video placeholder ids.
    """

    im_start: int
    system: int
    user: int
    assistant: int
    tts_pad: int
    multimodal: tuple[int, ...]


def talker_prompt(config: TalkerConfig, params: Params, prompt_ids: np.ndarray, sequence: np.ndarray,
                  thinker_embeds: jax.Array, thinker_hidden: jax.Array, tts_embeds: jax.Array, *, speaker: str,
                  chat: ChatTokens) -> tuple[jax.Array, np.ndarray, jax.Array]:
    """The talker's whole input for one conversation, as the reference's `generate` assembles it: system turns
    skipped, user turns (`user_prompt`), earlier assistant turns skipped, the last turn (the answer) as
    `assistant_prompt`.

    Args:
        prompt_ids: `[T0]` the thinker's prompt (turns are found from its `<|im_start|>`s).
        sequence: `[T]` prompt and answer.
        thinker_embeds, thinker_hidden: `[>= T - 1, Dt]` the thinker's embedding-layer rows and layer
            `accept_hidden_layer` rows of `sequence` (the reference has every row but the last token's).
        tts_embeds: `[3, Dt]` the thinker's embeddings of `tts_bos`, `tts_eos`, `tts_pad`.

    Returns:
        `(rows [T', D], talker_input_ids [T'], trailing [N, D])`: the talker ids give its positions (thinker-style
        `get_rope_index` over them).

    Raises:
        ValueError: a turn with an unknown role, or a last turn that is not the assistant's.
    """
    prompt_ids, sequence = np.asarray(prompt_ids), np.asarray(sequence)
    starts = list(np.flatnonzero(prompt_ids == chat.im_start)) + [len(sequence)]
    rows, ids, trailing = [], [], None
    multimodal = np.isin(sequence, chat.multimodal)
    for i, (start, end) in enumerate(zip(starts[:-1], starts[1:])):
        role, last = int(prompt_ids[start + 1]), i == len(starts) - 2
        if role == chat.system or (role == chat.assistant and not last):
            continue
        if role == chat.user:
            rows.append(user_prompt(config, params, thinker_embeds[start:end], thinker_hidden[start:end],
                                    jnp.asarray(multimodal[start:end])))
            ids.append(sequence[start:end])
        elif role == chat.assistant:
            prefix, trailing = assistant_prompt(config, params, thinker_embeds[start:end], speaker, tts_embeds)
            rows.append(prefix)
            ids.append(np.full((prefix.shape[0],), chat.tts_pad, sequence.dtype))
        else:
            raise ValueError(f"turn {i} at token {start} has role token {role}, not system {chat.system}, user "
                             f"{chat.user} or assistant {chat.assistant}")
        if last and role != chat.assistant:
            raise ValueError("the last turn must be the assistant's answer (the talker speaks it)")
    if trailing is None:
        raise ValueError("the conversation has no assistant turn to speak")
    return jnp.concatenate(rows), np.concatenate(ids), trailing
