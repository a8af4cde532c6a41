"""The Qwen3-Omni talker's decoding loop over `talker_forward`'s compiled steps: `TalkerDecode` (one sequence,
one step at a time, the text rows handed in by the caller), `greedy_frames` / `generate_greedy` (the reference's
talker `generate` under greedy decoding, frame by frame or whole), and `TalkerSampling` (the reference's default
sampled decoding: the talker's first codebook and the code predictor's residual codebooks drawn).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from omnijax.decoding import Sampling
from omnijax.kept_executables import cached_jit
from omnijax.kv import paged as paged_lib
from omnijax.models.qwen3_omni import talker_forward
from omnijax.models.qwen3_omni.talker import TalkerConfig
from omnijax.models.talker_kv import bounded_capacity
from omnijax.retention import base as retention_base

__all__ = ["TalkerDecode", "TalkerSampling", "generate_greedy", "greedy_frames", "talker_scores", "trim_talker"]

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class TalkerSampling:
    """Sampled speech, as the reference's `generate(..., talker_do_sample=True)` (its default) draws it.

    Attributes:
        temperature, top_k, top_p, repetition_penalty: the talker's first-codebook draw (the reference's
            `talker_temperature` 0.9, `talker_top_k` 50, `talker_top_p` 1.0, `talker_repetition_penalty` 1.05; the
            penalty reads the talker's own tokens so far, as the reference's generate starts from embeddings only),
            after the control ids are suppressed.
        predictor_top_k, predictor_top_p: the code predictor's draws of codebooks 1 .. Q-1 (temperature 1; the
            reference hard-codes 50 and 0.8).
        seed: the draws' seed: token n uses `fold_in(fold_in(key(seed), 0), n)`, frame n's codebook g + 1
            `fold_in(fold_in(fold_in(key(seed), 1), n), g)`. Same seed, same speech; transformers' torch draws
            cannot be reproduced, only their distribution.
    """

    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    predictor_top_k: int = 50
    predictor_top_p: float = 0.8
    seed: int = 0

    def __post_init__(self):
        self.talker, self.predictor  # noqa: B018 -- each setting checked now, named as the field
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"TalkerSampling seed must be an int, got {self.seed!r}")

    @property
    def talker(self) -> Sampling:
        """The talker's warp (its seed left 0: the keys come from `seed`, so every seed shares one compiled draw)."""
        return Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                        repetition_penalty=self.repetition_penalty)

    @property
    def predictor(self) -> Sampling:
        try:
            return Sampling(top_k=self.predictor_top_k, top_p=self.predictor_top_p)
        except ValueError as e:
            raise ValueError(f"TalkerSampling predictor_{str(e).partition(': ')[2]}") from None


def talker_scores(logits: jax.Array, banned: jax.Array, history: jax.Array, sampling: Sampling) -> jax.Array:
    """The talker's warped scores `[B, V]` (traceable): the `banned [V]` ids suppressed, then `sampling`'s repetition
    penalty over `history [B, N]` (-1 = padding), temperature, top-k and top-p, in transformers' processor order
    (the suppression commutes with the penalty)."""
    return sampling.warp(jnp.where(banned, -jnp.inf, logits), history)


