"""A `Session` never drops tokens silently: the first step whose pool ran out is warned about once, naming the fix
(`num_pages` / `StreamConfig`), and a session whose pool holds everything warns about nothing."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from omnijax.chunks.chunk import stack_chunks, text_chunk
from omnijax.models.config import TINY_OMNI
from omnijax.models.decoder import Decoder
from omnijax.streaming.config import DEFAULT_SESSION_PAGES, StreamConfig
from omnijax.streaming.session import Session, stream

pytestmark = pytest.mark.fast  # the quick tier (`make test-fast`): a Session on a tiny decoder warns of dropped tokens

WIDTH = 512


@pytest.fixture(scope="module")
def model():
    return Decoder(TINY_OMNI.replace(num_layers=1))


def feed_tokens(session, total, width=WIDTH):
    """Feeds `total` text tokens in chunks of `width`; returns the outputs (each step read before the next)."""
    outs = []
    rng = np.random.default_rng(0)
    for start in range(0, total, width):
        n = min(width, total - start)
        outs.append(session.feed(text_chunk(rng.integers(10, 100, n), length=width)))
    return outs


def drop_warnings(caught):
    return [w for w in caught if issubclass(w.category, RuntimeWarning) and "KV pool ran out" in str(w.message)]


def test_default_session_warns_once_at_the_first_drop_naming_the_fix(model):
    session = Session(model)  # the default pool: DEFAULT_SESSION_PAGES pages of 64 tokens under the default policy
    capacity = DEFAULT_SESSION_PAGES * session.page_size
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = feed_tokens(session, capacity)  # exactly fills the pool: nothing dropped
        assert session.check_pool() is False
        assert drop_warnings(caught) == []
        outs += feed_tokens(session, 3 * WIDTH)  # every token past the pool is dropped
        outs += feed_tokens(session, WIDTH)  # the next feed reads the finished steps' flags
        session.check_pool()
        session.check_pool()
    dropped = [int(np.asarray(o.stats.layout.dropped)[0]) for o in outs]  # independent: the steps' own counts
    assert dropped[capacity // WIDTH - 1] == 0 and dropped[capacity // WIDTH] == WIDTH
    found = drop_warnings(caught)
    assert len(found) == 1, [str(w.message) for w in found]
    message = str(found[0].message)
    assert "num_pages" in message and "StreamConfig" in message and f"{DEFAULT_SESSION_PAGES} pages" in message
    assert found[0].filename == __file__  # points at the caller's feed / check_pool


def test_drop_is_found_without_an_explicit_wait(model):
    session = Session(model, StreamConfig(num_pages=2, page_size=64))  # 128 tokens
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # The second step is the first to drop (200 tokens > 128). `feed` reads the flags of finished steps and,
        # past `_MAX_UNREAD` unread ones, waits for the oldest: the (_MAX_UNREAD + 3)-th feed finds 10 unread and
        # must wait for the first two, whether or not the device kept up (with one feed fewer the second step was
        # read only if it had finished, which a loaded machine does not promise).
        for _ in range(Session._MAX_UNREAD + 3):
            session.feed(text_chunk(np.arange(10, 10 + 100), length=128))
    found = drop_warnings(caught)
    assert len(found) == 1 and "(StreamConfig(num_pages=...)" in str(found[0].message)


def test_session_within_its_pool_never_warns(model):
    session = Session(model, StreamConfig(num_pages=8, page_size=64))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = feed_tokens(session, 8 * 64, width=128)
        assert session.check_pool() is False
    assert drop_warnings(caught) == []
    assert all(int(np.asarray(o.stats.layout.dropped)[0]) == 0 for o in outs)


def test_stream_warns_with_the_same_message_and_its_counts(model):
    """`stream` and `Session` share one warning: the pool's size, the sequence, its dropped count, the fix."""
    chunks = stack_chunks([text_chunk(np.arange(10, 10 + 100), length=128) for _ in range(3)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = stream(model, chunks, StreamConfig(num_pages=2, page_size=64))  # 128 tokens for 300
    found = drop_warnings(caught)
    assert len(found) == 1 and found[0].filename == __file__
    dropped = int(np.asarray(result.state.kv.dropped)[0])
    assert dropped == 300 - 128  # independent: the state's own count, the tokens past 2 pages of 64
    message = str(found[0].message)
    assert f"[{dropped}] token(s)" in message and "2 pages of 64 tokens" in message
    assert "StreamConfig(num_pages=...)" in message
