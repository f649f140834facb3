"""Processes the tests run or look for: `python -m egmla.export` as a user runs it, its one-line
errors, and the host's processes that run as the sandbox's user (the sandbox tests check none
is left)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sandbox import protections
from support import ROOT


def sandbox_uid_processes() -> list[str]:
    """Pids of the processes whose real uid is the sandbox's (none when it has no uid of its own)."""
    uid = protections().uid
    if uid is None:
        return []
    return [p for p in os.listdir("/proc") if p.isdigit() and _uid(p) == uid]


def _uid(pid: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def run_export(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("EGMLA_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "egmla.export", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def assert_one_line_error(run: subprocess.CompletedProcess, *needles: str) -> None:
    assert run.returncode == 2, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and all(n in last for n in needles), last
