"""Running the plan: train (or resume) a run as a train.py process, read its record from its
run directory or from the committed record, train again a run known only from the record
(its export is needed), and score a run's export with the offline lm-eval tasks."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from eval.compare import lm_eval_metrics, tokens_trained
from studies.gating.protocol import EVAL_BATCH_SIZE, LM_EVAL_TASKS, ROOT, Run, StudyError


def execute(run: Run, runs_dir: Path, log) -> dict[str, Any]:
    """Train (or resume) one run; return its record. A finished run is read, not re-run."""
    directory = run.directory(runs_dir)
    if not (directory / "summary.json").is_file():
        directory.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        log(f"{run.phase:9s} {run.name} ...")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with (directory.parent / f"{run.name}.log").open("w") as out:
            done = subprocess.run(run.command(runs_dir), stdout=out, stderr=subprocess.STDOUT,
                                  cwd=ROOT, env=env)
        if done.returncode != 0:
            raise StudyError(f"{run.name} failed (exit {done.returncode}); its log: "
                             f"{directory.parent / (run.name + '.log')}")
        log(f"{run.phase:9s} {run.name} done in {time.perf_counter() - started:.0f} s")
        # A finished run keeps its export and metrics; its checkpoints (weights and optimizer
        # state, 100+ MB a run) are only needed to resume, which a finished run never does.
        shutil.rmtree(directory / "checkpoints", ignore_errors=True)
    return record(run, directory)


def record(run: Run, directory: Path) -> dict[str, Any]:
    summary = json.loads((directory / "summary.json").read_text())
    info = json.loads((directory / "run_info.json").read_text())
    curve = []
    metrics = directory / "metrics.csv"
    if metrics.is_file():
        with metrics.open() as f:
            for row in csv.DictReader(f):  # every periodic validation: loss, MQAR accuracy
                if row.get("val/loss"):
                    curve.append({"step": int(float(row["step"])), **{
                        k.removeprefix("val/"): float(v) for k, v in row.items()
                        if k.startswith("val/") and v not in ("", None)}})
    config = json.loads((directory / "config.json").read_text())
    return {"run": run.name, "phase": run.phase, "arm": run.arm, "lr": run.lr, "seed": run.seed,
            "steps": summary["global_step"],
            "tokens": tokens_trained(config, summary["global_step"]),
            "val_loss": summary["val_loss"],
            "unigram_val_loss": summary.get("unigram_val_loss"),
            "mqar_accuracy": summary.get("mqar_accuracy"), "fit_seconds": summary["fit_seconds"],
            "fit_seconds_all_starts": summary.get("fit_seconds_all_starts"),
            "params": info["params"], "kv_bytes_per_token_bf16": info["kv_bytes_per_token_bf16"],
            "val_curve": curve, "lm_eval": lm_eval_scores(directory),
            "git": info["starts"][-1].get("git")}


def lm_eval_scores(directory: Path) -> dict[str, float]:
    return lm_eval_metrics(directory) if (directory / "eval").is_dir() else {}


def stored_records(results: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """The runs recorded under RESULTS/runs, by (phase, run name): finished runs, whether or not
    their run directories are still here."""
    kept = {}
    for path in sorted((results / "runs").glob("*.json")):
        try:
            r = json.loads(path.read_text())
            kept[(r["phase"], r["run"])] = r
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StudyError(f"{path}: not a study run record ({type(e).__name__}: {e})") from None
    return kept


def remake(run: Run, runs_dir: Path, kept: dict[str, Any], log) -> dict[str, Any]:
    """Train again a run known only from the record (its export is needed): the same command,
    so the same seed and data order; the record keeps the loss it had before."""
    log(f"{run.phase:9s} {run.name}: only in the record; trained again for its export")
    return {**execute(run, runs_dir, log), **_before(kept, remade=True)}


def _before(kept: dict[str, Any] | None, remade: bool = False) -> dict[str, Any]:
    """`remade`: what the record held before the run was trained again (its loss and git SHA,
    and how it was recovered), for a run record built anew from its run directory. `remade`
    says the run was just trained again; otherwise only a record that says so (or that was
    recovered, so that its run directory can only be a remake's) carries it."""
    if not kept:
        return {}
    if "remade" in kept:
        return {"remade": kept["remade"]}
    if not (remade or "recovered" in kept):
        return {}
    return {"remade": {"recorded_val_loss": kept["val_loss"], "recorded_git": kept.get("git"),
                       **({"recovered": kept["recovered"]} if "recovered" in kept else {})}}


def score(run: Run, runs_dir: Path, log, limit: int | None = None) -> None:
    """The offline lm-eval tasks on a run's final export, into RUN/eval (skipped if there);
    `limit`: the first documents of each task only (a rehearsal)."""
    directory = run.directory(runs_dir)
    if (directory / "eval").is_dir() and lm_eval_scores(directory):
        return
    log(f"eval      {run.name} ...")
    cmd = [sys.executable, "-m", "eval.lm_eval", "--model", "egmla", "--model_args",
           f"pretrained={directory / 'export'}", "--tasks", ",".join(LM_EVAL_TASKS),
           "--include_path", str(ROOT / "eval" / "tasks"), "--output_path", str(directory / "eval"),
           "--batch_size", str(EVAL_BATCH_SIZE),
           *(["--limit", str(limit)] if limit else [])]
    with (directory.parent / f"{run.name}.eval.log").open("w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode != 0:
        raise StudyError(f"lm-eval on {run.name} failed (exit {done.returncode})")
