"""scripts/background.sh, the restart command of the long computations: it runs the study, the
locality runs and the upcycling runs from a detached worktree of HEAD, writing records where it
is told."""

from __future__ import annotations

import subprocess
import sys

from support import ROOT


def test_the_background_script_runs_the_jobs_from_a_worktree_of_head(tmp_path):
    worktree = tmp_path / "worktree"
    env = {"PATH": "/usr/bin:/bin", "PY": sys.executable, "WORKTREE": str(worktree),
           "RUNS": str(tmp_path / "runs"), "RESULTS": str(tmp_path / "results"),
           "STUDY_ARGS": "--dry-run", "LOCALITY_ARGS": "--steps losses",
           "UPCYCLE_ARGS": "--phases summary"}
    try:
        run = subprocess.run(["bash", "scripts/background.sh"], capture_output=True, text=True,
                             cwd=ROOT, env=env, timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=ROOT).stdout.strip()
        assert f"study locality upcycle, at {head}" in run.stdout
        assert "the upcycling runs" in run.stdout and "background: done" in run.stdout
        assert (tmp_path / "results" / "upcycle" / "summary.md").is_file()
        assert "lr" in run.stdout  # the study's dry run lists its phases' runs
        assert (worktree / "studies" / "gating" / "__main__.py").is_file()
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT,
                       capture_output=True)
