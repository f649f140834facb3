"""Shared by the training tests: tiny overrides, and train.py run for real."""

from __future__ import annotations

import os
import subprocess
import sys

from egmla.training.compose import CONFIGS, compose_config
from support import ROOT

__all__ = ["CONFIGS", "ROOT", "TINY", "compose_config", "run_train"]

# A tiny, fast text run: 2-layer d=64 model, 512-token BPE, short sequences, no wandb.
TINY = [
    "model=tiny", "data.seq_len=32", "data.batch_size=4", "data.tokenizer.vocab_size=512",
    "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1", "wandb.mode=disabled",
    "sample_prompt=null", "optim.warmup_steps=2",
]


def run_train(args: list[str], *, launcher: list[str] | None = None,
              timeout: int = 600) -> subprocess.CompletedProcess:
    """Run train.py in a fresh process (optionally under torchrun), as a user would."""
    cmd = [*(launcher or [sys.executable]), str(ROOT / "train.py"), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
