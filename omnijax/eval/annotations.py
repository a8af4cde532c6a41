"""StreamingBench annotation files -> videos with their questions on a timeline, and questions -> 2 s units.

Files (shipped as package data in `omnijax/evalharness/data/streamingbench/`, from THUNLP-MT/StreamingBench
`src/data/`, MIT licence beside them; `default_root`): a list of records
`{video_path, time, video_categories?, questions: [{task_type, question, time_stamp, answer, options, ...}]}`;
`questions_sqa.json` nests the records in one list per video; `*_stream.json` files carry `time` per question.
All questions of one video in one file become one `Video` (one streaming session, questions in time order).

Data quirks handled here, each recorded in `Video.issues` or `Question.notes` rather than guessed away:
- timestamps are `H:MM:SS`, `HH:MM:SS` or `MM:SS` (a field may have one digit, e.g. `00:00:8`); a malformed one
  (`00:12450`) is not guessed: the question is skipped with an issue.
- options carry `A.`-style labels except in `questions_sqa.json` (mostly unlabelled: labels are given by position);
  a label written twice (`A. A.The ...`) is removed once more; an option split in two by a stray comma (an
  unlabelled piece after a labelled one) is joined back; empty pieces and trailing options without any letter or
  digit (`E. .`) are dropped; labels out of sequence (a repeated `D.`) make the question skipped with an issue.
- open-ended questions (Proactive Output: no options, a ground-truth output time) are kept with `options == ()`;
  multiple-choice scoring skips them.

Timeline (`unit_of`): unit k covers `[k * unit_seconds, (k + 1) * unit_seconds)`; a question at time t is asked
after the unit containing t (`floor(t / unit_seconds)`), so a question at 0 s follows unit 0. With a known video
duration D there are `ceil(D / unit_seconds)` units; a question at t == D (the video's last instant) is asked
after the last unit; a question at t > D is past the end: `place_questions` asks it after the last unit and flags
it (`past_end="clamp"`, default), skips it (`"skip"`) or raises `AnnotationError` (`"error"`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from importlib import resources
from pathlib import Path
from typing import Sequence

LETTERS = "ABCDEFGHIJ"
_LABEL = re.compile(r"^\s*([A-J])\s*[.)]\s*")


class AnnotationError(ValueError):
    """An annotation the harness cannot use as it stands (the message names the file and the field)."""


@dataclasses.dataclass(frozen=True)
class Question:
    """One question of a video.

    Attributes:
        task_type: StreamingBench task (e.g. "Emotion Recognition").
        question: the question text.
        time_s: when it is asked, seconds from the video start.
        options: option texts without their labels (`()` for open-ended questions).
        answer: the correct option's letter ("" for open-ended questions).
        index: position of the question in its file (records flattened, then questions in order).
        required_ability: the annotation's ability tag, if any.
        notes: repairs applied to the annotation (joined options, added labels).
    """

    task_type: str
    question: str
    time_s: float
    options: tuple[str, ...]
    answer: str
    index: int
    required_ability: str = ""
    notes: tuple[str, ...] = ()

    @property
    def multiple_choice(self) -> bool:
        return bool(self.options) and self.answer in LETTERS[:len(self.options)]


@dataclasses.dataclass
class Video:
    """The questions one file asks about one video (one streaming session).

    Attributes:
        source: annotation file name.
        video_path: the record's `video_path` (relative to the benchmark's video root).
        category: `video_categories`, if any.
        questions: in time order (ties keep file order).
        issues: questions that could not be used, with the reason.
    """

    source: str
    video_path: str
    category: str
    questions: list[Question]
    issues: list[str] = dataclasses.field(default_factory=list)


def parse_timestamp(text: str) -> float:
    """Seconds of `H:MM:SS`, `HH:MM:SS` or `MM:SS` (fields of one or two digits, the first of any length).

    Raises:
        AnnotationError: anything else, including minutes or seconds above 59.
    """
    parts = str(text).strip().split(":")
    if not 2 <= len(parts) <= 3 or not all(p.isdigit() for p in parts) or any(len(p) > 2 for p in parts[1:]):
        raise AnnotationError(f"unparseable timestamp {text!r} (want H:MM:SS or MM:SS)")
    values = [int(p) for p in parts]
    if any(v > 59 for v in values[1:]):
        raise AnnotationError(f"unparseable timestamp {text!r}: a minutes or seconds field is above 59")
    seconds = 0
    for v in values:
        seconds = seconds * 60 + v
    return float(seconds)


def parse_options(raw: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Option texts without labels, and notes on repairs (see the module docstring).

    Raises:
        AnnotationError: labels out of sequence (a letter repeated or skipped), which no repair can settle.
    """
    pieces = [str(o).strip() for o in raw]
    notes = []
    if any(not p for p in pieces):
        notes.append("dropped empty option pieces")
        pieces = [p for p in pieces if p]
    labelled = [_LABEL.match(p) for p in pieces]
    if 2 * sum(m is not None for m in labelled) < len(pieces):  # mostly unlabelled: label by position
        if pieces:
            notes.append("added option labels in order")
        out = []
        for i, (piece, match) in enumerate(zip(pieces, labelled)):
            strip = match is not None and i < len(LETTERS) and match.group(1) == LETTERS[i]
            out.append(piece[match.end():].strip() if strip else piece)
        return tuple(out), tuple(notes)
    options: list[str] = []
    for piece, match in zip(pieces, labelled):
        if match is None:
            if not options:
                raise AnnotationError(f"option {piece[:30]!r} precedes every labelled option")
            options[-1] = f"{options[-1]}, {piece}"
            notes.append("joined an option split by a comma")
        elif match.group(1) != LETTERS[len(options)]:
            raise AnnotationError(f"option labels out of sequence: {match.group(1)!r} where "
                                  f"{LETTERS[len(options)]!r} belongs")
        else:
            text = piece[match.end():].strip()
            again = _LABEL.match(text)
            if again and again.group(1) == match.group(1):  # "A. A.The ...": the label written twice
                text = text[again.end():].strip()
                notes.append("removed a doubled label")
            options.append(text)
    while options and not any(ch.isalnum() for ch in options[-1]):
        options.pop()
        notes.append("dropped a trailing option without text")
    return tuple(options), tuple(dict.fromkeys(notes))


