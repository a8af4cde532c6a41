"""n choices sharing the prompt's pages (`Engine.fork_session`, `omnijax.kv.page_sharing`) against today's copy.

Oracle: the same prompt in an engine whose other choices are imported from a snapshot of the prompt's session (a
copy of every page, `export_session` / `import_session`): every later frame of every choice gives the same tokens
and logits, for NoSlide, OmniPick and SinkWindow, greedy and sampled, while the trims of SinkWindow and OmniPick
reach into the shared prompt pages. The pool's free count after the fork: (n - 1) x (full prompt pages) fewer pages
in use than the copy. After every tick the pool's books balance (each page's `shares` + 1 = the table entries naming
it, the free stack = the pages no table names) and closing every session returns every page.

Tiny decoder, bucket 4; programs: per policy x decoding the step, the fork and the snapshot row write.
"""

import time

import numpy as np
import pytest

import omnijax
from omnijax.chunks.chunk import text_chunk
from omnijax.decoding import Greedy, Sampling
from omnijax.models.config import TINY_OMNI
from omnijax.retention.base import NoSlide
from omnijax.retention.baselines import H2O, SinkWindow
from omnijax.retention.omnipick import OmniPick
from omnijax.serve.engine.engine import Engine, EngineConfig
from omnijax.serve.engine.snapshot import NotEnoughPages

P, NUM_PAGES, T, TAU, N = 8, 40, 8, 3, 3
PROMPT = 29  # 3 full pages and a partly filled one
POLICIES = {"no_slide": NoSlide(), "omnipick": OmniPick(high_watermark=40, low_watermark=24, recent_units=1,
                                                        text_budget=8),
            "sink_window": SinkWindow(4, 28)}  # trims only after the fork
DECODINGS = {"greedy": Greedy(), "sampled": Sampling(temperature=0.9, seed=5)}


@pytest.fixture(scope="module")
def decoder():
    return omnijax.Decoder(TINY_OMNI)


def _config(policy, decoding, num_pages=NUM_PAGES, **fields):
    stream = omnijax.StreamConfig(policy=policy, num_pages=num_pages, page_size=P, max_answer_tokens=TAU,
                                  decoding=decoding, **{"impl": "xla", **fields})
    return EngineConfig(stream=stream, chunk_tokens=T, buckets=(4,), return_logits=True)


def _prompt(engine, rng_seed=0, length=PROMPT):
    rng = np.random.default_rng(rng_seed)
    ids = rng.integers(0, TINY_OMNI.vocab_size, length)
    engine.open("c0")
    for u, at in enumerate(range(0, length, T)):
        engine.submit("c0", text_chunk(ids[at:at + T], unit=u), 0)
        engine.tick()


def check_books(kv) -> None:
    """Each held page's `shares` + 1 equals the table entries naming it; free pages have none and sit on the free
    stack exactly once; nothing is both."""
    table = np.asarray(kv.page_table)
    shares, N_ = np.asarray(kv.shares), kv.num_pages
    refs = np.bincount(table[table >= 0], minlength=N_)
    free = np.asarray(kv.free_stack)[:int(kv.num_free)]
    assert len(set(free.tolist())) == len(free)
    held = refs > 0
    assert not np.any(held[free]), "a page both free and named by a table"
    assert int(kv.num_free) + int(held.sum()) == N_, "pages lost or counted twice"
    np.testing.assert_array_equal(shares[held], refs[held] - 1)
    assert not np.any(shares[~held])


