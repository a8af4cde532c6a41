"""TideKV's prefill selectors beside kvpress's presses on the same weights: pass-key accuracy per compression ratio,
and whether the two keep the same KV entries.

Every pass-key prompt (one user message, the question last; `bench/quality/_common.py`) is compressed whole at
each ratio of `--ratios` by each pair, then the answer is decoded greedily:

    omnijax (model.prefill, layer-major)            kvpress 0.5.5 on transformers (sdpa)
    SnapKV(window, pool_kernel)                     SnapKVPress(ratio, window_size, kernel_size)
    AdaKV(window, pool_kernel, floor=0.2)           AdaKVPress(SnapKVPress(...), alpha_safeguard=0.2)
    SnapKV + pyramid_budgets(L * budget, L, window) PyramidKVPress(ratio, window_size, kernel_size, beta=20)
    ChunkKV(window, pool_kernel, chunk_length=20)   ChunkKVPress(SnapKVPress(...), chunk_length=20)
    KeyDiff()                                       KeyDiffPress(ratio)
    RecentTokens()                                  StreamingLLMPress(ratio, n_sink=0)

with the per-head budget `kvpress_budget(ratio, S)`. Each side runs in its own process (`--worker omnijax` /
`--worker kvpress`, started together; torch and JAX never share one) and records, per case, the answer and the kept
set of every layer and KV head (kvpress's found by matching the kept keys against an uncompressed run's, or AdaKV's
masked indices). The table gives both accuracies and the agreement of the kept sets (share of (layer, head) sets
that are identical, mean Jaccard) and of the answers. Writes `selectors.json` and `selectors.png` under `--out`.

    .venv/bin/python -m bench.quality.selectors --gguf SmolLM2-135M-Instruct.Q4_1.gguf
    .venv/bin/python -m bench.quality.selectors --smoke   # the tiny random Llama (bench/quality/_tiny.py), seconds
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import harness
from bench.quality import _common as common

SELECTORS = ("snapkv", "adakv", "adakv_kv", "pyramidkv", "pyramidkv_kv", "chunkkv", "keydiff", "recent")
"""`adakv_kv` / `pyramidkv_kv`: omnijax's AdaKV / SnapKV with kvpress's budget accounting (`kvpress_floor`,
`kvpress_pyramid`), beside the same presses as `adakv` / `pyramidkv`, which use omnijax's own accounting."""
WINDOW, KERNEL, CHUNK_LENGTH, FLOOR, BETA = 64, 5, 20, 0.2, 20
SMOKE = dict(lengths=[256], depths=[0.5], ratios=[0.5], selectors=["snapkv", "keydiff"])


def build_parser():
    p = harness.parser(__doc__)
    common.add_model_args(p)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024])
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    p.add_argument("--keys", type=int, default=1)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    p.add_argument("--selectors", nargs="+", default=list(SELECTORS), choices=SELECTORS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true",
                   help="each worker keeps the cases a stopped run with the same flags saved under --out")
    p.add_argument("--tag", default="",
                   help="names this run's work files under --out (selectors_TAG_cases.json, selectors_TAG_omnijax"
                        ".json, ...), so runs of other prompts or selectors keep theirs (default: no tag)")
    p.add_argument("--append", action="store_true",
                   help="selectors.json keeps the rows of an earlier run under --out for the cases this run does not "
                        "have (same selector, ratio, length, tokens, depth and key), so runs add up in one table")
    p.add_argument("--skip-done", action="store_true",
                   help="with --append: cases --out's selectors.json already has (same selector, ratio, length, "
                        "tokens, depth and key) are not run again, so a run with more --keys or --depths adds only "
                        "the new cases")
    p.add_argument("--collect", action="store_true",
                   help="no new run: the table from the cases both workers of the last run under --out finished")
    p.add_argument("--worker", choices=["omnijax", "kvpress"], help=argparse_hidden())
    p.add_argument("--cases", help=argparse_hidden())
    return p


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


def make_prompts(checkpoint: Path, args) -> list[dict]:
    """The pass-key prompts as token ids (the checkpoint's tokenizer and chat template)."""
    from omnijax.models.tokenizer import Tokenizer

    tok = Tokenizer.from_directory(checkpoint)
    out = []
    for length in args.lengths:
        for d, depth in enumerate(args.depths):
            for key in common.pass_keys(args.keys, args.seed + 1000 * length + 10 * d):
                body = common.haystack(_lines(tok, length), depth, key)
                text = tok.render([{"role": "user", "content": body + common.QUESTION}], add_generation_prompt=True)
                out.append(dict(length=length, depth=depth, key=key, ids=tok.encode(text)))
    return out


