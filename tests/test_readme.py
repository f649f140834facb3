"""The README is what a new user types: its commands are CI's, and its example runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def commands(block: str) -> list[str]:
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def test_readme_opens_with_two_commands_and_ci_runs_the_second():
    first = commands(code_blocks("bash")[0])
    assert len(first) == 2
    assert "train.py experiment=quickstart" in first[0] and "pytest" in first[1]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert first[1] in ci


def test_readme_python_example_runs(capsys):
    exec(compile(code_blocks("python")[0], "README.md", "exec"), {})
    assert capsys.readouterr().out.strip()