def _run(decoder, policy, decoding, share: bool, frames: int = 6):
    engine = Engine(decoder, _config(policy, decoding))
    _prompt(engine)
    before = engine.free_pages
    names = [f"c{i}" for i in range(N)]
    if share:
        for s in names[1:]:
            engine.open(s)
        engine.fork_session("c0", names[1:])
    else:
        snapshot = engine.export_session("c0")
        for s in names[1:]:
            engine.import_session(s, snapshot)
    used_by_fork = before - engine.free_pages
    shares = [int(np.sum(np.asarray(engine.state.kv.shares)))]
    for i, s in enumerate(names):
        engine.seed_session(s, 11, i)
    check_books(engine.state.kv)
    rng = np.random.default_rng(1)
    out = []
    for f in range(frames):
        for s in names:
            engine.submit(s, text_chunk(rng.integers(0, TINY_OMNI.vocab_size, 5), unit=10 + f), TAU)
        report = engine.tick()
        check_books(engine.state.kv)
        out.append({s: (report.outputs[s].tokens, report.outputs[s].logits) for s in names})
        assert not engine.preempted
    shares.append(int(np.sum(np.asarray(engine.state.kv.shares))))
    for s in names:
        engine.close(s)
    check_books(engine.state.kv)
    assert engine.free_pages == NUM_PAGES
    return used_by_fork, shares, out


@pytest.mark.parametrize("decoding", DECODINGS)
@pytest.mark.parametrize("policy", POLICIES)
def test_shared_choices_equal_copied_choices(decoder, policy, decoding):
    shared_used, shares, shared = _run(decoder, POLICIES[policy], DECODINGS[decoding], True)
    copied_used, no_shares, copied = _run(decoder, POLICIES[policy], DECODINGS[decoding], False)
    full, partial = PROMPT // P, 1
    assert copied_used == (N - 1) * (full + partial)
    assert shared_used == (N - 1) * partial  # (n - 1) x full prompt pages fewer
    assert shares[0] == (N - 1) * full and no_shares == [0, 0]
    if policy != "no_slide":  # the trims reached the shared pages: copied on write or dereferenced
        assert shares[1] < shares[0]
    for a, b in zip(shared, copied):
        for s in a:
            assert a[s][0] == b[s][0] and len(a[s][0]) == TAU
            np.testing.assert_array_equal(a[s][1], b[s][1])
    if decoding == "sampled":  # the choices differ from one another (their keys are folded apart)
        assert len({tuple(t for frame in shared for t in frame[s][0]) for s in shared[0]}) == N


def test_trim_into_the_shared_prefix_matches_an_unshared_run(decoder):
    """SinkWindow trims the shared prompt pages of every choice: copy-on-write and dropped references keep each row
    equal to the same session run alone, and after the trims no page is shared any more."""
    policy, decoding = SinkWindow(4, 28), Greedy()
    engine = Engine(decoder, _config(policy, decoding))
    _prompt(engine)
    engine.open("c1")
    engine.fork_session("c0", ["c1"])
    assert int(np.sum(np.asarray(engine.state.kv.shares))) == PROMPT // P
    alone = Engine(decoder, _config(policy, decoding))
    _prompt(alone)
    rng = np.random.default_rng(2)
    for f in range(4):
        ids = rng.integers(0, TINY_OMNI.vocab_size, 6)
        for s in ("c0", "c1"):
            engine.submit(s, text_chunk(ids, unit=10 + f), TAU)
        alone.submit("c0", text_chunk(ids, unit=10 + f), TAU)
        got, want = engine.tick(), alone.tick()
        check_books(engine.state.kv)
        for s in ("c0", "c1"):
            assert got.outputs[s].tokens == want.outputs["c0"].tokens
            np.testing.assert_array_equal(got.outputs[s].logits, want.outputs["c0"].logits)
    assert not np.any(np.asarray(engine.state.kv.shares))  # the window left the prompt: every shared page is gone


@pytest.mark.parametrize("fields", [{"impl": "reference", "policy": H2O(heavy=8, recent=8, high_watermark=40)},
                                    {"paging": "eager", "policy": SinkWindow(4, 28)}], ids=["h2o", "eager"])
