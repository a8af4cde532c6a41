"""Shared test setup: CPU only, quick-to-compile XLA flags, float32 matmuls at full precision, a persistent compilation
cache, and compiled programs released after each test module."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Quick-to-compile XLA flags for this process and every subprocess it starts (tests/_support/xla_flags.py):
# OMNIJAX_TEST_XLA_FLAGS replaces them, empty for XLA's defaults. They must be set before jax starts. LLVM
# optimisation is turned off module by module (the fixture below).
from tests._support import xla_flags  # noqa: E402

xla_flags.apply()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# The suite's persistent compilation cache, outside the clone so that a fresh clone on the same machine (CI's reruns)
# starts warm: ~/.cache/omnijax-tests/jax (OMNIJAX_TEST_JAX_CACHE overrides), through the library's own switch, so
# the subprocesses the tests start (CLIs, bench scripts, fresh interpreters) share it. Entries are keyed by the
# program and the jax version, so a stale one is never used.
_cache = os.environ.get("OMNIJAX_TEST_JAX_CACHE",
                        os.path.join(os.path.expanduser("~"), ".cache", "omnijax-tests", "jax"))
os.environ["OMNIJAX_COMPILATION_CACHE"] = os.path.abspath(_cache)
from omnijax import compilation_cache  # noqa: E402

compilation_cache.enable()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs(request):
    """Compiles the module's programs quickly unless it is execution-bound (`xla_flags.EXECUTION_BOUND`), and drops
    the in-memory compilation caches when its tests are done.

    Every compiled XLA:CPU program keeps memory mappings of its code for as long as it is cached. One process
    running the whole suite would otherwise approach the kernel's per-process limit (`vm.max_map_count`, 65,530 by
    default), where compiling or serialising the next program crashes the process. Later modules that need a
    program again reload it from the persistent cache. The executables `omnijax.compilation_cache.CachedJit` holds
    (with `OMNIJAX_EXECUTABLE_CACHE=on`) are dropped with jax's caches: kept past `jax.clear_caches()`, they took a
    worker to that limit once.
    """
    xla_flags.quick_compile(xla_flags.wants_quick_compile(_relative(request.path)))
    torch = sys.modules.get("torch")  # (imported by the modules whose oracle is transformers, kvpress, ...)
    if torch is not None:
        # One intra-op thread: the oracles run tiny tensors, and with two threads on two busy cores every op waited
        # for the other thread to be scheduled (a 32-wide linear + conv + pad: 35x the CPU seconds at load ~6).
        torch.set_num_threads(1)
    yield
    started = sys.modules.get("omnijax.streaming.quick_start")  # (only a module that ran a session imported it)
    if started is not None:
        started.wait_all()  # a chat's full step compiling in another thread ends under this module's settings
    compilation_cache.clear_in_memory()


# The quick tier (`make test-fast`, `pytest -m fast`): what checks the logic of a layer without compiling a whole
# model: chunks, tables, retention policies against their plain-Python twins, OmniPage's plans, the wire codecs, the
# tokenizer, the harnesses on rigged models, the kernels in the interpreter, the engine on a tiny decoder, media,
# and the repository's self-containment. `make test` runs every test, these included.
FAST = ("chunks/", "checkpoint/", "kernels/", "media/", "retention/test_unit_policies.py",
        "retention/test_token_policies.py", "retention/test_retention_apply.py", "paging/test_omnipage_plans.py",
        "serve/realtime/test_realtime_events.py", "serve/test_openai_http.py", "serve/engine/test_serve_engine.py",
        "models/test_tokenizer.py", "models/minicpmo/test_duplex_loop.py", "eval/test_streamingbench.py",
        "eval/test_omnimmi.py", "eval/test_ovobench.py", "test_self_contained.py", "test_suite_setup.py")
_TESTS = os.path.dirname(os.path.abspath(__file__))


def _relative(path) -> str:
    """A test file's path relative to tests/, `/`-separated."""
    return os.path.relpath(str(path), _TESTS).replace(os.sep, "/")


