"""`StreamConfig`: one settings object, validated once, taken by `stream`, `Session`, `EvalConfig` and
`EngineConfig`; the keyword form builds the same object; policy names resolve through `get_policy`; the module
names no longer shadow the functions; the persistent compilation cache."""

import dataclasses
import os
import subprocess
import sys
import types

import numpy as np
import pytest

import omnijax
from omnijax import StreamConfig
from omnijax.chunks import builders as adapters
from omnijax.chunks.chunk import stack_chunks, text_chunk
from omnijax.decoding import Greedy
from omnijax.eval.runner import EvalConfig
from omnijax.models.config import TINY_OMNI
from omnijax.models.registry import family_for
from omnijax.paging import Paging
from omnijax.retention import H2O, NoSlide, OmniPick, SinkWindow, TokenSliding, get_policy
from omnijax.streaming.session import bind_config


@pytest.fixture(scope="module")
def model():
    return omnijax.Decoder(TINY_OMNI)


def _session(n=4, length=9, seed=0):
    rng = np.random.default_rng(seed)
    chunks = [text_chunk(rng.integers(0, TINY_OMNI.vocab_size, length), unit=i) for i in range(n)]
    chunks[-1] = text_chunk(rng.integers(0, TINY_OMNI.vocab_size, length), unit=n - 1, answer_tokens=3)
    return stack_chunks(chunks)


def test_defaults_name_the_fastest_exact_implementation():
    config = StreamConfig()
    assert config.impl == "xla" and config.policy == NoSlide() and config.paging == Paging("native")
    assert config.decoding == Greedy() and config.num_pages is None and config.page_size == 64
    assert hash(config) == hash(StreamConfig())  # static: part of the compiled program


@pytest.mark.parametrize("fields, error, message", [
    (dict(paging="compact"), ValueError, "unknown paging mode 'compact'"),
    (dict(impl="cuda"), ValueError, "unknown attention impl 'cuda'"),
    (dict(page_size=48), ValueError, "page_size must be a power of two, got 48"),
    (dict(subblock=12), ValueError, "subblock must be a power of two, got 12"),
    (dict(policy="omnipick"), TypeError, r"get_policy\('omnipick'\)"),
    (dict(policy=OmniPick), TypeError, "not the class OmniPick"),
    (dict(policy=3), TypeError, "must be a retention policy object"),
    (dict(num_pages=0), ValueError, "num_pages must be a positive int or None"),
    (dict(max_answer_tokens=-1), ValueError, "max_answer_tokens must be an int >= 0"),
    (dict(decoding="greedy"), TypeError, "decoding must be a decoding strategy object"),
    (dict(policy=H2O()), ValueError, "only impl='reference' computes"),
])
def test_bad_settings_are_refused_at_construction(fields, error, message):
    with pytest.raises(error, match=message):
        StreamConfig(**fields)
    with pytest.raises(error, match=message):
        StreamConfig().replace(**fields)


def test_the_keyword_form_builds_the_same_object_and_refuses_unknown_names():
    config = StreamConfig(policy=SinkWindow(2, 8), page_size=8, max_answer_tokens=3)
    assert StreamConfig.of(policy=SinkWindow(2, 8), page_size=8, max_answer_tokens=3) == config
    assert StreamConfig.of(StreamConfig(page_size=8), policy=SinkWindow(2, 8), max_answer_tokens=3) == config
    assert EvalConfig("a", config) == EvalConfig("a", policy=SinkWindow(2, 8), page_size=8, max_answer_tokens=3)
    assert EvalConfig("a", config).policy == SinkWindow(2, 8) and EvalConfig("a", config).config is config
    with pytest.raises(TypeError, match=r"unknown StreamConfig field\(s\) \['page'\]"):
        StreamConfig.of(page=8)
    with pytest.raises(TypeError, match="a: unknown StreamConfig field"):
        EvalConfig("a", page=8)
    with pytest.raises(TypeError, match="config must be an omnijax.StreamConfig"):
        StreamConfig.of({"page_size": 8})


def test_stream_session_and_keywords_agree(model):
    chunks = _session()
    config = StreamConfig(policy=TokenSliding(window=16, high_watermark=24), page_size=8, num_pages=8,
                          max_answer_tokens=3)
    by_config = omnijax.stream(model, chunks, config)
    by_keywords = omnijax.stream(model, chunks, policy=TokenSliding(window=16, high_watermark=24), page_size=8,
                                 num_pages=8, max_answer_tokens=3)
    np.testing.assert_array_equal(np.asarray(by_config.logits), np.asarray(by_keywords.logits))
    np.testing.assert_array_equal(np.asarray(by_config.tokens), np.asarray(by_keywords.tokens))
    assert int(np.asarray(by_config.stats.evicted).sum()) > 0  # the policy ran
    session = omnijax.Session(model, config)
    assert session.policy == config.policy and session.max_answer_tokens == 3 and session.stream_config == config
    outs = [session.feed(adapters.unstack(chunks)[i]) for i in range(4)]
    np.testing.assert_array_equal(np.stack([np.asarray(o.tokens) for o in outs]), np.asarray(by_config.tokens))
    # A keyword on top of a config replaces that field only.
    assert omnijax.Session(model, config, page_size=16).stream_config == config.replace(page_size=16)


