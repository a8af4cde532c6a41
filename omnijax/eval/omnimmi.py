"""OmniMMI on omnijax: its six tasks as streaming sessions, timed as the benchmark's online-model protocol.

The question files ship with omnijax (`data/omnimmi/`, OmniMMI/OmniMMI `omnimmi/`, MIT licence beside them;
`--data DIR` reads another copy). One session per record, 2 s audiovisual units (`probes.build_probe_session`, the
StreamingBench layout), each query asked after the unit containing its time:
- SG (dynamic state grounding) and MD (multi-turn dependency reasoning): turn i at the midpoint (s + e) / 2 of its
  span `"s -- e"`; earlier turns and answers stay in the context. Upstream replaces `##ANSWER##` in an MD question
  by the model's own previous answer at run time; `omnijax.evaluate` runs a whole session as one jitted program and
  cannot feed an answer back into a later chunk, so here `##ANSWER##` is replaced by the gold previous answer
  (`Turn.raw_question` keeps the annotation; errors do not carry forward, so MD scores here are an upper bound on
  the benchmark's).
- AP (action prediction): asked 5 frames (2.5 s at 2 fps) before the end, the `vocab` list appended to the prompt.
- SI (speaker identification): asked at `timestamp`.
- PA (proactive alerting): the request at t = 0, then a yes/no poll after every unit ("is it happening now?"); a
  "yes" is a response at the end of that unit. Scored: hit (the first response time lies in the `answer` window),
  precision (share of response times in the window), IoU (first-to-last response span against the window).
- PT (proactive turn-taking): 5 frames before the end, the last (human, assistant) turn as history, then the final
  human remark; hit when the model stays silent (nothing before `<|im_end|>`, or a reply starting with `<2>`).
Videos without a duration of their own (synthetic media) last `--synthetic-seconds`, PA's the length its
`SRC_from_to.mp4` name gives. With `--max-units` a session ends at the cut: AP and PT are asked 5 frames before the
cut, PA polls up to it, and SG / MD / SI records asking nothing before it are not run.

SG, MD, AP and SI are open-ended and judged upstream by GPT (yes/no per answer); no judge runs here. Their
predictions go to the report and, with `--judge-out`, to a JSON list of `{task, video, index, turn, question,
answer, prediction, ...}` for the user's judge; `score_judged` turns judged rows back into the benchmark's
accuracies (AP/SI: share of "yes"; SG/MD: share of records whose turns are all "yes", plus per-turn accuracy).

    python -m omnijax.eval.omnimmi --demo --max-sessions 1 --max-units 6
    python -m omnijax.eval.omnimmi --checkpoint /ckpt/omni7b-jax --video-root /data/OmniMMI/videos \\
        --mesh 8x1 --configs full omnipick --answer-tokens 64 --out omnimmi.json --judge-out omnimmi_judge.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import sys
from importlib import resources
from pathlib import Path
from typing import Sequence

from jax.sharding import Mesh

from omnijax import compilation_cache
from omnijax.eval import annotations as ann
from omnijax.eval import mesh as distributed
from omnijax.eval import probes as probes_lib
from omnijax.eval.media import TextEncoder
from omnijax.eval.runner import EvalConfig
from omnijax.models.decoder import Decoder
from omnijax.models.family import OmniModel

FILES = {"SG": "dynamic_state_grounding.json", "MD": "multiturn_dependency_reasoning.json",
         "AP": "action_prediction.json", "SI": "speaker_identification.json", "PA": "proactive_alerting.json",
         "PT": "proactive_turntaking.json"}
JUDGED = ("SG", "MD", "AP", "SI")
ANSWER_MARK = "##ANSWER##"
END_FRAMES = 5  # AP and PT are asked this many frames before the end
POLL = "Is it happening now? Answer with Yes or No."


@dataclasses.dataclass(frozen=True)
class Turn:
    """One query of a record.

    Attributes:
        question: the text asked (MD: `##ANSWER##` replaced by the gold previous answer).
        answer: the reference answer ("" for PT).
        time_s: when it is asked; None: `END_FRAMES` frames before the end (AP, PT) or t = 0 (PA).
        span: SG / MD: the turn's annotated span (s, e).
        raw_question: the question as annotated.
    """

    question: str
    answer: str
    time_s: float | None
    span: tuple[float, float] | None = None
    raw_question: str = ""


@dataclasses.dataclass(frozen=True)
class Record:
    """One record (one session): its task, position in its file, video and queries.

    Attributes:
        window: PA: the (start, end) seconds in which the model should speak up.
        history: PT: the (human, assistant) turns given before the final remark.
        vocab: AP: the candidate next steps.
    """

    task: str
    index: int
    video: str
    turns: tuple[Turn, ...]
    window: tuple[float, float] | None = None
    history: tuple[tuple[str, str], ...] = ()
    vocab: tuple[str, ...] = ()


def packaged_root() -> Path:
    """The OmniMMI question files shipped with omnijax (package data of `omnijax.eval`)."""
    return Path(str(resources.files("omnijax.eval").joinpath("data", "omnimmi")))


def parse_span(text: str) -> tuple[float, float]:
    """`"56.0 -- 74.0"` -> (56.0, 74.0)."""
    parts = str(text).split("--")
    try:
        if len(parts) != 2:
            raise ValueError
        start, end = (float(p) for p in parts)
    except ValueError:
        raise ann.AnnotationError(f"unparseable span {text!r} (want 's -- e')") from None
    if start < 0 or end < 0:
        raise ann.AnnotationError(f"negative time in span {text!r}")
    return start, end


def _record(task: str, index: int, r: dict, notes: list[str]) -> Record:
    video = str(r["video"])
    if task in ("SG", "MD"):
        turns, previous = [], None
        for q in r["qa"]:
            start, end = parse_span(q["timestamp"])
            raw = str(q["question"])
            if ANSWER_MARK in raw and previous is None:  # no earlier answer to put there: asked as annotated
                notes.append(f"{ANSWER_MARK} in the first turn (no previous answer): kept as annotated")
            if start > end:
                notes.append(f"span {q['timestamp']!r} starts after it ends: asked at its midpoint all the same")
            text = raw.replace(ANSWER_MARK, previous) if previous is not None else raw
            turns.append(Turn(text, str(q["answer"]), (start + end) / 2, (start, end), raw))
            previous = str(q["answer"])
        if not turns:
            raise ann.AnnotationError("no turns")
        return Record(task, index, video, tuple(turns))
    if task == "AP":
        vocab = tuple(str(v) for v in r["vocab"])
        text = f"{r['question']}\nChoose one of: {', '.join(vocab)}."
        return Record(task, index, video, (Turn(text, str(r["answer"]), None, raw_question=str(r["question"])),),
                      vocab=vocab)
    if task == "SI":
        time_s = float(r["timestamp"])
        return Record(task, index, video, (Turn(str(r["question"]), str(r["answer"]), time_s, None,
                                                str(r["question"])),))
    if task == "PA":
        start, end = (float(x) for x in r["answer"])
        return Record(task, index, video, (Turn(str(r["question"]), "", None, None, str(r["question"])),),
                      window=(start, end))
    conversation = r["conversation"]
    if len(conversation) < 2 or "assistant" in conversation[-1]:
        raise ann.AnnotationError("the conversation must end with a human-only turn after at least one exchange")
    history = ((str(conversation[-2]["human"]), str(conversation[-2]["assistant"])),)
    final = str(conversation[-1]["human"])
    return Record(task, index, video, (Turn(final, "", None, None, final),), history=history)


def load_task(task: str, root: str | Path | None = None) -> tuple[list[Record], list[str]]:
    """The records of one task's file under `root` (default: the packaged copy), and notes on records skipped or
    kept with a quirk.

    Raises:
        AnnotationError: unknown task, missing file, or a file that is not a JSON list.
    """
    if task not in FILES:
        raise ann.AnnotationError(f"unknown OmniMMI task {task!r}; known: {list(FILES)}")
    path = (packaged_root() if root is None else Path(root)) / FILES[task]
    data = ann.read_json_list(path)
    records, issues = [], []
    for i, r in enumerate(data):
        notes: list[str] = []
        try:
            records.append(_record(task, i, r, notes))
            issues += [f"{path.name}: record {i}: {note}" for note in notes]
        except (ann.AnnotationError, KeyError, TypeError, ValueError) as e:
            issues.append(f"{path.name}: record {i}: skipped: {e}")
    return records, issues


def load_all(root: str | Path | None = None, tasks: Sequence[str] | None = None) -> tuple[list[Record], list[str]]:
    """Records of every task (or of `tasks`), in `FILES` order."""
    records, issues = [], []
    for task in tasks or FILES:
        r, i = load_task(task, root)
        records += r
        issues += i
    return records, issues


def nominal_seconds(record: Record, default: float) -> float:
    """A record's length for synthetic media: PA's `SRC_from_to.mp4` cut length, else `default`."""
    match = re.search(r"_(\d+(?:\.\d+)?)_(\d+(?:\.\d+)?)\.\w+$", record.video)
    if record.task == "PA" and match and float(match.group(2)) > float(match.group(1)):
        return float(match.group(2)) - float(match.group(1))
    return default


def record_probes(record: Record, duration_s: float, *, unit_seconds: float = 2.0, fps: float = 2.0,
                  poll_tokens: int = 1) -> list[probes_lib.Probe]:
    """The probes of one record's session, for a video of `duration_s` seconds (see the module docstring)."""
    key = f"{record.task}/{record.index}"
    end_time = max(0.0, duration_s - END_FRAMES / fps)
    if record.task == "PA":
        first = probes_lib.Probe(f"{key}/0", "PA", 0.0, f"{record.turns[0].question}\n{POLL}", 0,
                                 answer_tokens=poll_tokens)
        polls = [probes_lib.Probe(f"{key}/{k}", "PA", k * unit_seconds, POLL, k, answer_tokens=poll_tokens)
                 for k in range(1, ann.num_units(duration_s, unit_seconds))]
        return [first, *polls]
    out = []
    for t, turn in enumerate(record.turns):
        time_s = end_time if turn.time_s is None else turn.time_s
        out.append(probes_lib.Probe(f"{key}/{t}", record.task, time_s, turn.question, t, history=record.history))
    return out


