"""A new `Session` compiles its step before it allocates its KV pool, so a process's peak is the larger of the
compile's working memory and the pool, not their sum (issue 38 item 1: on SmolLM2-135M the step's compile peaks
~140 MB above the weights and the pool is 107 MB).

Run in a fresh interpreter (the step must not be compiled yet): a `jax.monitoring` listener records, at every
backend compile, whether an array of the pool's shape is alive. The oracle for the results is the same session with
its pool allocated first (reading `session.state` before the first `feed`, the order of before this change).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

_RUN = """
import json, sys
import jax, numpy as np
from jax import monitoring
from omnijax.chunks.chunk import text_chunk
from omnijax.models.config import TINY_OMNI
from omnijax.models.decoder import Decoder
from omnijax.streaming.session import Session

PAGES, PAGE_SIZE, WIDTH = 7, 16, 24
if len(sys.argv) > 1:  # a cache directory: the step is kept as a serialised executable there
    from omnijax.compilation_cache import enable
    enable(sys.argv[1])
config = TINY_OMNI.replace(num_layers=2)
pool_shape = (config.num_layers, PAGES, PAGE_SIZE, config.num_kv_heads, config.head_dim)
compiles = []  # at each backend compile of a session's program: its name, and whether a pool array is alive


def listen(event, seconds, fun_name=None, **kw):
    if event.endswith("backend_compile_duration") and fun_name in ("jit(_step)", "jit(init_state)"):
        compiles.append([fun_name, any(a.shape == pool_shape for a in jax.live_arrays())])


monitoring.register_event_duration_secs_listener(listen)
model = Decoder(config)
chunks = [text_chunk(np.random.default_rng(i).integers(10, 100, WIDTH), length=WIDTH) for i in range(3)]

def run(session):
    return [np.asarray(session.feed(c).logits) for c in chunks]

deferred = Session(model, num_pages=PAGES, page_size=PAGE_SIZE)
pool_at_start = any(a.shape == pool_shape for a in jax.live_arrays())
got = run(deferred)
first = list(compiles)
eager = Session(model, num_pages=PAGES, page_size=PAGE_SIZE)
eager.state  # the pool first, then the step (already compiled above)
want = run(eager)
print(json.dumps({"pool_at_start": pool_at_start, "compiles": first, "after": compiles[len(first):],
                  "same": all(np.array_equal(a, b) for a, b in zip(got, want)),
                  "shape": list(deferred.state.kv.k.shape), "logits": got[-1][0, :8].tolist()}))
"""


def _run(*args: str) -> dict:
    run = subprocess.run([sys.executable, "-c", _RUN, *args], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMNIJAX_COMPILATION_CACHE": "off"})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_step_compiles_before_the_pool_exists_and_only_once():
    got = _run()
    assert got["pool_at_start"] is False  # a new session holds no pool until its first feed
    # the step first, with no pool alive (before this change: the empty state at construction, then the step beside
    # the pool), then the empty state; each once: the step compiled against the state's shapes is the one the call
    # runs (a second compile of it would show here)
    assert got["compiles"] == [["jit(_step)", False], ["jit(init_state)", False]], got
    assert got["after"] == []  # the second session compiles nothing
    assert got["same"]  # the same logits as the session whose pool was allocated first
    assert got["shape"][1] == 7


def test_with_kept_executables_the_step_compiled_before_the_pool_is_the_one_kept(tmp_path):
    """With the compilation cache on, the step compiled against the state's shapes is the executable kept on disk:
    compiled once in the first process, loaded (nothing compiled) by the next, with the same logits."""
    first, second = _run(str(tmp_path)), _run(str(tmp_path))
    assert first["compiles"] == [["jit(_step)", False], ["jit(init_state)", False]], first
    assert second["compiles"] == [] and second["pool_at_start"] is False
    assert first["same"] and second["same"] and first["logits"] == second["logits"]