def test_get_policy_is_the_one_way_names_become_policies():
    assert get_policy("omnipick:high_watermark=600,low_watermark=400,source_image_whole=true") == OmniPick(
        high_watermark=600, low_watermark=400, source_image_whole=True)
    assert get_policy("full") == NoSlide() == get_policy("unbounded")
    assert get_policy("sink_window", sink=2, window=8) == SinkWindow(2, 8)
    # Defaults (a command line's own flags) fill what the spec leaves out, for the policy they name only.
    flags = {"sink_window": dict(sink=2, window=8)}
    assert get_policy("sink_window", defaults=flags) == SinkWindow(2, 8)
    assert get_policy("sink_window:window=16", defaults=flags) == SinkWindow(2, 16)
    assert get_policy("unbounded", defaults=flags) == NoSlide()
    assert StreamConfig.parse("sink_window:sink=2,window=8+tile_skip", page_size=8) == StreamConfig(
        policy=SinkWindow(2, 8), paging="tile_skip", page_size=8)
    with pytest.raises(KeyError, match="unknown retention policy 'lru'"):
        get_policy("lru")
    with pytest.raises(ValueError, match=r"omnipick has no setting\(s\) \['budget'\]"):
        get_policy("omnipick:budget=3")
    with pytest.raises(ValueError, match="is not key=value"):
        get_policy("omnipick:600")


def test_omnipick_source_image_follows_the_model_family(model):
    policy = OmniPick(high_watermark=40, low_watermark=20)
    assert policy.source_image_whole is None
    minicpmo = types.SimpleNamespace(family=family_for("minicpmo"), decoder=model)
    qwen = types.SimpleNamespace(family=family_for("qwen2_5_omni"), decoder=model)
    assert bind_config(minicpmo, policy=policy).policy.source_image_whole is True
    assert bind_config(qwen, policy=policy).policy.source_image_whole is False
    assert bind_config(model, policy=policy).policy.source_image_whole is False
    # A user's explicit choice is kept.
    assert bind_config(minicpmo, policy=dataclasses.replace(policy, source_image_whole=False)
                       ).policy.source_image_whole is False
    assert omnijax.Session(minicpmo, policy=policy, num_pages=8).policy.source_image_whole is True


def test_modules_do_not_shadow_their_functions_and_the_state_hint_works(model):
    import importlib

    assert callable(omnijax.stream) and callable(omnijax.evaluate)
    assert importlib.import_module("omnijax.streaming.session").stream is omnijax.stream
    assert importlib.import_module("omnijax.eval.runner").evaluate is omnijax.evaluate
    state = omnijax.init_state(TINY_OMNI.replace(num_layers=1), num_pages=4, page_size=8)
    with pytest.raises(ValueError, match=r"build it with omnijax.init_state\(model.config, ...\)") as info:
        omnijax.stream(model, _session(), state=state, max_answer_tokens=3)
    assert "omnijax.init_state(model.config, ...)" in str(info.value)
    fixed = omnijax.init_state(model.config, num_pages=8, page_size=8)  # the hint, as written
    assert omnijax.stream(model, _session(), state=fixed, max_answer_tokens=3).state.kv.k.shape[0] == 2


def _python(code: str, env: dict) -> str:
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_the_compilation_cache_switch_takes_a_directory_and_an_off_switch(tmp_path):
    """`omnijax.enable_compilation_cache()` (what the command lines call; `import omnijax` alone changes nothing)."""
    assert _python("import jax, omnijax; print(jax.config.jax_compilation_cache_dir)",
                   {"JAX_PLATFORMS": "cpu", "OMNIJAX_COMPILATION_CACHE": ""}) == "None"
    code = ("import jax, jax.numpy as jnp, omnijax; omnijax.enable_compilation_cache(); "
            "print(jax.config.jax_compilation_cache_dir); "
            "jax.jit(lambda x: x * 3 + 1)(jnp.arange(5.0)).block_until_ready()")
    env = {"JAX_PLATFORMS": "cpu", "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    env.pop("OMNIJAX_COMPILATION_CACHE", None)
    default = _python(code, {**env, "OMNIJAX_COMPILATION_CACHE": ""})
    assert default == str((tmp_path / "xdg" / "omnijax" / "jax").resolve())
    assert any(os.scandir(default))  # the program was written
    chosen = tmp_path / "chosen"
    assert _python(code, {**env, "OMNIJAX_COMPILATION_CACHE": str(chosen)}) == str(chosen.resolve())
    assert any(os.scandir(chosen))
    assert _python(code, {**env, "OMNIJAX_COMPILATION_CACHE": "off"}) == "None"
    own = ("import jax; jax.config.update('jax_compilation_cache_dir', %r); import omnijax; "
           "omnijax.enable_compilation_cache(); print(jax.config.jax_compilation_cache_dir)" % str(tmp_path / "own"))
    assert _python(own, {**env, "OMNIJAX_COMPILATION_CACHE": ""}) == str(tmp_path / "own")


def test_a_pool_sized_by_default_holds_the_session_under_every_paging_mode(model):
    """tile_skip keeps system tokens and unit tokens on separate pages, so each group rounds up to pages on its own:
    the default pool (num_pages None) counts that page, in `stream` and in `evaluate`."""
    import warnings

    from omnijax.chunks.spans import SpanKind

    chunks = stack_chunks([text_chunk([1, 2, 3, 4, 0, 0, 0, 0], unit=0, span=SpanKind.SYSTEM),
                           text_chunk([5, 6, 7, 8, 9, 10, 11, 12], unit=1)])
    chunks = dataclasses.replace(chunks, valid=np.asarray(chunks.token_ids) > 0)
    for paging in ("native", "tile_skip", "ordered_suffix", "eager"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            result = omnijax.stream(model, chunks, paging=paging, page_size=8)
            evaluated = omnijax.evaluate(model, [chunks], [EvalConfig(paging, paging=paging, page_size=8)],
                                         progress=False)
        assert int(result.stats.layout.retained_cells[-1, 0]) == 12
        assert not evaluated[paging].sessions[0].stats["exhausted"].any()