def pa_metrics(times: Sequence[float], window: tuple[float, float]) -> dict[str, float]:
    """Hit (first response in the window), precision (share of responses in it), IoU of [first, last] with it;
    all 0 without a response."""
    start, end = window
    if not times:
        return {"hit": 0.0, "precision": 0.0, "iou": 0.0}
    first, last = min(times), max(times)
    inside = [start <= t <= end for t in times]
    inter = max(0.0, min(last, end) - max(first, start))
    union = max(last, end) - min(first, start)
    iou = inter / union if union > 0 else float(first == start)
    return {"hit": float(start <= first <= end), "precision": sum(inside) / len(inside), "iou": iou}


def is_yes(text: str) -> bool:
    """A poll's answer says yes."""
    text = text.strip().lower()
    return text.startswith("yes") or text == "y"


def pt_hit(generated: str, silent: bool) -> bool:
    """The model stayed silent: nothing before `<|im_end|>`, or a reply starting with `<2>`."""
    return silent or not generated.strip() or generated.strip().startswith("<2>")


def score(rows: Sequence[dict], records: dict[str, Record], unit_seconds: float = 2.0) -> tuple[dict, list[dict]]:
    """Scores PA and PT per configuration, and lists the judged tasks' predictions.

    Returns:
        (`{config: {"PA": {...}, "PT": {...}}}`, predictions of SG/MD/AP/SI for a judge).
    """
    scores, predictions = {}, []
    by_session = collections.defaultdict(list)
    for row in rows:
        by_session[(row["config"], row["session"])].append(row)
    for (config, name), rs in by_session.items():
        record = records[name]
        out = scores.setdefault(config, {})
        if record.task == "PA":
            rs = sorted(rs, key=lambda r: r["time_s"])
            ends = [(r["unit"] + 1) * unit_seconds for r in rs]  # a response after unit k: seen up to its end
            gen = [t for r, t in zip(rs, ends) if is_yes(r["generated"])]
            ll = [t for r, t in zip(rs, ends) if r["scores"] and r["scores"][0] >= r["scores"][1]]
            for scorer, times in (("generated", gen), ("loglik", ll)):
                for metric, value in pa_metrics(times, record.window).items():
                    out.setdefault("PA", collections.defaultdict(list))[f"{metric}_{scorer}"].append(value)
        elif record.task == "PT":
            out.setdefault("PT", collections.defaultdict(list))["hit"].append(
                float(pt_hit(rs[0]["generated"], rs[0]["silent"])))
        else:
            for r in rs:
                turn = int(r["key"].rsplit("/", 1)[1])
                t = record.turns[turn]
                predictions.append({"config": config, "task": record.task, "video": record.video,
                                    "index": record.index, "turn": turn, "question": t.question,
                                    "raw_question": t.raw_question, "answer": t.answer, "prediction": r["generated"],
                                    "time_s": r["time_s"], "status": r["status"]})
    summary = {config: {task: {"n": len(next(iter(v.values()))), **{k: probes_lib.mean(x) for k, x in v.items()}}
                        for task, v in tasks.items()} for config, tasks in scores.items()}
    return summary, predictions


