"""Checkpoints written whole and checked on resume (egmla/training/checkpoints.py), in-process:
the recorded digest against coreutils' sha256sum, a save interrupted at every step, and each
kind of damage verify_checkpoint must refuse. train.py on damaged run directories:
test_training_errors.py."""

from __future__ import annotations

import hashlib
import os
import subprocess

import pytest
import torch

from egmla.training.checkpoints import (
    ChecksummedCheckpointIO, check_weights_match, save_checkpoint, sidecar, verify_checkpoint,
)
from egmla.training.rundir import RunError
from support.training import flip_a_bit_in_a_tensor


def training_checkpoint(step: int, seed: int = 0) -> dict:
    """A dict with what Lightning's resume needs, and weights that differ from step to step."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return {"state_dict": {"model.w": torch.randn(64, 32, generator=g),
                           "model.b": torch.randn(32, generator=g)},
            "optimizer_states": [{"state": {}, "param_groups": []}], "loops": {},
            "global_step": step}


def test_the_recorded_digest_is_the_files_sha256_and_sha256sum_checks_it(tmp_path):
    path = tmp_path / "last.ckpt"
    digest = save_checkpoint(training_checkpoint(3), path)
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()  # hashed while written
    assert sidecar(path).read_text() == f"{digest}  last.ckpt\n"
    check = subprocess.run(["sha256sum", "-c", sidecar(path).name], cwd=tmp_path,
                           capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.strip() == "last.ckpt: OK", check
    loaded, verified = verify_checkpoint(path)
    assert verified and loaded["global_step"] == 3
    for key, value in training_checkpoint(3)["state_dict"].items():
        assert torch.equal(loaded["state_dict"][key], value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.ckpt.sha256"]


class SimulatedCrash(BaseException):
    """A kill: not an Exception, so no handler on the way tidies up as it would on an error."""


@pytest.mark.parametrize("crash_at", [1, 2, 3])
def test_a_save_killed_at_any_step_leaves_a_checkpoint_that_verifies(tmp_path, monkeypatch,
                                                                     crash_at):
    """The save's renames are its steps: 1 the sidecar listing both digests, 2 the checkpoint,
    3 the sidecar listing the new one. Killed before any of them, last.ckpt is the old or the
    new checkpoint, and its sidecar vouches for it."""
    path = tmp_path / "last.ckpt"
    save_checkpoint(training_checkpoint(2), path)
    real_replace, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == crash_at:
            raise SimulatedCrash(f"killed before rename {crash_at}")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(SimulatedCrash):
        save_checkpoint(training_checkpoint(4), path)
    monkeypatch.undo()
    loaded, verified = verify_checkpoint(path)
    assert verified
    assert loaded["global_step"] == (2 if crash_at <= 2 else 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.ckpt.sha256"]


def test_the_next_save_removes_what_a_killed_save_left(tmp_path):
    path = tmp_path / "last.ckpt"
    save_checkpoint(training_checkpoint(2), path)
    (tmp_path / ".last.ckpt.0badc0de.tmp").write_bytes(b"half a checkpoint")  # older names
    (tmp_path / ".last.ckpt.tmp-0badc0de0bad").write_bytes(b"half a checkpoint")
    (tmp_path / ".last.ckpt.sha256.0badc0de.tmp").write_text("half a digest")
    (tmp_path / ".best-step2.ckpt.0badc0de.tmp").write_bytes(b"another file's")
    save_checkpoint(training_checkpoint(4), path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".best-step2.ckpt.0badc0de.tmp", "last.ckpt", "last.ckpt.sha256"]


def test_a_save_that_fails_mid_write_leaves_the_old_checkpoint(tmp_path):
    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    path = tmp_path / "last.ckpt"
    save_checkpoint(training_checkpoint(2), path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    broken = training_checkpoint(4)
    broken["loops"] = {"x": Unpicklable()}  # written after the weights
    with pytest.raises(RuntimeError, match="cannot pickle"):
        save_checkpoint(broken, path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_removing_a_checkpoint_removes_its_sidecar(tmp_path):
    io = ChecksummedCheckpointIO()
    path = tmp_path / "best-step2.ckpt"
    io.save_checkpoint(training_checkpoint(2), path)
    assert sidecar(path).is_file()
    io.remove_checkpoint(path)
    assert list(tmp_path.iterdir()) == []


def damage(path, kind: str) -> None:
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif kind == "not a checkpoint":
        path.write_text("step: 2\n")
    elif kind == "bit flip":
        assert flip_a_bit_in_a_tensor(path) == "model.w"


UNREADABLE = [("empty", "is empty"),
              ("truncated", "is truncated or not a checkpoint"),
              ("not a checkpoint", "is truncated or not a checkpoint")]


@pytest.mark.parametrize("kind, needle, with_sidecar", [
    *[(kind, needle, True) for kind, needle in UNREADABLE],
    *[(kind, needle, False) for kind, needle in UNREADABLE],  # saved before checksums
    ("bit flip", "its bytes changed after it was saved", True),  # without: the next test
])
def test_damage_is_refused_naming_the_file(tmp_path, kind, needle, with_sidecar):
    path = tmp_path / "last.ckpt"
    save_checkpoint(training_checkpoint(2), path)
    if not with_sidecar:
        sidecar(path).unlink()
    damage(path, kind)
    with pytest.raises(RunError, match=needle) as err:
        verify_checkpoint(path)
    assert str(err.value).startswith(f"{path}: ") and "best-step" in str(err.value)


def test_a_checkpoint_saved_before_checksums_loads_unverified(tmp_path):
    """What Lightning wrote before this change: no sidecar. It loads; a bit flip in its tensor
    data goes unseen (the reason for the digest), and verify says it was not verified."""
    path = tmp_path / "last.ckpt"
    torch.save(training_checkpoint(2), path)
    loaded, verified = verify_checkpoint(path)
    assert not verified and loaded["global_step"] == 2
    assert flip_a_bit_in_a_tensor(path) == "model.w"
    loaded, verified = verify_checkpoint(path)
    assert not verified
    assert not torch.equal(loaded["state_dict"]["model.w"],
                           training_checkpoint(2)["state_dict"]["model.w"])


@pytest.mark.parametrize("drop, reason", [("optimizer_states", "no 'optimizer_states'"),
                                          ("loops", "no 'loops'")])
def test_a_weights_only_file_is_not_a_training_checkpoint(tmp_path, drop, reason):
    path = tmp_path / "last.ckpt"
    checkpoint = training_checkpoint(2)
    del checkpoint[drop]
    save_checkpoint(checkpoint, path)
    with pytest.raises(RunError, match=f"is not a training checkpoint \\({reason}\\)"):
        verify_checkpoint(path)


def test_weights_of_another_model_are_refused_naming_the_tensor(tmp_path):
    path = tmp_path / "last.ckpt"
    save_checkpoint(training_checkpoint(2), path)
    loaded, _ = verify_checkpoint(path)

    class Model(torch.nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.model = torch.nn.Module()
            self.model.w = torch.nn.Parameter(torch.zeros(64, width))
            self.model.b = torch.nn.Parameter(torch.zeros(32))

    check_weights_match(path, loaded, Model(32))  # the same names and shapes: accepted
    with pytest.raises(RunError, match=r"model\.w: shape \(64, 32\) there, shape \(64, 48\) in"):
        check_weights_match(path, loaded, Model(48))
