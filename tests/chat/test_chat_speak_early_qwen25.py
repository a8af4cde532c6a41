"""Qwen2.5-Omni speech that starts while the thinker writes (`SpeakOptions(early_start=True)`), on the seeded tiny
release the CLI and server speech tests build (`tests/_support/qwen25_speech.py`).

The streamed step returns each answer token's final-normed last-layer row as its answer loop computed it
(`chunk_step(..., tap_answer=True)`, `ChunkOutput.answer_rows`); `Chat` hands each block's tokens and rows to the
talker (`speech_stream.AnswerSpeech`). Checked here, on an answer of 24 tokens in 3 blocks of 8 whose positions
(108 .. 131) cross the 64-token page at 128:

- the rows: the step's answer and cache are those of the step without the tap, bit for bit; each row is the one the
  next token was chosen from (greedy argmax through the lm head); against `talker_forward.thinker_rows` (one full
  forward over prompt and answer, the reference path's rows) within the rounding of the chunked paged stream
  (measured: printed; bound `ROWS_TOL`);
- the speech: the early start's talker tokens and PCM equal, bit for bit, the same rows spoken after the answer ends
  (`AnswerSpeech.finish` alone: equal by construction), and equal the default finish-first path's (`speak_chunks`
  over `thinker_rows`, which tests/models/qwen2_5_omni/test_speech.py holds equal to transformers'
  `generate(return_audio=True)`), the codes agreeing despite the rows' rounding;
- the first PCM chunk comes after the answer's first block, before the second is decoded (counted in steps fed),
  the default path's after the last;
- only the tapped step carries the `[B, tau, D]` rows (the untapped step's program text was checked equal to the
  step's before the tap existed when the tap was added).
"""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import omnijax
from omnijax.chat import SpeakOptions
from omnijax.chunks.chunk import text_chunk
from omnijax.models.qwen2_5_omni import talker_forward as TF
from omnijax.models.qwen2_5_omni.speech import talker_input
from omnijax.models.qwen2_5_omni.token2wav_stream import Token2WavStreaming
from omnijax.streaming.step import chunk_step
from tests._support.qwen25_release_cache import kept_release25

# one user turn of 108 tokens (one program fewer than a system turn before it); greedy: 24 text tokens, no
# placeholder, no stop
QUESTION = "You are a helpful assistant who answers every question about the weather in great detail. Now count to " \
           "ten, slowly."
ANSWER_TOKENS, BLOCK = 24, 8
# Ethan's talker runs to the limit; 26 tokens: steps 0-22 read answer rows 1-23, step 23 text_eos, 24 text_pad
OPTIONS = dict(voice="Ethan", max_speech_tokens=26, first_chunk=6, chunk=6)  # 6 codes: the talker's after block 1
ROWS_TOL = 1e-5  # the answer rows against one full forward (measured 5.5e-6, the rows reaching 3.7)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = kept_release25(tmp_path_factory.mktemp("early25"), tokenizer=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = omnijax.load(out)
    # no look-ahead, no vocoder right context: PCM as soon as the talker has first_chunk codes (both paths alike)
    model.speech.streaming = Token2WavStreaming(right_blocks=0, vocoder_right=0)
    return model


@dataclasses.dataclass
class Run:
    chat: omnijax.Chat
    items: list  # (steps fed so far, text delta or PCM chunk) in the order ask() yielded them
    outs: list  # every step's output


def _ask(model, early: bool) -> Run:
    chat = omnijax.Chat(model, omnijax.StreamConfig(num_pages=64, page_size=16, max_answer_tokens=BLOCK))
    outs, feed = [], chat.session.feed
    chat.session.feed = lambda *a, **k: outs.append(feed(*a, **k)) or outs[-1]
    items = [(len(outs), x) for x in chat.ask(QUESTION, max_tokens=ANSWER_TOKENS,
                                              speak=SpeakOptions(**OPTIONS, early_start=early))]
    return Run(chat, items, outs)


@pytest.fixture(scope="module")
def runs(model):
    return _ask(model, True), _ask(model, False)


def _pcm(run: Run) -> np.ndarray:
    return np.concatenate([x for _, x in run.items if isinstance(x, np.ndarray)])


def _rows(run: Run) -> tuple[list[int], np.ndarray]:
    """The answer's tokens and their tapped rows, block by block."""
    tokens, rows = [], []
    for out in run.outs:  # the question's step (the first block), then one per later block
        got = [int(t) for t in np.asarray(out.tokens)[0] if t >= 0]
        tokens += got
        rows.append(np.asarray(out.answer_rows)[0][:len(got)])
        assert not np.asarray(out.answer_rows)[0][len(got):].any()  # zeros where no token
    return tokens, np.concatenate(rows)