@cached_jit(static_argnames="sampling")
def _draw(logits: jax.Array, banned: jax.Array, history: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """`[1]` int32: a draw from `talker_scores` with `key` (one PRNG key)."""
    return jax.random.categorical(key, talker_scores(logits, banned, history, sampling)[0])[None].astype(jnp.int32)


@cached_jit(static_argnames=("config", "policy"))
def trim_talker(config: TalkerConfig, policy: Any, kv: paged_lib.PagedKV, next_pos: jax.Array,
                active: jax.Array | None = None) -> tuple[paged_lib.PagedKV, jax.Array]:
    """The talker's cache trimmed by `policy` (`omnijax.models.talker_kv`; positions kept, so `next_pos [B]` is
    unchanged); `active [B]`: the rows that wrote (default all). Returns `(kv, evicted [B])`."""
    c = config.decoder
    kv, _, evicted = retention_base.trim(policy, kv, next_pos, rope=(c.rope_base, c.mrope_section), active=active)
    return kv, evicted


class TalkerDecode:
    """The reference talker's decoding of one sequence, one step at a time, the text rows handed in by the caller
    (what `greedy_frames` and a talker that runs while the thinker still writes its answer both step): greedy, or
    drawn as `sampling` says.

    The prefill runs at construction; `advance(row)` runs one `talker_step` with the text row of step `step`
    (`trailing[step]`, or the projected `tts_pad` past the trailing rows) and returns the codec frame `[Q]` int32
    of the previous token. `done`: the talker ended the speech (`codec_eos_token_id`) or reached `max_new_tokens`.
    `tokens` holds the talker's tokens so far (the prefill's first). `policy`: None (the cache holds the prompt and
    every step: what equals the reference), or a retention policy with a cell budget (`talker_kv.talker_policy`):
    the cache is built for its budget and trimmed after the prefill and after every step.
    """

    def __init__(self, config: TalkerConfig, params: Params, prompt: jax.Array, positions: Any, *,
                 max_new_tokens: int, suppress: Sequence[int] = (), page_size: int = 64,
                 tokens: list[int] | None = None, sampling: TalkerSampling | None = None, policy: Any = None):
        mask = np.zeros((config.decoder.vocab_size,), bool)
        mask[list(suppress)] = True
        self._banned = jnp.asarray(mask)
        self.config, self.params, self.max_new_tokens = config, params, int(max_new_tokens)
        self.sampling = sampling
        if sampling is not None:
            base = jax.random.key(sampling.seed)
            self._keys = (jax.random.fold_in(base, 0), jax.random.fold_in(base, 1))
            self._history = np.full((1, self.max_new_tokens), -1, np.int32)
        self.tokens = [] if tokens is None else tokens
        self.step = 0
        self.policy = policy
        T = prompt.shape[0]
        cells = T + self.max_new_tokens if policy is None else bounded_capacity(policy, T, page_size)
        kv = talker_forward.init_cache(config, 1, cells, page_size)
        self._kv, self._hidden, logits = talker_forward.prefill(config, params, kv, prompt[None],
                                                  jnp.asarray(positions, jnp.float32)[:, None])
        self._token = self._pick(logits)
        self._start = int(np.max(np.asarray(positions))) + 1
        self._trim(self._start)

    def _trim(self, next_pos: int) -> None:
        if self.policy is not None:
            self._kv, _ = trim_talker(self.config, self.policy, self._kv, jnp.asarray([next_pos], jnp.int32))

    def _pick(self, logits: jax.Array) -> jax.Array:
        if self.sampling is None:
            token = jnp.argmax(jnp.where(self._banned, -jnp.inf, logits), axis=-1).astype(jnp.int32)
        else:
            n = len(self.tokens)
            token = _draw(logits, self._banned, jnp.asarray(self._history),
                          jax.random.fold_in(self._keys[0], n), self.sampling.talker)
            self._history[0, n] = int(token[0])
        self.tokens.append(int(token[0]))
        return token

    @property
    def done(self) -> bool:
        return self.tokens[-1] == self.config.codec_eos_token_id or self.step >= self.max_new_tokens - 1

    def advance(self, row: jax.Array) -> np.ndarray:
        """One talker step with the text row `[D]` of step `self.step`; returns the previous token's frame `[Q]`."""
        if self.done:
            raise ValueError("the talker has ended this speech (codec end or max_new_tokens)")
        more = {} if self.sampling is None else {
            "key": jax.random.fold_in(self._keys[1], self.step)[None], "predictor": self.sampling.predictor}
        position = jnp.asarray([self._start + self.step], jnp.int32)
        self._kv, codes, self._hidden, logits = talker_forward.talker_step(
            self.config, self.params, self._kv, self._hidden, self._token, row[None], position, **more)
        self._trim(self._start + self.step + 1)
        self._token = self._pick(logits)
        self.step += 1
        return np.asarray(codes[0])


def generate_greedy(config: TalkerConfig, params: Params, prompt: jax.Array, positions: jax.Array,
                    trailing: jax.Array, tts_pad: jax.Array, *, max_new_tokens: int,
                    suppress: Sequence[int] = (), page_size: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """The reference talker's `generate` under greedy decoding, one sequence.

    Args:
        prompt: `[T, D]` the talker's input embeddings (user parts and `assistant_prompt`).
        positions: `[3, T]` their mrope positions; decoding continues at `positions.max() + 1`, one per token.
        trailing: `[N, D]` text rows added at decoding steps 0 .. N-1; `tts_pad [D]` afterwards.
        max_new_tokens: talker tokens to generate (the reference's count: the prefill's token included).
        suppress: codec ids never chosen (the reference suppresses its control ids).

    Returns:
        `(tokens [n] int32, codes [Q, n - 1] int32)`: the talker's tokens, stopping after `codec_eos_token_id`, and
        the frames of all but the last token (what the reference hands Code2Wav).
    """
    tokens: list[int] = []
    frames = list(greedy_frames(config, params, prompt, positions, trailing, tts_pad, max_new_tokens=max_new_tokens,
                                suppress=suppress, page_size=page_size, tokens=tokens))
    codes_out = np.stack(frames, axis=1) if frames else np.zeros((config.num_code_groups, 0), np.int32)
    return np.asarray(tokens, np.int32), codes_out


def greedy_frames(config: TalkerConfig, params: Params, prompt: jax.Array, positions: jax.Array,
                  trailing: jax.Array, tts_pad: jax.Array, *, max_new_tokens: int, suppress: Sequence[int] = (),
                  page_size: int = 64, tokens: list[int] | None = None, sampling: TalkerSampling | None = None,
                  policy: Any = None) -> Iterator[np.ndarray]:
    """`generate_greedy` one frame at a time: yields each codec frame `[Q]` int32 as soon as its talker step ran
    (the prefill runs at the first `next`); the talker's tokens are appended to `tokens` when given. With
    `sampling`, talker and code predictor draw instead (`TalkerSampling`); `policy`: a bounded talker cache
    (`TalkerDecode`)."""
    run = TalkerDecode(config, params, prompt, positions, max_new_tokens=max_new_tokens, suppress=suppress,
                       page_size=page_size, tokens=tokens, sampling=sampling, policy=policy)
    while not run.done:
        yield run.advance(trailing[run.step] if run.step < trailing.shape[0] else tts_pad)