def read_json_list(path: Path, what: str = "") -> list:
    """The JSON list in an annotation file (`AnnotationError` naming the file, and `what` it holds, otherwise)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise AnnotationError(f"cannot read {what + ' ' if what else ''}{path}: {e}") from None
    if not isinstance(data, list):
        raise AnnotationError(f"{Path(path).name}: expected a list of records, got {type(data).__name__}")
    return data


def _records(data) -> list[dict]:
    if not isinstance(data, list):
        raise AnnotationError(f"expected a list of records, got {type(data).__name__}")
    out = []
    for item in data:
        out.extend(item if isinstance(item, list) else [item])
    return out


def load_file(path: str | Path) -> list[Video]:
    """All videos of one annotation file, in order of first appearance.

    Raises:
        AnnotationError: the file is not a list of records with `video_path` and `questions`.
    """
    path = Path(path)
    records = _records(json.loads(path.read_text(encoding="utf-8")))
    videos: dict[str, Video] = {}
    index = 0
    for r, record in enumerate(records):
        if "video_path" not in record or not isinstance(record.get("questions"), list):
            raise AnnotationError(f"{path.name}: record {r} lacks video_path or a questions list")
        video = videos.setdefault(record["video_path"], Video(path.name, record["video_path"],
                                                              str(record.get("video_categories", "")), []))
        for q in record["questions"]:
            where = f"{path.name}: question {index} ({record['video_path']})"
            index += 1
            try:
                time_s = parse_timestamp(q["time_stamp"])
            except (AnnotationError, KeyError) as e:
                video.issues.append(f"{where}: skipped: {e}")
                continue
            try:
                options, notes = parse_options(q.get("options", []))
            except AnnotationError as e:
                video.issues.append(f"{where}: skipped: {e}")
                continue
            answer = str(q.get("answer", "")).strip() if options else ""
            if options and answer not in LETTERS[:len(options)]:
                video.issues.append(f"{where}: skipped: answer {answer!r} is not one of {len(options)} options")
                continue
            video.questions.append(Question(str(q.get("task_type", "")), str(q.get("question", "")), time_s,
                                            options, answer, index - 1, str(q.get("required_ability", "")), notes))
    for video in videos.values():
        video.questions.sort(key=lambda q: (q.time_s, q.index))
    return list(videos.values())


def packaged_root() -> Path:
    """The StreamingBench annotation files shipped with omnijax (package data of `omnijax.eval`)."""
    return Path(str(resources.files("omnijax.eval").joinpath("data", "streamingbench")))


def default_root() -> Path:
    """Where annotations are read from when no root is given: `$OMNIJAX_STREAMINGBENCH` if set, else the packaged
    copy (`packaged_root`)."""
    env = os.environ.get("OMNIJAX_STREAMINGBENCH")
    return Path(env) if env else packaged_root()


def annotation_files(root: str | Path | None = None) -> list[Path]:
    """The `*.json` annotation files under `root` (None: `default_root()`), sorted by name."""
    root = default_root() if root is None else Path(root)
    files = sorted(root.glob("*.json"))
    if not files:
        raise AnnotationError(f"no StreamingBench annotation files (*.json) in {root}")
    return files


def load_all(root: str | Path | None = None, files: Sequence[str] | None = None) -> list[Video]:
    """Videos of every annotation file under `root` (None: `default_root()`), or of the named `files` there."""
    root = default_root() if root is None else Path(root)
    paths = annotation_files(root) if files is None else [root / f for f in files]
    return [video for path in paths for video in load_file(path)]


def unit_of(time_s: float, unit_seconds: float = 2.0) -> int:
    """Index of the unit containing `time_s` (`[k * unit_seconds, (k + 1) * unit_seconds)`)."""
    if time_s < 0:
        raise AnnotationError(f"negative time {time_s}")
    return int(math.floor(time_s / unit_seconds + 1e-9))


def num_units(duration_s: float, unit_seconds: float = 2.0) -> int:
    """Units covering a video of `duration_s` seconds (the last one may be partial)."""
    return max(1, int(math.ceil(duration_s / unit_seconds - 1e-9)))


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a question is asked: after unit `unit`; `status` is "ok", "past_end" (clamped) or "skipped"."""

    question: Question
    unit: int
    status: str


