"""What a new process compiles before a chat's first token: the session's empty state and its first step, two
programs (with `Chat(quick_start=True)`, the first step without the trim).

With an empty compilation cache every program on the way to the first token is compiled in the process. Built
eagerly, the empty state's ~25 `jnp` constructors each compiled a program of their own, `jnp.asarray` of a chunk's
numpy fields one per field, and indexing the step's tokens one more (about 30 in all on SmolLM2,
`bench/peers/first_token.py`); now the state is one program (`omnijax.streaming.session._empty_state`), equal to
the eager `init_state`, and the chunk and the tokens cross without one.
"""

from __future__ import annotations

import logging
import re

import jax
import numpy as np
import pytest

import omnijax
from omnijax.decoding import sampling_keys
from omnijax.retention import OmniPick
from omnijax.streaming import session as session_lib
from omnijax.streaming.step import init_state
from tests._support import tiny_omni
from tests._support.empty_cache import empty_compilation_cache


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return omnijax.load(tiny_omni.checkpoint(tmp_path_factory.mktemp("first_token"), tokenizer=True))


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """An empty compilation cache (XLA's and the kept executables) and no program held in memory, then the suite's
    cache again."""
    with empty_compilation_cache(tmp_path / "cache", monkeypatch) as path:
        yield path


class _Compiles(logging.Handler):
    """The names of the programs jax compiles while attached (`jax_log_compiles`' "Compiling <name> ..." records)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        found = re.match(r"Compiling (\S+) ", record.getMessage())
        if found:
            self.names.append(found.group(1))


def test_a_chat_compiles_two_programs_before_its_first_token(model, empty_cache):
    compiles, logger = _Compiles(), logging.getLogger("jax")
    kept_before, kept_step = dict(session_lib._empty_state.stats), dict(session_lib._step.stats)
    logger.addHandler(compiles)
    try:
        with jax.log_compiles(True):
            chat = omnijax.Chat(model, omnijax.StreamConfig(
                policy=OmniPick(high_watermark=64, low_watermark=48, text_budget=16), page_size=16, num_pages=12,
                max_answer_tokens=4), quick_start=True)
            chat.system("You are a helpful assistant.")
            answer = chat.ask("What is the capital of France?", max_tokens=4)
            first = next(answer)
            before_first = list(compiles.names)
            rest = "".join(answer)
    finally:
        logger.removeHandler(compiles)
    assert first, "the first delta carries text"
    # on the chat's path, the empty state and the first step (Chat's quick start: the step without the trim); the
    # full step compiles in another thread meanwhile and may have started before the first token
    on_path = [name for name in before_first if name != "jit(_step)"]
    assert sorted(on_path) == ["jit(_untrimmed_step)", "jit(init_state)"], before_first
    quick = chat.session.quick_start
    assert quick.untrimmed_steps >= 1 and quick.wait() and not quick.errors  # the workers' compiles ran
    assert session_lib._step.stats["compiled"] == kept_step["compiled"] + 1
    # compiled here (the cache is empty) and kept like the step
    assert session_lib._empty_state.stats["compiled"] == kept_before["compiled"] + 1
    assert session_lib._empty_state.stats["loaded"] == kept_before["loaded"]
    assert len(list(empty_cache.glob("executables/*/*.exe"))) >= 2
    assert isinstance(rest, str)


@pytest.mark.parametrize("kv_dtype", ["float", "int8"])
@pytest.mark.parametrize("seed", [0, 7, -5, 2**31, 2**32 + 7])
def test_the_empty_state_program_equals_the_eager_state(model, seed, kv_dtype):
    config = model.decoder.config
    shape = dict(num_pages=12, page_size=16, batch=2, kv_dtype=kv_dtype)
    jitted = session_lib._empty_state(config, seed=session_lib._seed_array(seed), **shape)
    eager = init_state(config, seed=seed, **shape)
    assert jax.tree.structure(jitted) == jax.tree.structure(eager)
    for got, want in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(jitted.key), np.asarray(sampling_keys(seed, 2)))
