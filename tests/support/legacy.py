"""Exports and a training run directory written by an earlier egmla, kept so that a change to
the model's code is shown to load what users already hold (tests/core/test_legacy_exports.py,
tests/training/test_legacy_run.py).

They were written at commit LEGACY_COMMIT (before the second seams pass, issue 40) by

    PYTHONPATH=tests .venv/bin/python tests/support/legacy.py --write

and are never rewritten: a change that cannot load them breaks users' exports and runs in
progress. What is kept, under tests/support/legacy/:

- exports/<variant>/: `save_export` of one model per attention class and form (seed 0, bfloat16
  weights), and expected.safetensors: each one's float32 logits for `IDS`, computed when written;
- run/: a 4-step tiny `train.py` run (config.json, checkpoints/last.ckpt and its .sha256), which
  a resume continues.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

LEGACY = Path(__file__).with_name("legacy")
EXPORTS = LEGACY / "exports"
EXPECTED = EXPORTS / "expected.safetensors"
RUN = LEGACY / "run"
LEGACY_COMMIT = "f3020a8"  # the code that wrote them (plus this file)
# one model per attention class and per form a converted model takes
NAMES = ("gqa", "mla-absorbed", "mla-converted-absorbed", "egmla-kv",
         "egmla-kv-converted-absorbed", "egmla-latent-absorbed", "egmla-latent-converted",
         "egmla-hidden-gate", "egmla-const-gate-absorbed", "mla-value-embed-absorbed",
         "mla-drelu-absorbed")
# the training run: TINY's settings, 4 steps, a checkpoint at step 4
RUN_OVERRIDES = ["trainer.max_steps=4", "trainer.checkpoint_every_n_steps=2",
                 "trainer.val_every_n_steps=2", "trainer.deterministic=true"]


def ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))


def logits_of(model: torch.nn.Module) -> torch.Tensor:
    """float32 logits of IDS, on one thread (a fixed reduction order)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return model.float().eval()(ids(model.config.vocab_size))
    finally:
        torch.set_num_threads(threads)


def write() -> None:
    import safetensors.torch

    from egmla.checkpoint import load_export, save_export
    from support.models import VARIANTS, build
    from support.training import TINY, compose_config

    shutil.rmtree(LEGACY, ignore_errors=True)
    expected = {}
    for name in NAMES:
        save_export(build(VARIANTS[name], dtype=torch.bfloat16), EXPORTS / name)
        expected[name] = logits_of(load_export(EXPORTS / name)).contiguous()
    safetensors.torch.save_file(expected, str(EXPECTED))

    from egmla.training.run import train
    scratch = LEGACY / "scratch"
    train(compose_config([*TINY, *RUN_OVERRIDES]), scratch)
    (RUN / "checkpoints").mkdir(parents=True)
    shutil.copy(scratch / "config.json", RUN / "config.json")
    for name in ("last.ckpt", "last.ckpt.sha256"):
        shutil.copy(scratch / "checkpoints" / name, RUN / "checkpoints" / name)
    shutil.rmtree(scratch)


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    write()