# The modules that take longest (a warm run's seconds per module, setup included), longest first. `make test` hands
# whole modules to the two workers in collection order (`--dist loadfile --no-loadscope-reorder`), so these are
# collected first and the short modules fill in behind them: xdist's own order (most tests first) left the slow
# few-test modules (bench scripts, the README, the linters, serving restarts) for the end, one worker running them
# while the other idled. Entries that no longer exist fail tests/test_suite_setup.py.
SLOW_FIRST = (
    "test_bench_smoke.py", "test_readme_and_demo.py", "test_imports.py", "test_lint.py",
    "streaming/test_recall_questions.py", "chat/test_chat.py",
    "eval/test_evaluate.py", "streaming/test_sampling.py", "serve/realtime/test_realtime_churn.py",
    "retention/test_retention_streaming_baselines.py", "models/qwen3_omni/test_qwen3_omni_model.py",
    "streaming/test_decoding_rows.py", "streaming/test_endurance.py", "serve/test_fault_injection.py",
    "serve/test_openai_tools.py", "serve/clients/test_lm_eval.py", "serve/clients/test_langchain.py",
    "serve/test_openai_completions.py", "streaming/test_sampling_processors.py", "serve/test_openai_sampling.py",
    "serve/realtime/test_realtime_tools.py", "convert/test_gguf_smollm2.py",
    "models/qwen2_5_omni/test_thinker.py", "streaming/test_stream_config.py", "models/minicpmo/test_minicpmo_model.py",
    "serve/test_serve_traffic.py", "prefill/test_prefill_kvpress.py", "models/test_moe_expert_parallel.py",
    "serve/test_serve_restarts.py", "serve/test_openai_families.py", "models/test_decoder.py",
    "serve/test_structured.py", "models/qwen3_omni/test_code2wav.py", "models/qwen2_5_omni/test_token2wav.py",
    "models/test_quantized_decoder.py", "convert/test_quantize.py", "models/test_split_layers.py",
    "serve/test_warmup_structured.py", "models/qwen2_5_omni/test_speech.py",
    "streaming/test_recall.py", "streaming/test_recall_session.py", "serve/engine/test_n_sharing.py",
    "serve/test_chat_completions_audio.py", "chat/test_chat_speech.py", "serve/realtime/test_realtime_audio_output.py",
    "serve/cluster/test_ray_replicas.py", "chat/test_chat_speech_media.py",
    "kernels/test_block_sparse_attention_int8.py", "serve/engine/test_speech_ticks.py",
    "serve/test_serve_quantized.py", "eval/test_quantized_expert_parallel.py",
    "serve/test_speech_media.py", "models/qwen2_5_omni/test_speech_media.py", "bench/test_recall_bench.py",
    "serve/test_speech_media_qwen25.py", "kv/test_int8_kv_matrix.py",
    "eval/test_evaluate_recall.py", "serve/engine/test_engine_recall.py",
    "serve/test_speech_written.py", "serve/engine/test_speech_writing.py", "serve/test_serve_recall.py",
    "serve/cluster/test_object_store_resume.py", "serve/cluster/test_kv_leases.py",
    "models/qwen2_5_omni/test_speech_media_video.py", "chat/test_watch_speak_qwen25.py",
    "serve/engine/test_engine_recall_in_place.py", "serve/engine/test_engine_recall_warmup.py",
    "serve/engine/test_engine_recall_async.py", "streaming/test_recall_blocks.py",
    "models/qwen2_5_omni/test_token2wav_stream.py", "models/qwen2_5_omni/test_speech_stream.py",
    "models/qwen2_5_omni/test_talker_kv.py", "chat/test_chat_speak_qwen25.py",
    "serve/engine/test_engine_recall_paging.py", "streaming/test_recall_int8.py", "streaming/test_recall_paging.py",
    "serve/engine/test_speech_pool_qwen25.py", "chat/test_talker_window_qwen3.py", "chat/test_talker_window_qwen25.py",
    "serve/engine/test_engine_snapshot_int8.py", "chat/test_chat_speak_early_qwen25.py",
    "serve/engine/test_speech_early_qwen25.py",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        relative = _relative(item.path)
        if relative.startswith(FAST):
            item.add_marker(pytest.mark.fast)
    rank = {module: index for index, module in enumerate(SLOW_FIRST)}
    # stable: a module's tests keep their order, the other modules theirs
    items.sort(key=lambda item: rank.get(_relative(item.path), len(SLOW_FIRST)))