def test_the_tapped_rows_are_the_answer_loops(model, runs):
    early, plain = runs
    spoken = early.chat.last_spoken
    prompt, answer = np.asarray(spoken.prompt_ids), np.asarray(spoken.answer_ids)
    tokens, rows = _rows(early)
    assert tokens == list(answer) and len(answer) == ANSWER_TOKENS and len(early.outs) == ANSWER_TOKENS // BLOCK
    assert len(prompt) < 128 < len(prompt) + len(answer)  # the answer crosses a 64-token page
    assert all(out.answer_rows is None for out in plain.outs)
    # the tap changes nothing the stream computes: the same answer, cache and last logits, bit for bit
    assert plain.chat.last_spoken.answer_ids == spoken.answer_ids
    for a, b in ((early.chat.session.state.last_logits, plain.chat.session.state.last_logits),
                 (early.chat.session.state.kv.k, plain.chat.session.state.kv.k),
                 (early.chat.session.state.kv.v, plain.chat.session.state.kv.v)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # row i is the one token i + 1 was chosen from (greedy: the argmax of the lm head over it)
    head = np.asarray(model.decoder.head_weight(), np.float32)
    logits = rows @ (head.T if model.config.tie_embeddings else head)
    np.testing.assert_array_equal(np.argmax(logits[:-1], axis=-1), answer[1:])
    # against one full forward over prompt and answer (the finish-first path's rows)
    _, hidden = TF.thinker_rows(model.decoder, np.concatenate([prompt, answer]))
    err = float(np.abs(rows - np.asarray(hidden)[len(prompt):]).max())
    print(f"answer rows vs thinker_rows: max abs {err:.2e} (rows' max {np.abs(rows).max():.2f})")
    assert np.abs(rows).max(axis=-1).min() > 0 and err <= ROWS_TOL  # every row written


def test_early_speech_equals_finish_first(model, runs):
    early, plain = runs
    spoken = early.chat.last_spoken
    pcm = _pcm(early)
    assert spoken.samples == pcm.size and pcm.size >= 20 * model.speech.token2wav.config.samples_per_token
    # the same rows, spoken after the answer ends: equal by construction
    tokens, rows = _rows(early)
    after = model.speech.tapped_answer_stream(model, spoken.prompt_ids, voice="ethan",
                                              max_new_tokens=OPTIONS["max_speech_tokens"],
                                              first_chunk=OPTIONS["first_chunk"], chunk=OPTIONS["chunk"])
    whole = list(after.finish(tokens, rows))
    np.testing.assert_array_equal(np.concatenate(whole), pcm)
    # the default finish-first path (one full thinker forward, the transformers-equal rows): the same speech
    np.testing.assert_array_equal(_pcm(plain), pcm)
    assert plain.chat.last_spoken == spoken
    # the talker's tokens: those of the reference path's rows (the codes agree despite the rows' rounding)
    c = model.speech.talker.config
    ti = talker_input(model, np.asarray(spoken.prompt_ids), np.asarray(spoken.answer_ids), model.speech.voice("Ethan"))
    want = TF.generate_greedy(c, model.speech.params, ti.rows, ti.positions, ti.trailing, ti.text_pad,
                              prompt_ids=ti.prompt_ids, max_new_tokens=OPTIONS["max_speech_tokens"],
                              suppress=[c.codec_bos_id])
    assert after.talker_tokens == list(want) and len(want) == OPTIONS["max_speech_tokens"]


def test_the_first_audio_comes_before_the_answer_ends(runs):
    early, plain = runs
    steps = len(early.outs)
    first = next(fed for fed, x in early.items if isinstance(x, np.ndarray))
    assert first == 1 < steps, (first, steps)  # PCM after the first block (first_chunk codes), before the next
    assert next(fed for fed, x in plain.items if isinstance(x, np.ndarray)) == steps  # the default: after it
    # text and speech interleave: a text delta follows the first PCM chunk
    at = next(i for i, (_, x) in enumerate(early.items) if isinstance(x, np.ndarray))
    assert any(isinstance(x, str) for _, x in early.items[at:])


def test_the_untapped_step_is_the_program_without_the_tap(model):
    decoder = model.decoder
    graphdef, params = nnx.split(decoder)
    config = omnijax.StreamConfig(num_pages=4, page_size=16, max_answer_tokens=3)
    state = omnijax.init_state(decoder.config, num_pages=4, page_size=16)
    chunk = jax.tree.map(jnp.asarray, text_chunk(list(range(5)), answer_tokens=2))

    def lowered(**tap):
        step = jax.jit(lambda p, s, c: chunk_step(nnx.merge(graphdef, p), s, c, config, shared_pages=False, **tap))
        return step.lower(params, state, chunk).as_text()

    off, on = lowered(), lowered(tap_answer=True)  # the default (False) is the program every caller compiles
    rows = f"tensor<1x3x{decoder.config.hidden_size}xf32>"
    assert rows not in off and rows in on


def test_bad_input_is_refused_by_name(model, runs):
    spoken = runs[0].chat.last_spoken
    with pytest.raises(ValueError, match="early_start must be a bool"):
        SpeakOptions(early_start=1)
    with pytest.raises(ValueError, match="unknown speaker"):
        model.speech.tapped_answer_stream(model, spoken.prompt_ids, voice="nobody")
    with pytest.raises(ValueError, match="greedily only"):
        model.speech.tapped_answer_stream(model, spoken.prompt_ids, voice="Ethan", sampling=object())
    stream = model.speech.tapped_answer_stream(model, spoken.prompt_ids, voice="Ethan")
    width = model.config.hidden_size
    with pytest.raises(ValueError, match=rf"rows must be \[2, {width}\]"):
        stream.push([5, 6], np.zeros((1, width), np.float32))
    placeholder = next(iter(model.speech.placeholders.values()))
    with pytest.raises(ValueError, match="placeholder"):
        stream.push([placeholder], np.zeros((1, width), np.float32))
    assert stream.generated == []  # nothing refused was taken
    list(stream.finish())
    with pytest.raises(ValueError, match="has ended"):
        stream.push([5], np.zeros((1, width), np.float32))