def test_score_policies_and_migrating_paging_copy_every_page(decoder, fields):
    fields = dict(fields)
    engine = Engine(decoder, _config(fields.pop("policy"), Greedy(), **fields))
    _prompt(engine)
    engine.open("c1")
    share, shared, copied = engine.fork_session("c0", ["c1"])
    assert (share, shared, copied) == (False, 0, PROMPT // P + 1)
    assert not np.any(np.asarray(engine.state.kv.shares))


def test_fork_refusals_change_nothing(decoder):
    # the module's pool (its NoSlide programs compiled above) filled by a prompt of 37 full pages and a partial one
    engine = Engine(decoder, _config(NoSlide(), Greedy()))
    _prompt(engine, length=(NUM_PAGES - 3) * P + 5)
    for s in ("c1", "c2", "c3"):
        engine.open(s)
    engine.tick()
    free, table = engine.free_pages, np.asarray(engine.state.kv.page_table).copy()
    assert free == 2
    with pytest.raises(NotEnoughPages, match="copy 1 pages each"):
        engine.fork_session("c0", ["c1", "c2", "c3"])  # 3 partial copies, 2 free pages
    with pytest.raises(ValueError, match="distinct rows other than the source"):
        engine.fork_session("c0", ["c0"])
    engine.fork_session("c0", ["c1"])
    with pytest.raises(ValueError, match="hold pages"):
        engine.fork_session("c0", ["c1"])
    assert engine.free_pages == free - 1
    np.testing.assert_array_equal(np.asarray(engine.state.kv.page_table)[[0, 2, 3]], table[[0, 2, 3]])


LONG = [{"role": "user", "content": "Tell me about the sea, the tides, the waves on the shore, the fish, the boats and "
                                    "the wind over the water at night."}]


def assert_every_page_returns(engine, timeout_s: float = 20.0) -> None:
    """Polls the engine's free-page count from this thread until the whole pool is free (AssertionError naming the
    count after `timeout_s`): the engine's thread may still be resetting a closed session's row (its sessions list
    is already empty then), and a read of the state it is replacing finds donated buffers."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            free = engine.free_pages
        except RuntimeError:  # the engine thread donated that state while this thread read it
            free = None
        if free == engine.config.num_pages:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{free} of {engine.config.num_pages} pages free {timeout_s:g} s after the server "
                                 f"went idle")
        time.sleep(0.05)


def test_chat_completions_n3_sharing_equals_the_snapshot_copy(monkeypatch):
    """n=3 through the official openai SDK against the demo server (SinkWindow(4, 48), 16-slot pages): sharing
    gives the same choices, tokens and logprobs as the snapshot-copy path, sampled (seeded) and greedy, whole and
    streamed; the fork shared the prompt's full pages; every page is back in the pool afterwards."""
    openai = pytest.importorskip("openai")
    from omnijax.decoding import RowSampling
    from omnijax.serve import chat_choices
    from tests._support.demo_server import demo_server

    with demo_server(decoding=RowSampling(seed=7)) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        engine = server.context.worker.engine
        forks = []
        fork = engine.fork_session
        monkeypatch.setattr(engine, "fork_session", lambda *a, **k: forks.append(fork(*a, **k)) or forks[-1])

        def ask(**kwargs):
            return client.chat.completions.create(model="omnijax", messages=LONG, max_tokens=12, n=3, logprobs=True,
                                                  top_logprobs=2, **kwargs)

        def entries(answer):
            return [(c.index, c.message.content, c.finish_reason,
                     [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in c.logprobs.content])
                    for c in answer.choices]

        got = {}
        for share in (True, False):
            monkeypatch.setattr(chat_choices, "SHARE_PAGES", share)
            sampled, greedy = ask(temperature=1.3, seed=5), ask()
            chunks = list(client.chat.completions.create(model="omnijax", messages=LONG, max_tokens=12, n=3,
                                                         temperature=1.3, seed=5, stream=True))
            streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
                        for i in range(3)]
            got[share] = (entries(sampled), entries(greedy), streamed)
            server.wait_idle()  # a response's last chunk goes out before the engine closes its sessions
            assert_every_page_returns(engine)
        assert got[True] == got[False]
        assert len({text for _, text, _, _ in got[True][0]}) > 1  # the sampled choices differ
        assert got[True][2] == [text for _, text, _, _ in got[True][0]]
        assert len(forks) == 3 and all(share and shared >= 1 for share, shared, _ in forks)
