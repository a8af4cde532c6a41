"""`Session(quick_start=True)` (`omnijax.streaming.quick_start`): a new session's first step runs without the trim,
compiled quickly (`QUICK_COMPILE`: LLVM optimisation off, one-row products padded), while another thread compiles
the full step, and the session computes what the full step computes.

Oracle: the same chunks through a session without quick start (the full step only): every output's tokens and
statistics and the final state's integer and boolean fields equal, its logits and cached keys and values to float32
rounding (the quick program's code differs, not its computation), across a first step that fits the policy's
untrimmed capacity and later steps that trim. The programs are counted (`CachedJit.stats`) in an empty compilation
cache."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import omnijax
from omnijax.chunks import text_chunk
from omnijax.retention import OmniPick
from omnijax.retention.base import untrimmed_capacity
from omnijax.retention.recall import Recall
from omnijax.streaming import quick_start
from omnijax.streaming import session as session_lib
from tests._support import tiny_omni
from tests._support.empty_cache import empty_compilation_cache

POLICY = OmniPick(high_watermark=40, low_watermark=28, text_budget=8)
CONFIG = omnijax.StreamConfig(policy=POLICY, page_size=16, num_pages=8, max_answer_tokens=4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_omni.checkpoint(tmp_path_factory.mktemp("quick_start"), tokenizer=True)


@pytest.fixture(scope="module")
def model(checkpoint):
    return omnijax.load(checkpoint)


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """An empty compilation cache and no program held in memory, then the suite's cache again."""
    with empty_compilation_cache(tmp_path / "cache", monkeypatch) as path:
        yield path


def _chunks(vocab: int, sizes: list[int]) -> list:
    rng = np.random.default_rng(3)
    return [text_chunk(rng.integers(10, vocab, n), length=24, unit=i, answer_tokens=4) for i, n in enumerate(sizes)]


def _run(model, chunks, **kwargs):
    session = omnijax.Session(model, CONFIG, **kwargs)
    outs = [jax.device_get(session.feed(chunk)) for chunk in chunks]
    return session, outs, jax.device_get(session.state)


def _stats(fn):
    return dict(fn.stats)


def test_the_first_step_runs_untrimmed_and_every_step_equals_the_full_program(model, empty_cache):
    assert untrimmed_capacity(POLICY) == 40
    chunks = _chunks(model.decoder.config.vocab_size, [20, 24, 24, 24])  # 20 (+4 answered) fits 40; the later ones trim
    full, untrimmed = _stats(session_lib._step), _stats(session_lib._untrimmed_step)
    quick, got, got_state = _run(model, chunks, quick_start=True)
    assert quick.quick_start.untrimmed_steps == 1 and quick.quick_start.wait() and not quick.quick_start.errors
    assert quick_start.wait_all() and not any(w.is_alive() for w in quick.quick_start.workers)
    assert session_lib._untrimmed_step.stats["compiled"] == untrimmed["compiled"] + 1
    # the full step was compiled once, in the worker thread, while the first step ran; the later steps ran it
    assert session_lib._step.stats["compiled"] == full["compiled"] + 1
    evicted = [int(np.asarray(out.stats.evicted).sum()) for out in got]
    assert evicted[0] == 0 and sum(evicted[1:]) > 0, evicted  # the first step could not trim; later ones did
    _, want, want_state = _run(model, chunks)  # the full step from the start (held: nothing compiles)
    assert session_lib._step.stats["compiled"] == full["compiled"] + 1
    assert session_lib._untrimmed_step.stats["compiled"] == untrimmed["compiled"] + 1
    assert session_lib._untrimmed_step.compiler_options == quick_start.QUICK_COMPILE
    for a, b in zip(got, want):
        _same(a, b)
    _same(got_state, want_state)


def _same(got, want) -> None:
    """Integer and boolean leaves equal; float leaves (logits, keys, values, attention mass) to float32 rounding."""
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if np.issubdtype(y.dtype, np.floating):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(x, y)


