"""OVO-Bench on omnijax: backward tracing, real-time perception and forward active responding as streaming sessions.

The annotation file (`ovo_bench_new.json`, JoeLeelyf/OVO-Bench, CC BY-NC-SA 4.0) is not shipped: `--data PATH`
reads the user's copy. One JSON list of records, all times in seconds from the video start:
- backward tracing (BT: EPM, ASI, HLD) and real-time perception (RT: OCR, ACR, ATR, STU, FPD, OJR), multiple choice:
  `{id, task, video, realtime, question, options[2-5], gt, answer}`; `gt` is the correct option's 0-based index;
- forward active responding (FAR), a list of probes `test_info[i]` asked at their `realtime`s:
  REC `{activity, test_info: [{realtime, count}]}` ("how many times did they {activity}?", answer `count`),
  SSR `{tutorial, test_info: [{realtime, step, type}]}` ("is the person performing {step} now?", `type` 1 = Yes),
  CRR `{question, ask_time, clue_time, test_info: [{realtime, type}]}` ("does the video so far answer it?").

Sessions (`probes.build_probe_session`, StreamingBench's layout): upstream cuts a clip from 0 to `ceil(realtime)`
for every question; here the video streams in 2 s units and a question is asked after the unit containing
`ceil(realtime)`. The multiple-choice questions of one video share one session (in time order, as StreamingBench
groups a video's questions); each FAR record is one session asking its probes repeatedly at their times (in time
order, ties in file order), every answer staying in the context as in a live session.

Scoring (OVO-Bench's `utils/OVOBenchScore.py`, the `generated` scorer): BT/RT correct when the gt letter is a
substring of the response; REC when the response's digits, joined, equal `count`; SSR/CRR when the expected "Yes" /
"No" is a substring of the response or the response is exactly "Y" / "N". Each probe is one item. Per-task accuracy
first, each category the unweighted mean of its tasks, the total the mean of BT, RT and FAR. A `loglik` scorer is
reported beside it where a closed answer set exists (the option letters; the first tokens of "Yes" / "No"); REC has
none.

    python -m omnijax.eval.ovobench --data ovo_bench_new.json --demo --max-sessions 3 --max-units 8
    python -m omnijax.eval.ovobench --data ovo_bench_new.json --checkpoint /ckpt/omni7b-jax \\
        --video-root /data/OVO-Bench/src_videos --mesh 8x1 --configs full omnipick --out ovo.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import math
import re
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
from jax.sharding import Mesh

from omnijax import compilation_cache
from omnijax.eval import annotations as ann
from omnijax.eval import mesh as distributed
from omnijax.eval import probes as probes_lib
from omnijax.eval import sessions as sessions_lib
from omnijax.eval.media import TextEncoder
from omnijax.eval.runner import EvalConfig
from omnijax.models.decoder import Decoder
from omnijax.models.family import OmniModel

BACKWARD = ("EPM", "ASI", "HLD")
REALTIME = ("OCR", "ACR", "ATR", "STU", "FPD", "OJR")
FORWARD = ("REC", "SSR", "CRR")
CATEGORIES = {"backward": BACKWARD, "realtime": REALTIME, "forward": FORWARD}
CATEGORY_OF = {task: category for category, tasks in CATEGORIES.items() for task in tasks}
MAX_OPTIONS = 5
YES_NO = "Answer with Yes or No."


@dataclasses.dataclass(frozen=True)
class Item:
    """One scored item: a multiple-choice question or one FAR probe.

    Attributes:
        id: the record's `id`.
        probe: index in the record's `test_info` (-1 for a multiple-choice question).
        task: the task code (e.g. "EPM").
        video: the record's video path.
        realtime: the annotated time (seconds); the item is asked at `ceil(realtime)`.
        text: the user turn's text.
        expected: the correct option's letter, "Yes" / "No", or the count's digits.
        options: number of options (multiple choice) else 0.
    """

    id: int
    probe: int
    task: str
    video: str
    realtime: float
    text: str
    expected: str
    options: int = 0

    @property
    def category(self) -> str:
        return CATEGORY_OF[self.task]

    @property
    def key(self) -> str:
        return str(self.id) if self.probe < 0 else f"{self.id}/{self.probe}"

    @property
    def time_s(self) -> float:
        return float(math.ceil(self.realtime - 1e-9))


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ann.AnnotationError(f"{what} must be a non-negative number, got {value!r}")
    return float(value)


def _multiple_choice(r: dict) -> list[Item]:
    options = r.get("options")
    if not isinstance(options, list) or not 2 <= len(options) <= MAX_OPTIONS:
        raise ann.AnnotationError(f"options must be a list of 2-{MAX_OPTIONS}, got {options!r}")
    gt = r.get("gt")
    if isinstance(gt, bool) or not isinstance(gt, int) or not 0 <= gt < len(options):
        raise ann.AnnotationError(f"gt {gt!r} is not an index into {len(options)} options")
    question = ann.Question(r["task"], str(r.get("question", "")), 0.0, tuple(str(o) for o in options),
                            ann.LETTERS[gt], int(r["id"]))
    return [Item(int(r["id"]), -1, r["task"], r["video"], _number(r.get("realtime"), "realtime"),
                 sessions_lib.prompt_text(question), ann.LETTERS[gt], len(options))]


def _forward(r: dict) -> list[Item]:
    task, probes = r["task"], r.get("test_info")
    if not isinstance(probes, list) or not probes:
        raise ann.AnnotationError("test_info must be a non-empty list of probes")
    out = []
    for i, p in enumerate(probes):
        realtime = _number(p.get("realtime"), f"test_info[{i}].realtime")
        if task == "REC":
            count = p.get("count")
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ann.AnnotationError(f"test_info[{i}].count must be a non-negative integer, got {count!r}")
            text = (f"People in this video may repeat an action. How many times did they {r['activity']} so far? "
                    f"Answer with a number.")
            expected = str(count)
        else:
            kind = p.get("type")
            if kind not in (0, 1) or isinstance(kind, bool):
                raise ann.AnnotationError(f"test_info[{i}].type must be 0 or 1, got {kind!r}")
            if task == "SSR":
                text = (f"You are watching a tutorial ({r.get('tutorial', '')}). Is the person currently performing "
                        f"this step: {p['step']}? {YES_NO}")
            else:
                text = (f"{r['question']}\nDoes the video so far give enough information to answer this question? "
                        f"{YES_NO}")
            expected = "Yes" if kind == 1 else "No"
        out.append(Item(int(r["id"]), i, task, r["video"], realtime, text, expected))
    return out


def load(path: str | Path) -> tuple[list[Item], list[str]]:
    """Items of an OVO-Bench annotation file, and the records that could not be used (with the reason).

    Raises:
        AnnotationError: the file is not a JSON list of records.
    """
    path = Path(path)
    data = ann.read_json_list(path, "the OVO-Bench annotations")
    items, issues = [], []
    for n, r in enumerate(data):
        where = f"{path.name}: record {n} (id {r.get('id') if isinstance(r, dict) else '?'})"
        try:
            if not isinstance(r, dict) or not {"id", "task", "video"} <= r.keys():
                raise ann.AnnotationError("lacks id, task or video")
            if r["task"] not in CATEGORY_OF:
                raise ann.AnnotationError(f"unknown task {r['task']!r}")
            items.extend(_forward(r) if r["task"] in FORWARD else _multiple_choice(r))
        except (ann.AnnotationError, KeyError, TypeError, ValueError) as e:
            issues.append(f"{where}: skipped: {e}")
    return items, issues


@dataclasses.dataclass(frozen=True)
class SessionPlan:
    """The items one session asks: a video's multiple-choice questions, or one FAR record's probes."""

    name: str
    video: str
    category: str
    items: tuple[Item, ...]


def plan_sessions(items: Sequence[Item]) -> list[SessionPlan]:
    """Multiple-choice questions grouped per video, FAR probes per record; in order of first appearance."""
    groups: dict[tuple, list[Item]] = {}
    for item in items:
        key = ("far", item.id) if item.probe >= 0 else ("mc", item.video)
        groups.setdefault(key, []).append(item)
    out = []
    for (kind, ident), group in groups.items():
        name = f"{group[0].task} {ident}" if kind == "far" else group[0].video
        out.append(SessionPlan(name, group[0].video, group[0].category, tuple(group)))
    return out


def select(plans: Sequence[SessionPlan], *, max_sessions: int | None = None, max_units: int | None = None,
           unit_seconds: float = 2.0) -> list[SessionPlan]:
    """Sessions asking something inside the first `max_units` units; with `max_sessions`, the first that many
    taken in turn from the categories (backward, real-time, forward) so a smoke run covers each."""
    if max_units is not None:
        plans = [p for p in plans if any(ann.unit_of(i.time_s, unit_seconds) < max_units for i in p.items)]
    if max_sessions is None:
        return list(plans)
    queues = [[p for p in plans if p.category == c] for c in CATEGORIES]
    order = [p for row in itertools.zip_longest(*queues) for p in row if p is not None]
    return order[:max_sessions]


def score_ids(encoder: TextEncoder) -> list[int]:
    """Log-likelihood columns: the option letters A-E, then the first tokens of "Yes" and "No"."""
    return (sessions_lib.letter_ids(encoder, MAX_OPTIONS) + [probes_lib.first_token_id(encoder, "Yes"),
                                                            probes_lib.first_token_id(encoder, "No")])


def correct_generated(item: Item, response: str) -> bool:
    """OVO-Bench's rule for a generated response (see the module docstring)."""
    if item.options:
        return item.expected in response
    if item.task == "REC":
        return "".join(re.findall(r"\d", response)) == item.expected
    return item.expected in response or response.strip() == item.expected[0]


