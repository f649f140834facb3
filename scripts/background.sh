#!/usr/bin/env bash
# The project's long computations, one after another, resumable: re-run this after a restart
# (a new machine, a killed session) and each skips what its committed records already hold.
# The jobs, run in the order JOBS names them (default: this order on a CPU with native bf16;
# on one without it the study first, since the upcycling runs train in fp32 there, at under half
# their bf16 speed, and those whose seed's runs trained in bf16 wait for a CPU with it, while
# the study's small models train in fp32 everywhere):
#
#   upcycle:  the upcycling runs (issue 38, many hours):  python -m studies.upcycling
#   lean:     drelu's leaner predictors searched and benchmarked again beside the default ones,
#             each with its hash (issue 42, about an hour):  python -m studies.locality.runs --steps lean
#   study:    the gating study (issue 17; issue 42's controls and MQAR):  python -m studies.gating
#   locality: the activation-locality runs (issue 19, done: it skips):  python -m studies.locality.runs
#
# They run from a detached worktree of HEAD (WORKTREE, default /tmp/egmla-background), so that
# editing this checkout does not change code under a running job (stop a running one before
# starting this again: it checks the worktree out at HEAD); their records are written
# into this checkout's benchmarks/results/, to be committed as they come, and their run
# directories into this checkout's runs/background/. One heavy job at a time: on a 2-core
# machine, run no timing benchmark beside it (pause it with kill -STOP, resume with -CONT).
#
#   nohup bash scripts/background.sh > runs/background.log 2>&1 &
#   JOBS="lean study" nohup bash scripts/background.sh > runs/background.log 2>&1 &   # some jobs
#
# Settings (environment): PY (the interpreter, default .venv/bin/python), WORKTREE, RUNS (run
# directories, default runs/background), RESULTS (default benchmarks/results), UPCYCLE_ARGS,
# LEAN_ARGS, STUDY_ARGS and LOCALITY_ARGS (more arguments for each command, e.g.
# STUDY_ARGS=--dry-run, LEAN_ARGS=--dry-run), JOBS (which jobs to run, in order; default
# "upcycle lean study locality", or "study upcycle lean locality" on a CPU without AVX512-BF16
# or AMX).
set -euo pipefail
cd "$(dirname "$0")/.."
HERE=$PWD
PY=${PY:-$HERE/.venv/bin/python}
WORKTREE=${WORKTREE:-/tmp/egmla-background}
RUNS=${RUNS:-$HERE/runs/background}
RESULTS=${RESULTS:-$HERE/benchmarks/results}
if [ -z "${JOBS:-}" ]; then
    if grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null; then
        JOBS="upcycle lean study locality"
    else
        JOBS="study upcycle lean locality"
    fi
fi
for job in $JOBS; do  # every name known before anything starts
    case $job in
        upcycle|lean|study|locality) ;;
        *) echo "background: unknown job '$job' in JOBS (upcycle, lean, study, locality)" >&2
           exit 2 ;;
    esac
done

git worktree prune
if [ -d "$WORKTREE" ]; then
    git -C "$WORKTREE" checkout -q --detach "$(git rev-parse HEAD)"
else
    git worktree add -q --detach "$WORKTREE" HEAD
fi
mkdir -p "$RUNS"
export PYTHONPATH=$WORKTREE WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
cd "$WORKTREE"
echo "$(date -u +%FT%TZ) background: $JOBS, at $(git rev-parse --short HEAD)"
for job in $JOBS; do
    case $job in
        upcycle)
            echo "$(date -u +%FT%TZ) background: the upcycling runs"
            "$PY" -m studies.upcycling --runs-dir "$RUNS/upcycle" --results "$RESULTS/upcycle" \
                ${UPCYCLE_ARGS:-} ;;
        lean)
            echo "$(date -u +%FT%TZ) background: the leaner locality predictors, again"
            "$PY" -m studies.locality.runs --steps lean --runs-dir "$RUNS/locality" \
                --results "$RESULTS/locality" --lean-results "$RESULTS/locality_lean_predictors" \
                ${LEAN_ARGS:-} ;;
        study)
            echo "$(date -u +%FT%TZ) background: the study"
            "$PY" -m studies.gating --runs-dir "$RUNS/study" --results "$RESULTS/study" \
                ${STUDY_ARGS:-} ;;
        locality)
            echo "$(date -u +%FT%TZ) background: the activation-locality runs"
            "$PY" -m studies.locality.runs --runs-dir "$RUNS/locality" --results "$RESULTS/locality" \
                ${LOCALITY_ARGS:-} ;;
    esac
done
echo "$(date -u +%FT%TZ) background: done"