def test_steps_run_untrimmed_while_the_cells_fit_and_the_full_step_is_not_ready(model, empty_cache):
    """A chat's system prompt and first question both fit: the second step also runs untrimmed while the worker
    compiles, and a step once the full step is held runs it."""
    vocab = model.decoder.config.vocab_size
    session = omnijax.Session(model, CONFIG, quick_start=True)
    first, second, third = _chunks(vocab, [6, 6, 6])
    session.feed(first)
    session.feed(second)  # 6 + 4 + 6 <= 40; the worker may or may not have ended: either program computes the same
    assert 1 <= session.quick_start.untrimmed_steps <= 2 and session.quick_start.held == 20
    assert session.quick_start.wait() and not session.quick_start.errors
    before = session.quick_start.untrimmed_steps
    session.feed(third)  # fits too, but the full step is held now: it runs
    assert session.quick_start.untrimmed_steps == before and session.quick_start.held == 30


def test_the_full_step_from_the_start_when_kept_or_when_the_first_chunk_could_trim(model, empty_cache):
    vocab = model.decoder.config.vocab_size
    untrimmed = _stats(session_lib._untrimmed_step)
    _run(model, _chunks(vocab, [20]))  # keeps the full step for this shape
    _run(model, _chunks(vocab, [20]), quick_start=True)  # ready: no untrimmed step
    assert session_lib._untrimmed_step.stats == untrimmed
    small = omnijax.StreamConfig(policy=OmniPick(high_watermark=16, low_watermark=12, text_budget=4), page_size=16,
                                 num_pages=8, max_answer_tokens=4)
    session = omnijax.Session(model, small, quick_start=True)
    session.feed(_chunks(vocab, [20])[0])  # 20 cells > 16: the trim may fire in the first step
    assert session_lib._untrimmed_step.stats == untrimmed


def test_the_full_step_compiles_once_a_step_has_answered(model, empty_cache):
    """The worker starts after an untrimmed step that decodes an answer (its block is out), or after the
    `DEFER_STEPS`-th untrimmed step without one: a chat's system prompt starts none, so the question's step does not
    share the cores with it. The session computes what the full step computes, and runs it once it is held."""
    vocab, rng = model.decoder.config.vocab_size, np.random.default_rng(5)
    silent = [text_chunk(rng.integers(10, vocab, 6), length=32, unit=i) for i in range(2)]  # no answer asked
    session = omnijax.Session(model, CONFIG, quick_start=True)
    quick = session.quick_start
    session.feed(silent[0])
    assert quick.untrimmed_steps == 1 and quick.workers == []  # deferred
    session.feed(silent[1])  # the second without an answer: started all the same
    assert quick.untrimmed_steps == 2 and len(quick.workers) == quick_start.DEFER_STEPS - 1
    assert quick.wait() and not quick.errors

    system, question, later = (text_chunk(rng.integers(10, vocab, n), length=24, unit=i, answer_tokens=a)
                               for i, (n, a) in enumerate([(8, 0), (8, 4), (24, 4)]))
    full, untrimmed = _stats(session_lib._step), _stats(session_lib._untrimmed_step)
    chat = omnijax.Session(model, CONFIG, quick_start=True)
    quick = chat.quick_start
    got = [jax.device_get(chat.feed(system))]
    assert quick.untrimmed_steps == 1 and quick.workers == []  # the system prompt: nothing compiles behind it
    got.append(jax.device_get(chat.feed(question)))
    assert quick.untrimmed_steps == 2 and len(quick.workers) == 1  # the answer is out: the full step compiles
    assert quick.wait() and not quick.errors
    assert session_lib._untrimmed_step.stats["compiled"] == untrimmed["compiled"] + 1  # one shape, both steps
    assert session_lib._step.stats["compiled"] == full["compiled"] + 1  # in the worker
    got.append(jax.device_get(chat.feed(later)))  # 8 + 12 + 24 > 40 cells: the full step (held) runs and trims
    assert quick.untrimmed_steps == 2 and len(quick.workers) == 1
    assert session_lib._step.stats["compiled"] == full["compiled"] + 1
    assert int(np.asarray(got[-1].stats.evicted).sum()) > 0
    _, want, want_state = _run(model, [system, question, later])  # the full step from the start
    for a, b in zip(got, want, strict=True):
        _same(a, b)
    _same(jax.device_get(chat.state), want_state)