def place_questions(questions: Sequence[Question], units: int, *, duration_s: float | None = None,
                    unit_seconds: float = 2.0, past_end: str = "clamp") -> list[Placement]:
    """Maps questions onto a timeline of `units` units (see the module docstring).

    Args:
        questions: the video's questions.
        units: units in the session's timeline.
        duration_s: the video's duration when known (default `units * unit_seconds`).
        unit_seconds: seconds per unit.
        past_end: "clamp", "skip" or "error" for questions after the end.
    """
    if past_end not in ("clamp", "skip", "error"):
        raise ValueError(f"past_end must be clamp, skip or error, got {past_end!r}")
    duration_s = units * unit_seconds if duration_s is None else duration_s
    out = []
    for q in questions:
        unit = unit_of(q.time_s, unit_seconds)
        if q.time_s > duration_s + 1e-9:
            if past_end == "error":
                raise AnnotationError(f"question {q.index} at {q.time_s:g} s is past the end ({duration_s:g} s)")
            out.append(Placement(q, units - 1, "past_end" if past_end == "clamp" else "skipped"))
        else:
            out.append(Placement(q, min(unit, units - 1), "ok"))
    return out


__all__ = ["AnnotationError", "LETTERS", "Placement", "Question", "Video", "annotation_files", "load_all",
           "load_file", "num_units", "parse_options", "parse_timestamp", "place_questions", "unit_of"]