def _lines(tok, length):
    per_line = len(tok.encode(common.FILLER * 20)) / 20
    return max(1, int((length - len(tok.encode(common.INTRO)) - 60) / per_line))


def kvpress_pyramid(ratio: float, S: int, num_layers: int, window: int = WINDOW, beta: float = BETA) -> tuple:
    """Per-layer budgets as kvpress 0.5.5's PyramidKVPress counts them (window inside each layer's budget).

    Its ramp runs over the whole per-layer budget: the mean is `S * (1 - ratio)`, the bottom layer keeps about
    `2 * mean - mean / beta` (at most `S - window`, the top layer then taking what the cap cuts off), the top
    `mean / beta`; when the top would fall below the window every layer keeps the mean (no pyramid). omnijax's
    `pyramid_budgets` instead ramps the share beyond the window and adds the window to every layer: the same total,
    a different shape (see RESULTS.md).
    """
    mean = S * (1 - ratio)
    low = mean / beta
    high = 2 * mean - low
    if high >= S - window:
        high = S - window
        low = 2 * mean - high
    if not S >= high >= low >= window:
        return (max(1, round(mean)),) * num_layers
    step = (high - low) / (num_layers - 1) if num_layers > 1 else 0.0
    return tuple(round(high - layer * step) for layer in range(num_layers))


def kvpress_floor(ratio: float, S: int, alpha: float = FLOOR, window: int = WINDOW) -> float:
    """omnijax AdaKV's `floor` that guarantees each head what kvpress 0.5.5's AdaKVPress guarantees it.

    kvpress keeps each head's top `alpha * n_kept` scores (window included: SnapKV scores the window highest);
    omnijax guarantees the window plus `floor` of the per-head share beyond it. The floor returned makes the two
    guarantees the same number of tokens."""
    from omnijax.prefill import kvpress_budget

    budget = kvpress_budget(ratio, S)
    safe = max(1, int(budget * alpha))
    beyond = max(0, safe - window)
    share = budget - window
    return 0.0 if beyond == 0 or share <= 0 else min(1.0, (beyond + 0.5) / share)


def work_file(out: Path, tag: str, name: str) -> Path:
    """One run's work file under `out`: `selectors_NAME` without a tag, `selectors_TAG_NAME` with one."""
    return out / (f"selectors_{tag}_{name}" if tag else f"selectors_{name}")


def case_id(row: dict) -> tuple:
    """What names one case across runs: (selector, ratio, length, prompt tokens, depth, key)."""
    return (row["selector"], float(row["ratio"]), row["length"], row.get("tokens", len(row.get("ids", ()))),
            float(row["depth"]), row["key"])


def not_done(cases: list[dict], path: Path) -> list[dict]:
    """`--skip-done`: the `cases` whose case (`case_id`) has no row in the `selectors.json` at `path` (all of them
    when there is no such file)."""
    if not path.is_file():
        return cases
    done = {case_id(r) for r in json.loads(path.read_text())["rows"]}
    return [c for c in cases if case_id(c) not in done]


def budget_of(ratio: float, S: int, selector: str) -> int:
    from omnijax.prefill import kvpress_budget

    return kvpress_budget(ratio, S, chunk_length=CHUNK_LENGTH if selector == "chunkkv" else None)


