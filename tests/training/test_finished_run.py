"""A finished run started again: reported as recorded, nothing written, no Trainer and no
validation pass; a raised trainer.max_steps trains on. And what train.py prints on the terminal:
its progress bar and its result, with Lightning's log lines kept in the run directory's
train.log (not printed twice, not on the terminal)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from egmla.training.run import train
from egmla.training.rundir import RunError
from support.training import TINY, compose_config, run_train

RUN = [*TINY, "trainer.val_every_n_steps=2", "trainer.checkpoint_every_n_steps=2",
       "trainer.final_val_batches=1"]


@pytest.fixture(scope="module", autouse=True)
def egmla_cache(tmp_path_factory):
    """One tokenizer/token cache for the module (and its subprocesses), never the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EGMLA_CACHE", str(tmp_path_factory.mktemp("egmla-cache")))
        mp.setenv("WANDB_MODE", "offline")
        yield


def snapshot(directory: Path) -> dict[str, tuple[bytes | None, int]]:
    """Every path under `directory`, hidden ones too: a file's bytes (None for a directory) and
    its modification time in nanoseconds (a directory's changes when an entry is added)."""
    return {str(p.relative_to(directory)): (p.read_bytes() if p.is_file() else None,
                                             p.stat().st_mtime_ns)
            for p in sorted([directory, *directory.rglob("*")])}


def finished_note(run_dir: Path, steps: int, max_steps: int) -> str:
    return (f"note: {run_dir} holds a finished run ({steps} steps, trainer.max_steps={max_steps}): "
            f"reporting its record, {run_dir / 'summary.json'}, without training or validating "
            "again; raise trainer.max_steps to train further")


def test_a_finished_run_is_reported_as_recorded_and_nothing_is_written(tmp_path, capsys):
    run_dir = tmp_path / "run"
    first = train(compose_config([*RUN, "trainer.max_steps=2"]), run_dir)
    assert first["global_step"] == 2
    before = snapshot(run_dir)
    capsys.readouterr()
    started = []
    again = train(compose_config([*RUN, "trainer.max_steps=2"]), run_dir,
                  on_start=lambda: started.append(True))
    assert again == first == json.loads((run_dir / "summary.json").read_text())
    assert snapshot(run_dir) == before  # summary.json, metrics.csv, run_info.json, hparams.yaml
    assert started == []  # train.py writes Hydra's record there
    assert capsys.readouterr().err.splitlines() == [finished_note(run_dir, 2, 2)]


def test_raising_max_steps_trains_on(tmp_path, capsys):
    run_dir = tmp_path / "run"
    train(compose_config([*RUN, "trainer.max_steps=2"]), run_dir)
    capsys.readouterr()
    summary = train(compose_config([*RUN, "trainer.max_steps=3"]), run_dir)
    assert "finished run" not in capsys.readouterr().err
    assert summary["global_step"] == 3
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    starts = json.loads((run_dir / "run_info.json").read_text())["starts"]
    assert [s["max_steps"] for s in starts] == [2, 3]
    with (run_dir / "metrics.csv").open() as f:
        steps = [int(row["step"]) for row in csv.DictReader(f) if row["train/loss"]]
    assert max(steps) == 2  # the third step (Lightning counts from 0) was trained now


def test_a_finished_run_with_another_model_is_still_refused(tmp_path):
    run_dir = tmp_path / "run"
    train(compose_config([*RUN, "trainer.max_steps=2"]), run_dir)
    before = snapshot(run_dir)
    with pytest.raises(RunError, match=r"different model\.d_model \(64 there, 128 now\)"):
        train(compose_config([*RUN, "trainer.max_steps=2", "model.d_model=128"]), run_dir)
    assert snapshot(run_dir) == before


# ---- through train.py: the terminal, the log, and a finished run started again ------------


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """train.py on a tiny run with wandb (offline), as the quickstart runs: the process's
    result and its run directory."""
    run_dir = tmp_path_factory.mktemp("quiet") / "run"
    args = [a for a in RUN if not a.startswith("wandb.mode=")]
    result = run_train([*args, "trainer.max_steps=2", "wandb.mode=offline",
                        f"hydra.run.dir={run_dir}"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return args, result, run_dir


@pytest.mark.slow
def test_the_terminal_shows_the_bar_and_the_result_and_train_log_the_rest(first_run):
    _, result, run_dir = first_run
    terminal = result.stdout + result.stderr
    log = (run_dir / "train.log").read_text()
    for line in ("GPU available: False", "`Trainer.fit` stopped: `max_steps=2` reached."):
        assert log.count(line) == 1, log  # in the log, once
        assert line not in terminal, terminal  # Lightning's INFO lines: not on the terminal
    assert "INFO" not in terminal  # neither Lightning's own "INFO: ..." nor Hydra's "[INFO]"
    assert "litlogger" in log and "litlogger" not in terminal  # the logger advertisement
    assert "Total params" in log and "Total params" not in terminal  # the model summary
    assert "Total FLOPs" not in terminal and "Total Flops" in log
    assert "Run summary" not in terminal and "Run history" not in terminal  # wandb's, at finish
    assert list((run_dir / "wandb").glob("offline-run-*"))  # wandb did run
    assert "Epoch 0: 100%" in result.stdout  # the progress bar
    summary = json.loads((run_dir / "summary.json").read_text())
    assert result.stdout.splitlines()[-3:] == [
        f"run default: 2 steps in {summary['fit_seconds']} s -> {run_dir}",
        f"validation loss {summary['val_loss']:.3f} nats/token "
        f"(unigram baseline {summary['unigram_val_loss']:.3f})",
        f"export: {run_dir / 'export'}  (load with egmla.checkpoint.load_export)"]


@pytest.mark.slow
def test_train_py_on_a_finished_run_prints_its_result_and_writes_nothing(first_run):
    """Not even Hydra's record (.hydra/<time>/), wandb's files or train.log."""
    args, result, run_dir = first_run
    before = snapshot(run_dir)
    again = run_train([*args, "trainer.max_steps=2", "wandb.mode=offline",
                       f"hydra.run.dir={run_dir}"], timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert snapshot(run_dir) == before
    assert again.stderr.splitlines() == [finished_note(run_dir, 2, 2)]
    printed = result.stdout[result.stdout.index("\nrun default: "):]
    assert again.stdout == printed  # the first run's result, as it printed it
