"""Runs lm-evaluation-harness through its Python API in a process of its own, as a user would (`test_lm_eval.py`
starts it against a served model): `python lm_eval_run.py`, then the path of SPEC.json on its standard input. It
imports lm-eval (and transformers, for the tokenizer) before it reads the path, so that a test can start it while its
server warms up.

SPEC.json holds `include_path` (a folder of task YAMLs), `out` (where the results go) and `runs`: a list of
`{"model": ..., "model_args": {...}, "tasks": [...], "apply_chat_template": bool}`. Each run calls
`lm_eval.simple_evaluate` with a task manager that reads only `include_path` (not lm-eval's thousands of built-in
tasks) and logs its samples. `out` gets, per run, its tasks' metrics and every sample's arguments and responses."""

from __future__ import annotations

import json
import sys
from typing import Any


def _plain(value: Any) -> Any:
    """`value` with tuples (named ones too: lm-eval's chat prompt, a `JsonChatStr`, becomes `[messages JSON]`) as
    lists and anything else JSON cannot hold as its `str`."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return str(value)


def run(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Runs every entry of `spec["runs"]`. Returns, per run, `{"results": {task: metrics}, "samples": {task:
    [{"doc_id", "doc", "arguments", "resps", "filtered_resps"}, ...]}}`."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=spec["include_path"], include_defaults=False)
    reports = []
    for entry in spec["runs"]:
        out = lm_eval.simple_evaluate(model=entry["model"], model_args=entry["model_args"], tasks=entry["tasks"],
                                      task_manager=manager, log_samples=True,
                                      apply_chat_template=entry.get("apply_chat_template", False),
                                      bootstrap_iters=0)
        if out is None:
            raise RuntimeError(f"lm_eval.simple_evaluate returned nothing for {entry['tasks']}")
        samples = {task: [{key: _plain(sample.get(key)) for key in
                           ("doc_id", "doc", "arguments", "resps", "filtered_resps")} for sample in rows]
                   for task, rows in out["samples"].items()}
        reports.append({"results": _plain(out["results"]), "samples": samples})
    return reports


def main() -> int:
    """Imports lm-eval, reads the spec named by the first line of standard input, runs it, writes the reports to its
    `out`. Returns the exit status (2 without a spec path)."""
    import lm_eval.models.openai_completions  # noqa: F401  (the API models, which register themselves)
    import transformers  # noqa: F401  (local-completions' tokenizer)

    path = sys.stdin.readline().strip()
    if not path:
        print("lm_eval_run.py reads the path of SPEC.json on its standard input; it got none", file=sys.stderr)
        return 2
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    reports = run(spec)
    with open(spec["out"], "w", encoding="utf-8") as f:
        json.dump(reports, f, ensure_ascii=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
