#!/usr/bin/env bash
# The project's long computations, one after another, resumable: re-run this after a restart
# (a new machine, a killed session) and each skips what its committed records already hold.
#
#   1. the gating study (issue 17):             python -m studies.gating
#   2. the activation-locality runs (issue 19): python -m studies.locality.runs
#   3. the upcycling runs (issue 38):           python -m studies.upcycling
#
# They run from a detached worktree of HEAD (WORKTREE, default /tmp/egmla-background), so that
# editing this checkout does not change code under a running job; their records are written
# into this checkout's benchmarks/results/, to be committed as they come, and their run
# directories into this checkout's runs/background/. One heavy job at a time: on a 2-core
# machine, run no timing benchmark beside it (pause it with kill -STOP, resume with -CONT).
#
#   nohup bash scripts/background.sh > runs/background.log 2>&1 &
#
# Settings (environment): PY (the interpreter, default .venv/bin/python), WORKTREE, RUNS (run
# directories, default runs/background), RESULTS (default benchmarks/results), STUDY_ARGS,
# LOCALITY_ARGS and UPCYCLE_ARGS (more arguments for each command, e.g. STUDY_ARGS=--dry-run),
# JOBS (which of study, locality, upcycle to run; default all three, in that order).
set -euo pipefail
cd "$(dirname "$0")/.."
HERE=$PWD
PY=${PY:-$HERE/.venv/bin/python}
WORKTREE=${WORKTREE:-/tmp/egmla-background}
RUNS=${RUNS:-$HERE/runs/background}
RESULTS=${RESULTS:-$HERE/benchmarks/results}

git worktree prune
if [ -d "$WORKTREE" ]; then
    git -C "$WORKTREE" checkout -q --detach "$(git rev-parse HEAD)"
else
    git worktree add -q --detach "$WORKTREE" HEAD
fi
mkdir -p "$RUNS"
export PYTHONPATH=$WORKTREE WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
cd "$WORKTREE"
JOBS=${JOBS:-study locality upcycle}
echo "$(date -u +%FT%TZ) background: $JOBS, at $(git rev-parse --short HEAD)"
if [[ " $JOBS " == *" study "* ]]; then
    echo "$(date -u +%FT%TZ) background: the study"
    "$PY" -m studies.gating --runs-dir "$RUNS/study" --results "$RESULTS/study" ${STUDY_ARGS:-}
fi
if [[ " $JOBS " == *" locality "* ]]; then
    echo "$(date -u +%FT%TZ) background: the activation-locality runs"
    "$PY" -m studies.locality.runs --runs-dir "$RUNS/locality" --results "$RESULTS/locality" \
        ${LOCALITY_ARGS:-}
fi
if [[ " $JOBS " == *" upcycle "* ]]; then
    echo "$(date -u +%FT%TZ) background: the upcycling runs"
    "$PY" -m studies.upcycling --runs-dir "$RUNS/upcycle" --results "$RESULTS/upcycle" \
        ${UPCYCLE_ARGS:-}
fi
echo "$(date -u +%FT%TZ) background: done"
