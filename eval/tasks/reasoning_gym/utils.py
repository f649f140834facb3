"""reasoning-gym problems as offline lm-eval tasks: generated locally from a fixed seed, no hub.

Each task YAML names its family, seed and size in `dataset_kwargs`; lm-eval passes them (with the
task's `metadata`) to `load`. Answers are scored by the family's own `score_answer`, on the entry
regenerated from (family, seed, index), so its metadata keeps the types the scorer expects.

    load(family="chain_sum", seed=42, size=100)["test"][0]
    -> {"question": "State the final answer to the following arithmetic problem: 4 + 3 =",
        "answer": "7", "family": "chain_sum", "seed": 42, "size": 100, "index": 0, "entry": "{...}"}
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
from typing import Any

# The seeded generators define the data: another version may give other questions for the seed.
VERSION = "0.1.25"


def _reasoning_gym():
    if importlib.util.find_spec("reasoning_gym") is None:
        raise ImportError("reasoning-gym tasks: the package reasoning-gym is not installed "
                          f"(pip install reasoning-gym=={VERSION})")
    installed = importlib.metadata.version("reasoning_gym")
    if installed != VERSION:
        raise ImportError(f"reasoning-gym tasks: reasoning-gym {installed} is installed, the tasks "
                          f"are defined by {VERSION} (pip install reasoning-gym=={VERSION})")
    import reasoning_gym

    return reasoning_gym


@functools.cache
def procedural_dataset(family: str, seed: int, size: int):
    """The family's reasoning-gym dataset object (entries are generated on access)."""
    return _reasoning_gym().create_dataset(family, seed=seed, size=size)


def load(family: str, seed: int, size: int, **_metadata):
    """The task's dataset: {"test": one row per problem}, the entry itself as JSON in `entry`."""
    import datasets

    problems = procedural_dataset(family, int(seed), int(size))
    rows = []
    for index in range(len(problems)):
        entry = problems[index]
        rows.append({"question": entry["question"], "answer": entry["answer"], "family": family,
                     "seed": int(seed), "size": int(size), "index": index,
                     "entry": json.dumps(entry, default=str)})
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def extract_answer(generation: str) -> str | None:
    """The first non-empty line, without a leading "Answer:": " Answer: 30\\nBecause" -> "30"."""
    for line in generation.splitlines():
        line = line.strip()
        if line[:7].lower() == "answer:":
            line = line[7:].strip()
        if line:
            return line
    return None


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """`score`: the family's own score_answer (some give partial credit); `exact_match`: 1 when
    the extracted answer is the reference string exactly."""
    problems = procedural_dataset(doc["family"], int(doc["seed"]), int(doc["size"]))
    entry = problems[int(doc["index"])]
    if entry["question"] != doc["question"]:  # the doc came from other data than we regenerate
        raise ValueError(f"{doc['family']} #{doc['index']}: the regenerated question differs "
                         f"from the task's; was the data made with another reasoning-gym version?")
    answer = extract_answer(results[0])
    return {"score": float(problems.score_answer(answer, entry)),
            "exact_match": float(answer == entry["answer"])}
