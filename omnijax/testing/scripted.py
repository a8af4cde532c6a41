"""Scripted decoding and a tool-calling chat template, for tests of what a server does with a model's answer.

A tiny random-weight model never writes a tool call by itself. `ScriptedDecoding` is a decoding strategy that
ignores the logits and emits given token scripts instead, so that the serving path around the model (templating,
the engine, detokenising, parsing the answer, the wire formats) runs as it does for a real model whose answer is
that script. It is for tests only: nothing stops a server from being started with it, but its answers then are the
scripts, whatever the prompt. `TOOLS_CHATML_TEMPLATE` is a ChatML template with a tools section in the Qwen2.5 layout
(tools listed as JSON in the system turn, calls as `<tool_call>` blocks, results as `<tool_response>` blocks in a user
turn), written for the tiny test checkpoints, whose own template renders no tools; `tool_checkpoint` copies a
converted checkpoint with it.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from omnijax.decoding import register, sampling_row
from omnijax.models.tokenizer import Tokenizer

__all__ = ["ScriptedDecoding", "TOOLS_CHATML_TEMPLATE", "scripts_of", "tool_checkpoint"]


@register
@dataclasses.dataclass(frozen=True)
class ScriptedDecoding:
    """Emits token scripts whatever the logits (test only; see the module docstring).

    Each answer of a row follows one script from its first token: the i-th token of an answer is the script's i-th
    (its last once the script is exhausted; end each script with an end-of-turn id so that the answer ends). The
    position is the answer's token count: the per-row history `counts [B, V]` when the engine passes it (it spans
    the answer's continuation steps), else the answer step's own tokens (`history`), for which one answer must fit
    in one step (`max_answer_tokens`, tau, at least the longest script's length). The script is chosen per row by
    the row's temperature, as `RowSampling` rows carry it (`sampling_row`): temperature t picks script `floor(t)`
    (clipped to the last), so a request's `temperature` (0, 1, 2) picks the script; a row without one uses
    `temperature` (default 0: the first).

    Attributes:
        scripts: the token scripts (non-empty sequences of ids >= 0).
        temperature, top_p: the default row, as `RowSampling`'s (only the temperature is read, as the index).
        top_k, min_p, repetition_penalty, seed: `RowSampling`'s defaults, for the server's checks (unused).
    """

    scripts: tuple[tuple[int, ...], ...]
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # RowSampling's other defaults, read by the server's request checks; unused here
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    per_row = True  # `select` takes the rows' settings (`row=`): the script index
    name: ClassVar[str] = "scripted"

    def __post_init__(self):
        scripts = tuple(tuple(int(t) for t in s) for s in self.scripts)
        if not scripts or any(not s or min(s) < 0 for s in scripts):
            raise ValueError(f"ScriptedDecoding: scripts must be non-empty sequences of token ids >= 0, got "
                             f"{self.scripts!r}")
        object.__setattr__(self, "scripts", scripts)

    @property
    def length(self) -> int:
        """The longest script's length (the answer step must hold it: tau >= length)."""
        return max(len(s) for s in self.scripts)

    def _table(self) -> jax.Array:
        """`[n, length]` int32: each script padded with its last token."""
        return jnp.asarray(np.array([s + (s[-1],) * (self.length - len(s)) for s in self.scripts], np.int32))

    def rows(self, batch: int) -> jax.Array:
        """`[batch, W]` float32 (`sampling_row`'s width): the default row of rows that carry none."""
        row = jnp.asarray(sampling_row(self.temperature, self.top_p))
        return jnp.broadcast_to(row, (batch, row.shape[-1]))

    def _tokens(self, logits: jax.Array, history: jax.Array | None, row: jax.Array | None,
                counts: jax.Array | None = None) -> jax.Array:
        B = logits.shape[0]
        row = self.rows(B) if row is None else row.astype(jnp.float32)
        if counts is not None:
            position = jnp.sum(counts, axis=1).astype(jnp.int32)
        else:
            position = jnp.zeros((B,), jnp.int32) if history is None else jnp.sum(history >= 0, axis=1)
        index = jnp.clip(jnp.floor(row[:, 0]).astype(jnp.int32), 0, len(self.scripts) - 1)
        return self._table()[index, jnp.minimum(position, self.length - 1)].astype(jnp.int32)

    def warp(self, logits: jax.Array, history: jax.Array | None = None, row: jax.Array | None = None,
             counts: jax.Array | None = None, seen: jax.Array | None = None) -> jax.Array:
        """Scores 0 at each row's scripted token, -inf elsewhere (`seen` is unused)."""
        del seen
        token = self._tokens(logits, history, row, counts)
        return jnp.where(jnp.arange(logits.shape[-1])[None] == token[:, None], 0.0, -jnp.inf).astype(jnp.float32)

    def select(self, logits: jax.Array, history: jax.Array | None = None, key: jax.Array | None = None,
               row: jax.Array | None = None, counts: jax.Array | None = None,
               seen: jax.Array | None = None) -> jax.Array:
        """`[B]` int32: each row's next scripted token (`counts [B, V]`, or else `history [B, N]` with -1 = none,
        gives the position in the answer; `key` and `seen` are unused)."""
        del key, seen
        return self._tokens(logits, history, row, counts)


# ChatML with a tools section in the Qwen2.5 layout (see the module docstring). Assistant tool calls render as
# `<tool_call>` blocks after the content, their arguments as JSON (a string is rendered as it is); a run of tool
# messages becomes one user turn of `<tool_response>` blocks.
TOOLS_CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou can call these functions:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call one, write its name and arguments as a JSON object between tags:\\n'"
    " + '<tool_call>\\n{\"name\": <function name>, \"arguments\": <arguments object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages and messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + message['content'] }}"
    "{%- for call in (message['tool_calls'] or []) %}"
    "{%- set fn = call['function'] %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def tool_checkpoint(source: str | Path, destination: str | Path,
                    template: str = TOOLS_CHATML_TEMPLATE) -> Path:
    """A copy of the converted checkpoint `source` at `destination` whose chat template is `template`
    (`chat_template.jinja`, which replaces the tokenizer config's). Returns `destination`."""
    destination = Path(destination)
    shutil.copytree(source, destination)
    (destination / "chat_template.jinja").write_text(template)
    return destination


def scripts_of(tokenizer: Tokenizer, texts: Sequence[str], end: int) -> tuple[tuple[int, ...], ...]:
    """The token scripts of `texts` (each encoded, then `end`, the end-of-turn id)."""
    return tuple(tuple(tokenizer.encode(text)) + (int(end),) for text in texts)
