#!/usr/bin/env bash
# The GPU check of issue 20, for a lent GPU machine (one H200 here): run from anywhere in the
# repository, with the machine's own PyTorch and Lightning; nothing is installed (the machine has
# no registry access and needs nothing more: see benchmarks/gpu_check.py). Within 7 minutes it
# writes benchmarks/results/gpu/gpu_check.json; the exit status is 0 when every part ran and the
# GPU's tokens matched the CPU's.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
export EGMLA_KERNELS=0  # our kernels are CPU decode kernels; no time spent compiling them here
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 420 python benchmarks/gpu_check.py "$@"