def correct_loglik(item: Item, scores: Sequence[float]) -> bool | None:
    """The closed-set prediction from the score columns (`score_ids`); None for REC (no closed set)."""
    if item.options:
        return ann.LETTERS[int(np.argmax(scores[:item.options]))] == item.expected
    if item.task == "REC" or len(scores) < MAX_OPTIONS + 2:
        return None
    return ("Yes" if scores[MAX_OPTIONS] >= scores[MAX_OPTIONS + 1] else "No") == item.expected


def score(rows: Sequence[dict], items: dict[str, Item]) -> list[dict]:
    """`probes.answers` rows -> records with the item's fields and both scorers' verdicts."""
    records = []
    for row in rows:
        item = items[row["key"]]
        records.append({**row, "id": item.id, "probe": item.probe, "category": item.category,
                        "realtime": item.realtime, "expected": item.expected,
                        "correct_generated": correct_generated(item, row["generated"]),
                        "correct_loglik": correct_loglik(item, row["scores"])})
    return records


def aggregate(records: Sequence[dict]) -> dict[str, dict]:
    """Per configuration: per-task accuracy, category means of task accuracies, total = mean of the categories."""
    out = {}
    for config in dict.fromkeys(r["config"] for r in records):
        tasks = collections.defaultdict(list)
        for r in records:
            if r["config"] == config:
                tasks[r["task"]].append(r)
        per_task = {}
        for task, rs in tasks.items():
            ll = [r["correct_loglik"] for r in rs if r["correct_loglik"] is not None]
            per_task[task] = {"n": len(rs), "generated": float(np.mean([r["correct_generated"] for r in rs])),
                              "loglik": float(np.mean(ll)) if ll else float("nan")}
        categories = {}
        for category, names in CATEGORIES.items():
            present = [per_task[t] for t in names if t in per_task]
            if present:
                categories[category] = {key: probes_lib.mean([p[key] for p in present])
                                        for key in ("generated", "loglik")}
        total = {key: probes_lib.mean([c[key] for c in categories.values()]) for key in ("generated", "loglik")}
        out[config] = {"tasks": dict(sorted(per_task.items())), "categories": categories, "total": total}
    return out


