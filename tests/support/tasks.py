"""A plain lm-eval task on disk, as a user would write one: four capitals, multiple choice."""

from __future__ import annotations

import json
from pathlib import Path

CAPITALS = [
    ("The capital of France is", [" Paris", " Berlin", " Madrid"], 0),
    ("The capital of Germany is", [" Rome", " Berlin", " Paris"], 1),
    ("The capital of Spain is", [" Lisbon", " Athens", " Madrid"], 2),
    ("The capital of Italy is", [" Rome", " Vienna", " Oslo"], 0),
]
TASK_YAML = """\
task: capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: capitals.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def write_local_task(directory: Path, absolute: bool = False) -> None:
    """The capitals task; `absolute`: its YAML names the JSONL by absolute path (in-process
    lm-eval resolves a relative one against the working directory)."""
    directory.mkdir(parents=True)
    data = directory / "capitals.jsonl" if absolute else "capitals.jsonl"
    (directory / "capitals.yaml").write_text(TASK_YAML.replace("capitals.jsonl", str(data)))
    rows = [{"question": q, "choices": c, "answer": a} for q, c, a in CAPITALS]
    (directory / "capitals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