# ------------------------------------------------------------------------------------------------------ workers
def omnijax_worker(cases: dict, source: Path, out: Path) -> None:
    import omnijax
    from omnijax import prefill as px

    model: Any = omnijax.load(source)  # an omnijax.Model: prefill is its method
    L = model.config.num_layers
    selectors = {"snapkv": px.SnapKV(WINDOW, KERNEL), "adakv": px.AdaKV(WINDOW, KERNEL, floor=FLOOR),
                 "pyramidkv": px.SnapKV(WINDOW, KERNEL), "pyramidkv_kv": px.SnapKV(WINDOW, KERNEL),
                 "chunkkv": px.ChunkKV(WINDOW, KERNEL, CHUNK_LENGTH), "keydiff": px.KeyDiff(),
                 "recent": px.RecentTokens()}
    rows, masks = _resumed(out, "omnijax", cases)
    for i, case in enumerate(cases["cases"]):
        if i < len(rows):
            continue
        ids = np.asarray([case["ids"]])
        S = ids.shape[1]
        budget = budget_of(case["ratio"], S, case["selector"])
        budgets: Any = budget
        selector = selectors.get(case["selector"])
        if case["selector"] == "pyramidkv":
            budgets = px.pyramid_budgets(L * budget, L, window=WINDOW, beta=BETA)
        elif case["selector"] == "pyramidkv_kv":  # omnijax refuses a budget of just the window: window + 1
            budgets = tuple(max(b, WINDOW + 1) for b in kvpress_pyramid(case["ratio"], S, L))
        elif case["selector"] == "adakv_kv":
            selector = px.AdaKV(WINDOW, KERNEL, floor=kvpress_floor(case["ratio"], S))
        started = time.perf_counter()
        res = model.prefill(ids, selector=selector, budgets=budgets, chunk=512, page=64,
                            room=common.ANSWER_TOKENS)
        tokens, _, _ = px.greedy(model.decoder, res.cache, res.logits, steps=common.ANSWER_TOKENS)
        answer = _text(model.tokenizer, np.asarray(tokens)[0].tolist(), model.config.eos_token_ids)
        kept = np.zeros((L, res.cache.layers[0].num_kv_heads, S), bool)
        for layer, lc in enumerate(res.cache.layers):
            index, offset, length = map(np.asarray, (lc.index, lc.offset, lc.length))
            for g in range(length.shape[1]):
                kept[layer, g, index[0, offset[0, g]:offset[0, g] + length[0, g]]] = True
        masks[f"case{i}"] = np.packbits(kept, axis=-1)
        rows.append(dict(case=i, answer=answer, cells=int(kept.sum()), seconds=time.perf_counter() - started))
        _save(out, "omnijax", rows, masks, cases.get("tag", ""))  # every case as it comes: a stopped run keeps its rows
        print(f"  omnijax [{i + 1}/{len(cases['cases'])}] {case['selector']}@{case['ratio']} S={S}: {answer[:40]!r}",
              flush=True)
    _save(out, "omnijax", rows, masks, cases.get("tag", ""))