def _chat_args(checkpoint, *flags: str):
    from omnijax import commands  # (L6: the command line)

    args = commands.build_parser("chat").parse_args(
        [str(checkpoint), "--policy", "omnipick:high_watermark=40,low_watermark=28,text_budget=8", "--page-size",
         "16", "--pages", "8", "--block", "4", "--max-tokens", "8", *flags])
    args.command = "chat"
    return commands, args


def test_omnijax_chat_starts_quickly_by_default_with_the_same_answers(checkpoint, empty_cache):
    """`omnijax chat` (always a fresh process) runs with quick start unless `--no-quick-start`, and answers the
    same as without it."""
    import io

    commands, args = _chat_args(checkpoint)
    assert args.quick_start is True
    assert commands.open_chat(args).session.quick_start is not None
    _, off = _chat_args(checkpoint, "--no-quick-start")
    assert commands.open_chat(off).session.quick_start is None
    lines = "Hello there\nAnd again, please\n"
    untrimmed = _stats(session_lib._untrimmed_step)
    quick_out = io.StringIO()
    assert commands.run_chat(args, stdin=io.StringIO(lines), out=quick_out) == 0  # first: the cache is empty
    assert quick_start.wait_all()
    assert session_lib._untrimmed_step.stats["compiled"] > untrimmed["compiled"]  # it did start quickly
    full_out = io.StringIO()
    assert commands.run_chat(off, stdin=io.StringIO(lines), out=full_out) == 0
    assert quick_out.getvalue().strip() and quick_out.getvalue() == full_out.getvalue()  # both answers, as printed


def test_quick_start_is_refused_with_a_given_state_or_recall(model):
    session = omnijax.Session(model, CONFIG)
    with pytest.raises(ValueError, match="quick_start .* state="):
        omnijax.Session(model, CONFIG, state=session.state, quick_start=True)
    with pytest.raises(ValueError, match="quick_start .* recall"):
        omnijax.Session(model, CONFIG.replace(recall=Recall(budget=16)), quick_start=True)
    assert omnijax.Chat(model, CONFIG).session.quick_start is None  # off by default
    with pytest.raises(ValueError, match="quick_start .* recall"):
        omnijax.Chat(model, CONFIG.replace(recall=Recall(budget=16)), quick_start=True)


# A process that ends right after its first step, its full step still compiling in the worker.
EXITS_EARLY = textwrap.dedent("""
    import sys
    import numpy as np
    import omnijax
    from omnijax.chunks import text_chunk
    from omnijax.retention import OmniPick
    omnijax.enable_compilation_cache(sys.argv[2])
    model = omnijax.load(sys.argv[1])
    config = omnijax.StreamConfig(policy=OmniPick(high_watermark=40, low_watermark=28, text_budget=8), page_size=16,
                                  num_pages=8, max_answer_tokens=4)
    session = omnijax.Session(model, config, quick_start=True)
    out = session.feed(text_chunk(np.arange(10, 20), length=24, answer_tokens=4))
    print(session.quick_start.untrimmed_steps, np.asarray(out.tokens).tolist(), flush=True)
""")


def test_a_process_ending_while_the_full_step_compiles_waits_for_it(checkpoint, tmp_path):
    """The worker is not a daemon: a process that ended while XLA compiled in a daemon thread aborted (SIGABRT,
    "terminate called after throwing an instance of ''"). It exits cleanly, with the full step kept for the next."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIJAX_EXECUTABLE")}
    done = subprocess.run([sys.executable, "-c", EXITS_EARLY, str(checkpoint), str(tmp_path / "cache")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[0] == "1"
    kept = list((tmp_path / "cache" / "executables").glob("*/*.exe"))
    assert len(kept) >= 3, kept  # the empty state, the untrimmed step and the worker's full step