def run(model: OmniModel | Decoder, items: Sequence[Item], configs: Sequence[EvalConfig], *, encoder: TextEncoder,
        video_root: str | Path | None = None, mesh: Mesh | None = None, answer_tokens: int = 4,
        max_sessions: int | None = None, max_units: int | None = None, past_end: str = "clamp",
        batch_size: int | None = None, unit_seconds: float = 2.0, progress: bool = True,
        notices: list[str] | None = None) -> dict:
    """Builds the sessions, evaluates them under every configuration and scores every item.

    Returns:
        `{"records", "scores", "summary", "left_out", "notices"}` (see `aggregate`, `probes.run_summary`).
    """
    notices = [] if notices is None else notices
    builder = probes_lib.PromptBuilder(model, encoder, unit_seconds=unit_seconds)
    if builder.notice:
        notices.append(builder.notice)
    plans = select(plan_sessions(items), max_sessions=max_sessions, max_units=max_units, unit_seconds=unit_seconds)
    sources = probes_lib.open_all([p.video for p in plans], video_root, unit_seconds, notices)
    sessions = []
    for plan, source in zip(plans, sources):
        asked = [probes_lib.Probe(i.key, i.task, i.time_s, i.text, n, options=i.options)
                 for n, i in enumerate(plan.items)]
        sessions.append(probes_lib.build_probe_session(plan.name, plan.video, asked, source, builder,
                                                       answer_tokens=answer_tokens, max_units=max_units,
                                                       past_end=past_end))
    results, rows = probes_lib.execute(model, sessions, configs, builder, score_ids=score_ids(encoder), mesh=mesh,
                                       batch_size=batch_size, progress=progress)
    records = score(rows, {i.key: i for i in items})
    left_out = [{"session": s.name, "key": p.key, "task": p.task, "reason": why} for s in sessions
                for p, why in s.left_out]
    return {"records": records, "scores": aggregate(records), "summary": probes_lib.run_summary(results, rows),
            "left_out": left_out, "notices": notices}


