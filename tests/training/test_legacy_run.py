"""A training run directory written by an earlier egmla (tests/support/legacy.py says which
commit) resumes: its checkpoint verifies against its sidecar, matches the model, and train.py
continues it from its step."""

from __future__ import annotations

import csv
import json
import shutil

import torch

from egmla.export import load_lightning
from egmla.training.checkpoints import verify_checkpoint
from egmla.training.run import train
from support.legacy import RUN, RUN_OVERRIDES
from support.training import TINY, compose_config


def test_an_earlier_run_resumes_from_its_checkpoint(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    checkpoint, verified = verify_checkpoint(run / "checkpoints" / "last.ckpt")
    assert verified and checkpoint["global_step"] == 4
    kept = load_lightning(run / "checkpoints" / "last.ckpt").state_dict()
    overrides = [*TINY, *RUN_OVERRIDES, "trainer.max_steps=6"]
    summary = train(compose_config(overrides), run)
    assert summary["global_step"] == 6
    # its checkpoint carries no training clock: the time of its earlier start is unknown
    assert summary["fit_seconds"] > 0 and summary["fit_seconds_all_starts"] is None
    info = json.loads((run / "run_info.json").read_text())
    assert info["starts"][-1]["resumed_from"].endswith("last.ckpt")
    with (run / "metrics.csv").open() as f:  # only steps 5 and 6 were trained now
        steps = [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")]
    assert steps and min(steps) >= 4 and max(steps) == 5  # Lightning counts steps from 0
    resumed = load_lightning(run / "checkpoints" / "last.ckpt").state_dict()
    assert resumed.keys() == kept.keys()
    assert any(not torch.equal(kept[k], resumed[k]) for k in kept)


def test_export_checks_a_checkpoints_digest(tmp_path):
    """`python -m egmla.export` exports the kept checkpoint, and refuses it in one line, writing
    nothing, once a bit of a tensor has changed (its digest no longer matches its sidecar)."""
    from support.training import flip_a_bit_in_a_tensor
    from support.processes import assert_one_line_error, run_export

    shutil.copytree(RUN / "checkpoints", tmp_path / "ckpt")
    good = run_export("--checkpoint", "ckpt/last.ckpt", "--out", "good", "--format", "egmla",
                      cwd=tmp_path)
    assert good.returncode == 0, good.stderr[-2000:]
    flip_a_bit_in_a_tensor(tmp_path / "ckpt" / "last.ckpt")
    bad = run_export("--checkpoint", "ckpt/last.ckpt", "--out", "bad", cwd=tmp_path)
    assert_one_line_error(bad, "ckpt/last.ckpt", "bytes changed", "last.ckpt.sha256")
    assert not (tmp_path / "bad").exists()