def score_judged(judged: Sequence[dict]) -> dict[str, dict]:
    """The benchmark's accuracies from judged predictions (each row of `score`'s predictions with `pred`
    "yes"/"no" added by the user's judge), per configuration and task."""
    out: dict[str, dict] = {}
    groups = collections.defaultdict(list)
    for row in judged:
        groups[(row.get("config", ""), row["task"])].append(row)
    for (config, task), rows in groups.items():
        yes = [str(r["pred"]).strip().lower() == "yes" for r in rows]
        entry = {"n": len(rows), "turn_accuracy": sum(yes) / len(yes)}
        if task in ("SG", "MD"):
            per_record = collections.defaultdict(list)
            for r, y in zip(rows, yes):
                per_record[(r["video"], r["index"])].append(y)
            entry["accuracy"] = sum(all(v) for v in per_record.values()) / len(per_record)
        else:
            entry["accuracy"] = entry["turn_accuracy"]
        out.setdefault(config, {})[task] = entry
    return out


def run(model: OmniModel | Decoder, records: Sequence[Record], configs: Sequence[EvalConfig], *,
        encoder: TextEncoder, video_root: str | Path | None = None, mesh: Mesh | None = None,
        answer_tokens: int = 16, max_sessions: int | None = None, max_units: int | None = None, past_end: str = "clamp",
        batch_size: int | None = None, unit_seconds: float = 2.0, synthetic_seconds: float = 30.0,
        progress: bool = True, notices: list[str] | None = None) -> dict:
    """Builds one session per record, evaluates them under every configuration and scores what needs no judge.

    Args:
        max_sessions: at most this many sessions per task (smoke runs).
        max_units: cut every session after this many units (see the module docstring).
        synthetic_seconds: length of synthetic videos (see `nominal_seconds`).
        Others: as `ovobench.run`.

    Returns:
        `{"records", "scores", "predictions", "summary", "left_out", "notices"}`.
    """
    notices = [] if notices is None else notices
    builder = probes_lib.PromptBuilder(model, encoder, unit_seconds=unit_seconds)
    if builder.notice:
        notices.append(builder.notice)
    if max_units is not None:  # records asking something inside the cut (AP, PT, PA are asked at the cut's end)
        limit = max_units * unit_seconds
        records = [r for r in records if any(t.time_s is None or t.time_s < limit for t in r.turns)]
    if max_sessions is not None:
        kept, count = [], collections.Counter()
        for r in records:
            count[r.task] += 1
            if count[r.task] <= max_sessions:
                kept.append(r)
        records = kept
    sources = probes_lib.open_all([r.video for r in records], video_root, unit_seconds, notices)
    sessions, by_name = [], {}
    for record, source in zip(records, sources):
        nominal = nominal_seconds(record, synthetic_seconds)
        duration = source.duration_s if source.duration_s is not None else nominal
        if max_units is not None:  # the session ends at the cut: "before the end" means before the cut
            duration = min(duration, max_units * unit_seconds)
        probes = record_probes(record, duration, unit_seconds=unit_seconds, fps=builder.fps)
        name = f"{record.task}/{record.index}"
        by_name[name] = record
        sessions.append(probes_lib.build_probe_session(name, record.video, probes, source, builder,
                                                       answer_tokens=answer_tokens, max_units=max_units,
                                                       past_end=past_end, nominal_s=nominal))
    ids = [probes_lib.first_token_id(encoder, "Yes"), probes_lib.first_token_id(encoder, "No")]
    results, rows = probes_lib.execute(model, sessions, configs, builder, score_ids=ids, mesh=mesh,
                                       batch_size=batch_size, progress=progress)
    scores, predictions = score(rows, by_name, unit_seconds)
    notices.append(f"judge: {len(predictions)} predictions of {', '.join(JUDGED)} are not scored here (the "
                   f"benchmark uses a GPT judge); write them with --judge-out and score them with score_judged")
    left_out = [{"session": s.name, "key": p.key, "task": p.task, "reason": why} for s in sessions
                for p, why in s.left_out]
    return {"records": rows, "scores": scores, "predictions": predictions,
            "summary": probes_lib.run_summary(results, rows), "left_out": left_out, "notices": notices}


