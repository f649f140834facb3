"""scripts/background.sh, the restart command of the long computations: it runs the upcycling
runs, the lean locality re-run, the study and the locality runs from a detached worktree of HEAD,
in the order JOBS names them (by default the upcycling runs first where the CPU has native bf16,
else the study), writing records where it is told."""

from __future__ import annotations

import subprocess
import sys

from egmla.devices import native_bf16
from support import ROOT


def test_the_background_script_runs_the_jobs_from_a_worktree_of_head(tmp_path):
    worktree = tmp_path / "worktree"
    env = {"PATH": "/usr/bin:/bin", "PY": sys.executable, "WORKTREE": str(worktree),
           "RUNS": str(tmp_path / "runs"), "RESULTS": str(tmp_path / "results"),
           "STUDY_ARGS": "--dry-run", "LOCALITY_ARGS": "--steps losses",
           "UPCYCLE_ARGS": "--phases summary", "LEAN_ARGS": "--dry-run"}
    try:
        run = subprocess.run(["bash", "scripts/background.sh"], capture_output=True, text=True,
                             cwd=ROOT, env=env, timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=ROOT).stdout.strip()
        # the upcycling runs first (hours) where the CPU has native bf16 (they train in bf16
        # there), else the study first; the lean re-run before the study
        if native_bf16():
            assert f"upcycle lean study locality, at {head}" in run.stdout
            jobs = ["the upcycling runs", "the leaner locality predictors", "the study",
                    "the activation-locality runs", "background: done"]
        else:
            assert f"study upcycle lean locality, at {head}" in run.stdout
            jobs = ["the study", "the upcycling runs", "the leaner locality predictors",
                    "the activation-locality runs", "background: done"]
        assert [run.stdout.index(job) for job in jobs] == sorted(run.stdout.index(j) for j in jobs)
        assert "todo  search: " in run.stdout  # the lean step's dry run: nothing recorded there
        assert (tmp_path / "results" / "upcycle" / "summary.md").is_file()
        assert "lr" in run.stdout  # the study's dry run lists its phases' runs
        assert (worktree / "studies" / "gating" / "__main__.py").is_file()
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT,
                       capture_output=True)


def test_an_unknown_job_stops_the_script_before_anything_starts(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PY": sys.executable, "WORKTREE": str(tmp_path / "worktree"),
           "JOBS": "upcycle fly"}
    run = subprocess.run(["bash", "scripts/background.sh"], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=60)
    assert run.returncode == 2 and "unknown job 'fly'" in run.stderr
    assert not (tmp_path / "worktree").exists()
