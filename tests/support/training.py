"""Shared by the training tests: tiny overrides, train.py run for real, and what the tests of
a damaged run directory need (its tree of digests, a bit flipped inside a tensor)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from egmla.training.compose import CONFIGS, compose_config
from support import ROOT

__all__ = ["CONFIGS", "ROOT", "TINY", "compose_config", "flip_a_bit_in_a_tensor", "run_train",
           "tree"]

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


def tree(directory: Path) -> dict[str, str | None]:
    """Every path under `directory`, hidden ones too: a file's SHA-256, None for a directory."""
    return {str(p.relative_to(directory)):
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            for p in sorted(directory.rglob("*"))}


def flip_a_bit_in_a_tensor(path: Path) -> str:
    """Flip one bit in the middle of a tensor's data in a checkpoint, found by the tensor's bytes
    in the file (the first weight of at least 1 KiB whose bytes occur there once); return its
    name."""
    import torch

    state = torch.load(path, weights_only=True)["state_dict"]
    data = bytearray(path.read_bytes())
    for key, tensor in state.items():
        needle = tensor.contiguous().numpy().tobytes()
        if len(needle) >= 1024 and data.count(needle) == 1:
            data[data.find(needle) + len(needle) // 2] ^= 0x08
            path.write_bytes(bytes(data))
            return key
    raise AssertionError(f"{path}: no tensor found by its bytes")