def kvpress_worker(cases: dict, reference: Path, out: Path) -> None:
    import kvpress
    import torch
    from transformers import DynamicCache

    hf, tok = common.load_transformers(reference)
    L = hf.config.num_hidden_layers

    def snap(ratio):
        return kvpress.SnapKVPress(compression_ratio=ratio, window_size=WINDOW, kernel_size=KERNEL)

    presses = {"snapkv": snap, "adakv": lambda r: kvpress.AdaKVPress(snap(r), alpha_safeguard=FLOOR),
               "adakv_kv": lambda r: kvpress.AdaKVPress(snap(r), alpha_safeguard=FLOOR),
               "pyramidkv_kv": lambda r: kvpress.PyramidKVPress(compression_ratio=r, window_size=WINDOW,
                                                                kernel_size=KERNEL, beta=BETA),
               "pyramidkv": lambda r: kvpress.PyramidKVPress(compression_ratio=r, window_size=WINDOW,
                                                             kernel_size=KERNEL, beta=BETA),
               "chunkkv": lambda r: kvpress.ChunkKVPress(press=snap(r), chunk_length=CHUNK_LENGTH),
               "keydiff": lambda r: kvpress.KeyDiffPress(compression_ratio=r),
               "recent": lambda r: kvpress.StreamingLLMPress(compression_ratio=r, n_sink=0)}
    full_keys: dict[tuple, list] = {}
    rows, masks = _resumed(out, "kvpress", cases)
    for i, case in enumerate(cases["cases"]):
        if i < len(rows):
            continue
        ids = torch.as_tensor([case["ids"]])
        S = ids.shape[1]
        if tuple(case["ids"]) not in full_keys:
            cache = DynamicCache()
            with torch.inference_mode():
                hf(input_ids=ids, past_key_values=cache, use_cache=True)
            full_keys[tuple(case["ids"])] = [layer.keys[0].numpy() for layer in cache.layers]
        full = full_keys[tuple(case["ids"])]
        started = time.perf_counter()
        press = presses[case["selector"]](case["ratio"])
        cache = DynamicCache()
        with torch.inference_mode():
            with press(hf):
                logits = hf(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
            kept = np.zeros((L, full[0].shape[0], S), bool)
            for layer, lc in enumerate(cache.layers):
                masked = getattr(hf.model.layers[layer].self_attn, "masked_key_indices", None)
                if masked is not None:  # AdaKV: entries stay in the cache, masked in attention
                    kept[layer] = True
                    kept[layer, masked[1].numpy(), masked[2].numpy()] = False
                    continue
                k = lc.keys[0].numpy()  # [G, n, d]: exact copies of full-cache rows
                for g in range(k.shape[0]):
                    kept[layer, g, _row_indices(k[g], full[layer][g])] = True
            generated = []
            for step in range(common.ANSWER_TOKENS):  # at the true positions S, S + 1, ... (the cache is shorter)
                token = int(logits[0].argmax())
                generated.append(token)
                if token in _eos(hf):
                    break
                logits = hf(input_ids=torch.as_tensor([[token]]), past_key_values=cache, use_cache=True,
                            position_ids=torch.as_tensor([[S + step]])).logits[:, -1]
        for layer in hf.model.layers:  # AdaKV's mask must not outlive its case
            layer.self_attn.masked_key_indices = None
        answer = tok.decode(generated, skip_special_tokens=True).strip()
        masks[f"case{i}"] = np.packbits(kept, axis=-1)
        rows.append(dict(case=i, answer=answer, cells=int(kept.sum()), seconds=time.perf_counter() - started))
        _save(out, "kvpress", rows, masks, cases.get("tag", ""))
        print(f"  kvpress [{i + 1}/{len(cases['cases'])}] {case['selector']}@{case['ratio']} S={S}: {answer[:40]!r}",
              flush=True)
    _save(out, "kvpress", rows, masks, cases.get("tag", ""))


def _row_indices(kept: np.ndarray, full: np.ndarray) -> np.ndarray:
    """Where each row of `kept [n, d]` sits in `full [S, d]`: the first row of `full` equal to it element by element
    (the same answer as comparing every pair, found by the rows' bytes; a row whose bytes match no row of `full`,
    such as -0.0 against 0.0, falls back to comparing it against every row).

    Raises:
        ValueError: a kept row equals no row of `full` (the press changed a key, so the kept set is unknown).
    """
    first: dict[bytes, int] = {}
    for i, row in enumerate(np.ascontiguousarray(full)):
        first.setdefault(row.tobytes(), i)
    out = np.empty(len(kept), np.int64)
    for j, row in enumerate(np.ascontiguousarray(kept)):
        i = first.get(row.tobytes())
        if i is None:
            match = np.all(row[None] == full, axis=-1)
            if not match.any():
                raise ValueError(f"kept key row {j} equals no row of the uncompressed cache")
            i = int(match.argmax())
        out[j] = i
    return out


def _eos(hf) -> set:
    eos = hf.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def _text(tokenizer, tokens, eos) -> str:
    cut = []
    for t in tokens:
        if t < 0:
            break
        cut.append(t)
        if t in eos:
            break
    return tokenizer.decode(cut, skip_special_tokens=True).strip()


def _resumed(out: Path, side: str, cases: dict) -> tuple[list, dict]:
    """The rows and kept masks a stopped run of this side saved for the same cases (`--resume`), else none."""
    tag = cases.get("tag", "")
    rows_path, masks_path = work_file(out, tag, f"{side}.json"), work_file(out, tag, f"{side}_kept.npz")
    if not cases.get("resume") or not rows_path.is_file() or not masks_path.is_file():
        return [], {}
    rows = json.loads(rows_path.read_text())
    with np.load(masks_path) as saved:
        masks = {k: saved[k] for k in saved.files}
    print(f"  {side}: resuming after {len(rows)} saved cases", flush=True)
    return rows, masks


def _save(out: Path, side: str, rows, masks, tag: str = "") -> None:
    np.savez_compressed(work_file(out, tag, f"{side}_kept.npz"), **masks)
    work_file(out, tag, f"{side}.json").write_text(json.dumps(rows))


# ------------------------------------------------------------------------------------------------------ parent
def agreement(a: np.ndarray, b: np.ndarray, S: int) -> tuple[float, float]:
    """(share of identical (layer, head) kept sets, mean Jaccard) of two packed `[L, G, S]` masks."""
    a = np.unpackbits(a, axis=-1, count=S).astype(bool)
    b = np.unpackbits(b, axis=-1, count=S).astype(bool)
    same = np.all(a == b, axis=-1)
    inter, union = (a & b).sum(-1), (a | b).sum(-1)
    return float(same.mean()), float(np.mean(inter / np.maximum(union, 1)))


def appended(path: Path, rows: list[dict], reference: str, tiny: bool) -> list[dict]:
    """`--append`: the rows of an earlier `selectors.json` at `path` whose cases this run does not have, then this
    run's `rows` (none kept when there is no such file).

    Raises:
        SystemExit: the earlier file was run on other weights (its rows would not compare).
    """
    if not path.is_file():
        return rows
    old = json.loads(path.read_text())
    if (Path(str(old.get("model"))).resolve() != Path(reference).resolve()
            or bool(old.get("random_weights")) != bool(tiny)):
        raise SystemExit(f"--append: {path} holds rows of {old.get('model')!r}, this run is on {reference!r}; "
                         "pass another --out")
    mine = {case_id(r) for r in rows}
    kept = [r for r in old["rows"] if case_id(r) not in mine]
    print(f"--append: {len(kept)} rows of {path} kept beside this run's {len(rows)}", flush=True)
    return kept + rows


def run_workers(spec: Path, out: Path, inline: bool = False) -> None:
    """Runs the two sides' workers at the same time (their own processes; each is mostly single-threaded while it
    imports and compiles) and waits for both; one failing stops the other. `inline` (a `--smoke` check): one after
    the other in this process (`harness.run_worker`), what they print passed on."""
    started = time.perf_counter()
    if inline:
        for side in ("omnijax", "kvpress"):
            done = harness.run_worker(harness.module_command(__spec__.name, "--worker", side, "--cases", spec, "--out",
                                                             out), inline=True)
            print(done.stdout, end="", flush=True)
            print(done.stderr, end="", file=sys.stderr, flush=True)
            if done.returncode != 0:
                raise SystemExit(f"the {side} worker exited {done.returncode} (its traceback is above)")
            print(f"{side}: {time.perf_counter() - started:.0f} s", flush=True)
        return
    workers = {side: subprocess.Popen(harness.module_command(__spec__.name, "--worker", side, "--cases", spec,
                                                             "--out", out), cwd=harness.ROOT)
               for side in ("omnijax", "kvpress")}
    try:
        pending = dict(workers)
        while pending:
            for side, w in list(pending.items()):
                if w.poll() is None:
                    continue
                del pending[side]
                if w.returncode != 0:
                    raise SystemExit(f"the {side} worker exited {w.returncode} (its traceback is above)")
                print(f"{side}: {time.perf_counter() - started:.0f} s", flush=True)
            time.sleep(0.1)
    finally:
        for w in workers.values():
            if w.poll() is None:
                w.kill()
                w.wait()


def main(argv=None):
    argv = ["--smoke" if a == "--quick" else a for a in (sys.argv[1:] if argv is None else argv)]
    args = harness.parse(build_parser(), argv, smoke=SMOKE)
    common.quiet_threads()
    out = harness.output_dir(args)
    if args.worker:
        cases = json.loads(Path(args.cases).read_text())
        if args.worker == "omnijax":
            omnijax_worker(cases, Path(cases["checkpoint"]), out)
        else:
            kvpress_worker(cases, Path(cases["reference"]), out)
        return
    if args.skip_done and not args.append:
        raise SystemExit("--skip-done keeps the earlier rows only with --append (without it selectors.json would hold "
                         "this run's cases alone): pass --append too")
    spec = work_file(out, args.tag, "cases.json")
    if args.collect:
        if not spec.is_file():
            raise SystemExit(f"--collect: {spec} is missing; run without --collect first")
        meta = json.loads(spec.read_text())
        cases, reference = meta["cases"], meta["reference"]
        tiny = meta.get("random_weights", not Path(reference).is_file())  # the smoke model is a folder
    else:
        source = common.model_source(args)
        if source.reference is None:
            raise SystemExit("kvpress runs transformers on the GGUF file: pass --gguf FILE (the same weights omnijax "
                             "converts), not --checkpoint")
        reference, tiny = source.reference, source.tiny
        prompts = make_prompts(source.checkpoint, args)
        # ratio-major (the first ratio of --ratios for every selector first): a run stopped early has whole ratios
        cases = [dict(p, selector=s, ratio=r) for r in args.ratios for s in args.selectors for p in prompts]
        if args.skip_done:
            planned, cases = len(cases), not_done(cases, out / "selectors.json")
            print(f"--skip-done: {planned - len(cases)} of {planned} cases already in {out / 'selectors.json'}",
                  flush=True)
            if not cases:
                raise SystemExit("--skip-done: every case of this run is already in selectors.json; nothing to run")
        if args.resume and spec.is_file() and json.loads(spec.read_text())["cases"] != cases:
            raise SystemExit(f"--resume: {spec} holds other cases than this run's; pass the same flags or another "
                             "--out")
        spec.write_text(json.dumps(dict(checkpoint=str(source.checkpoint), reference=reference, random_weights=tiny,
                                        resume=args.resume, tag=args.tag, cases=cases)))
        print(f"{len(prompts)} prompts x {len(args.selectors)} selectors x {len(args.ratios)} ratios = {len(cases)} "
              "cases per side", flush=True)
        run_workers(spec, out, inline=args.smoke)
    results = {side: (json.loads(work_file(out, args.tag, f"{side}.json").read_text()),
                      np.load(work_file(out, args.tag, f"{side}_kept.npz"))) for side in ("omnijax", "kvpress")}
    done = min(len(results["omnijax"][0]), len(results["kvpress"][0]))
    if done < len(cases):
        print(f"--collect: {done} of {len(cases)} cases done on both sides; the table has those", flush=True)
        cases = cases[:done]
    rows = []
    for i, case in enumerate(cases):
        oj, om = results["omnijax"][0][i], results["omnijax"][1]
        kp, km = results["kvpress"][0][i], results["kvpress"][1]
        same, jaccard = agreement(om[f"case{i}"], km[f"case{i}"], len(case["ids"]))
        rows.append(dict(selector=case["selector"], ratio=case["ratio"], length=case["length"], tokens=len(case["ids"]),
                         depth=case["depth"], key=case["key"], omnijax_answer=oj["answer"], kvpress_answer=kp["answer"],
                         omnijax_right=common.contains_key(oj["answer"], case["key"]),
                         kvpress_right=common.contains_key(kp["answer"], case["key"]),
                         omnijax_cells=oj["cells"], kvpress_cells=kp["cells"], sets_identical=same, jaccard=jaccard,
                         answers_equal=oj["answer"] == kp["answer"]))
    complete = len(rows) == len(json.loads(spec.read_text())["cases"])
    if args.append:
        rows = appended(out / "selectors.json", rows, reference, tiny)
    harness.write_json(out, "selectors", dict(model=reference, random_weights=tiny, window=WINDOW,
                                              pool_kernel=KERNEL, chunk_length=CHUNK_LENGTH, complete=complete,
                                              rows=rows))
    names = [s for s in SELECTORS if any(x["selector"] == s for x in rows)]
    table = []
    for s in names:
        for r in sorted({x["ratio"] for x in rows}):
            group = [x for x in rows if x["selector"] == s and x["ratio"] == r]
            if not group:
                continue
            table.append(dict(selector=s, ratio=r, n=len(group),
                              omnijax=np.mean([x["omnijax_right"] for x in group]),
                              kvpress=np.mean([x["kvpress_right"] for x in group]),
                              same=np.mean([x["sets_identical"] for x in group]),
                              jaccard=np.mean([x["jaccard"] for x in group]),
                              answers=np.mean([x["answers_equal"] for x in group])))
    print("\naccuracy (omnijax / kvpress), kept sets identical (share of layer-head sets), mean Jaccard, equal answers")
    harness.print_table(table, [("selector", "selector", ""), ("ratio", "ratio", ".2f"), ("n", "n", "d"),
                                ("omnijax", "omnijax", ".2f"), ("kvpress", "kvpress", ".2f"),
                                ("sets same", "same", ".3f"), ("jaccard", "jaccard", ".3f"),
                                ("answers eq", "answers", ".2f")])
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, side in zip(axes, ("omnijax", "kvpress")):
        for s in names:
            mine = [t for t in table if t["selector"] == s]
            ax.plot([t["ratio"] for t in mine], [t[side] for t in mine], marker="o", label=s)
        ax.set_title(f"{side}: pass-key accuracy")
        ax.set_xlabel("compression ratio")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy")
    axes[1].legend(fontsize=8)
    harness.save_png(fig, out, "selectors")


if __name__ == "__main__":
    main()
