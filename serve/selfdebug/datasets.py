"""Code-generation problems with visible tests (what the model may see and repair against) and
hidden tests (what scores the final program).

MBPP sanitized (Austin et al. 2021, arXiv:2108.07732; CC BY 4.0; source google-research/
google-research, mbpp/sanitized-mbpp.json) is vendored unmodified in `data/mbpp/` with its
README (attribution, licence, checksum); the file is checked against its sha256 before use.
Visible tests: the first assert; hidden: all of them.

    >>> problems = load_mbpp()                    # doctest: +SKIP
    >>> len(problems), problems[0].visible_tests  # doctest: +SKIP
    (427, ['assert similar_elements((3, 4, 5, 6),(5, 7, 4, 10)) == (4, 5)'])
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

MBPP_FILE = Path(__file__).resolve().parent / "data" / "mbpp" / "sanitized-mbpp.json"
MBPP_SHA256 = "ca95deaa9a01ef0a6f439f88bcf0dd3db3563d22f22aad6cae04ebb9a8d8c8e9"


class DatasetError(RuntimeError):
    """A dataset is missing or not the expected bytes; the message says which and why."""


@dataclass(frozen=True)
class Problem:
    """One task: `prompt` is what the model is asked, the tests are Python source (asserts)."""

    task_id: str
    prompt: str
    visible_tests: list[str]
    hidden_tests: list[str]
    setup: str = ""  # imports the tests need, run before them
    reference: str = ""  # a known-good solution, for checking the harness itself
    metadata: dict = field(default_factory=dict)


def load_mbpp(path: Path = MBPP_FILE) -> list[Problem]:
    """The 427 problems of MBPP sanitized, in task_id order."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DatasetError(f"MBPP: cannot read {path}: {e.strerror}") from None
    digest = hashlib.sha256(raw).hexdigest()
    if digest != MBPP_SHA256:
        raise DatasetError(f"MBPP: {path} has sha256 {digest}, expected {MBPP_SHA256} "
                           "(the vendored copy must be unmodified)")
    problems = []
    for row in json.loads(raw):
        asserts = list(row["test_list"])
        problems.append(Problem(
            task_id=f"mbpp/{row['task_id']}", prompt=row["prompt"], visible_tests=asserts[:1],
            hidden_tests=asserts, setup="\n".join(row["test_imports"]), reference=row["code"],
            metadata={"source_file": row["source_file"]}))
    return problems
