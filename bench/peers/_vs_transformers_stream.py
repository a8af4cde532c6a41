"""`bench.peers.vs_transformers`' worker side of a streaming section: each side's model loaded (`load_omnijax`,
`load_transformers`) and a stream of chunks fed through it (`omnijax_stream`, `transformers_stream`), recording at
each checkpoint history the feed's wall and CPU milliseconds (`clock` / `since`: the worker process's CPU seconds,
every thread), the last-token logits and, with `inner`, the median of re-feeds of the chunk from the state before
it. torch and JAX are imported inside the functions: a worker imports only its own side's."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

PAGE_SIZE = 64
TORCH_THREADS = 2


def clock() -> tuple[float, float]:
    """Now, as (wall, this process's CPU seconds): `since` takes it."""
    return time.perf_counter(), time.process_time()


def since(start: tuple[float, float]) -> tuple[float, float]:
    """(wall ms, CPU ms of every thread of this process) since `clock()` gave `start`."""
    return 1e3 * (time.perf_counter() - start[0]), 1e3 * (time.process_time() - start[1])


def load_transformers(hf_dir: Path):
    """`(torch, DynamicCache, model)`: the checkpoint in float32 with SDPA attention, torch on 2 threads."""
    import torch
    import transformers

    torch.set_num_threads(TORCH_THREADS)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa",
                                                              dtype=torch.float32)
    return torch, transformers.DynamicCache, model.eval()


def record(got: dict, stream: tuple[float, float], replays: list[tuple[float, float]], **values) -> None:
    """Appends a checkpoint's figures: its ms and CPU ms (the replays' medians, or the in-stream feed's without
    replays; each a `since` pair)."""
    timed = np.asarray(replays or [stream])
    for key, value in dict(values, stream_ms=stream[0], ms=float(np.median(timed[:, 0])),
                           cpu_ms=float(np.median(timed[:, 1]))).items():
        got.setdefault(key, []).append(value)


def omnijax_stream(model, chunks, histories, chunk: int, *, inner: int = 0, **fields) -> dict:
    """Feeds `chunks` into a new `Session(model, page_size=64, impl="xla", **fields)`; at each history in
    `histories` records the feed's ms, the last-token logits, the cells attended and, with `inner`, the median ms of
    `inner` re-feeds of the chunk from a copy of the state before it (the recorded ms then)."""
    import jax
    import jax.numpy as jnp

    import omnijax

    session = omnijax.Session(model, page_size=PAGE_SIZE, impl="xla", **fields)
    got = {}
    for i, piece in enumerate(chunks):
        at_checkpoint = i * chunk in histories
        saved = jax.tree.map(jnp.copy, session.state) if at_checkpoint and inner else None
        start = clock()
        result = session.feed(piece)
        jax.block_until_ready(result.logits)
        timed = since(start)
        if not at_checkpoint:
            continue
        replays = []
        for _ in range(inner):
            replay = omnijax.Session(model, session.stream_config, state=saved)
            start = clock()
            jax.block_until_ready(replay.feed(piece).logits)
            replays.append(since(start))
        record(got, timed, replays, logits=np.asarray(result.logits[0]).tolist(),
               cells=int(result.stats.attended.retained_cells[0]))
    kv = session.state.kv
    if bool(np.asarray(kv.exhausted).any()):
        raise RuntimeError(f"the KV pool of {kv.num_pages} pages ran out under {session.stream_config.policy}: "
                           f"{int(np.asarray(kv.dropped).sum())} token(s) were not cached")
    return got


def transformers_stream(torch, cache, model, ids, histories, chunk: int, *, inner: int = 0) -> dict:
    """The same as `omnijax_stream` for transformers; re-feeds crop the cache back to the history first."""
    got = {}

    def feed(piece):
        start = clock()
        out = model(input_ids=piece, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return since(start), out.logits[0, -1]

    with torch.inference_mode():
        for i in range(len(ids) // chunk):
            piece = torch.as_tensor(ids[None, i * chunk:(i + 1) * chunk])
            timed, logits = feed(piece)
            if i * chunk not in histories:
                continue
            replays = []
            for _ in range(inner):
                cache.crop(i * chunk)
                replays.append(feed(piece)[0])
            record(got, timed, replays, logits=logits.tolist())
    return got


def load_omnijax(omnijax_dir: Path, ids=None, chunk: int = 0):
    """The converted model and, with `ids`, their text chunks of `chunk` tokens as device arrays (chunk i: unit i)."""
    import jax
    import jax.numpy as jnp

    import omnijax
    from omnijax.chunks.chunk import text_chunk

    chunks = [] if ids is None else [jax.tree.map(jnp.asarray, text_chunk(ids[i:i + chunk], unit=i // chunk))
                                     for i in range(0, len(ids), chunk)]
    return omnijax.load(omnijax_dir), chunks