def format_scores(report: dict) -> str:
    """The time / KV lines and every task, category and total score per configuration."""
    metrics = {}
    for config, s in report["scores"].items():
        rows = {task: v for task, v in s["tasks"].items()}
        rows.update({f"[{c}]": v for c, v in s["categories"].items()})
        rows["[total]"] = s["total"]
        metrics[config] = rows
    return probes_lib.format_report(report["summary"], metrics)


def main(argv: Sequence[str] | None = None) -> int:
    compilation_cache.enable()  # a command line caches its compiled programs (OMNIJAX_COMPILATION_CACHE)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="the OVO-Bench annotation file (ovo_bench_new.json)")
    parser.add_argument("--tasks", nargs="*", help=f"task codes to run (default all: {', '.join(CATEGORY_OF)})")
    parser.add_argument("--answer-tokens", type=int, default=4)
    probes_lib.add_common_args(parser)
    args = parser.parse_args(argv)
    distributed.initialize(distributed.cluster_from_args(args))  # before any other JAX work

    notices: list[str] = []
    try:  # the cheap checks first: tasks, annotations, then configurations, mesh and model
        unknown = sorted(set(args.tasks or ()) - set(CATEGORY_OF))
        if unknown:
            raise ValueError(f"unknown tasks {unknown}; known: {list(CATEGORY_OF)}")
        items, issues = load(args.data)
        notices.extend(issues)
        if args.tasks:
            items = [i for i in items if i.task in args.tasks]
        configs, mesh, model, encoder = probes_lib.prepare(args, args.answer_tokens, notices, "ovo_demo_")
        report = run(model, items, configs, encoder=encoder, video_root=args.video_root, mesh=mesh,
                     answer_tokens=args.answer_tokens, max_sessions=args.max_sessions, max_units=args.max_units,
                     past_end=args.past_end, batch_size=args.batch_size, progress=distributed.is_main_process(),
                     notices=notices)
    except ValueError as e:  # AnnotationError, CheckpointFormatError and bad settings are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 1
    if distributed.is_main_process():
        probes_lib.print_notices(report["notices"])
        print(format_scores(report))
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