def main(argv: Sequence[str] | None = None) -> int:
    compilation_cache.enable()  # a command line caches its compiled programs (OMNIJAX_COMPILATION_CACHE)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", help="directory of the six OmniMMI *.json files (default: the shipped copy)")
    parser.add_argument("--tasks", nargs="*", choices=list(FILES), help="tasks to run (default: all)")
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--synthetic-seconds", type=float, default=30.0,
                        help="length of a synthetic video (no --video-root or file missing); PA: the cut's length")
    parser.add_argument("--judge-out", help="write the SG/MD/AP/SI predictions here as JSON for a judge")
    probes_lib.add_common_args(parser)
    args = parser.parse_args(argv)
    distributed.initialize(distributed.cluster_from_args(args))  # before any other JAX work

    notices: list[str] = []
    try:
        records, issues = load_all(args.data, args.tasks)
        notices.extend(issues)
        configs, mesh, model, encoder = probes_lib.prepare(args, args.answer_tokens, notices, "omnimmi_demo_")
        report = run(model, records, configs, encoder=encoder, video_root=args.video_root, mesh=mesh,
                     answer_tokens=args.answer_tokens, max_sessions=args.max_sessions, max_units=args.max_units,
                     past_end=args.past_end, batch_size=args.batch_size, synthetic_seconds=args.synthetic_seconds,
                     progress=distributed.is_main_process(), notices=notices)
    except ValueError as e:  # AnnotationError, CheckpointFormatError and bad settings are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 1
    if distributed.is_main_process():
        probes_lib.print_notices(report["notices"])
        print(probes_lib.format_report(report["summary"], report["scores"]))
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
        if args.judge_out:
            Path(args.judge_out).write_text(json.dumps(report["predictions"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
