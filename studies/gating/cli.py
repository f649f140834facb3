"""`python -m studies.gating`: the study's command line (the protocol is the package's
docstring, and docs/study.md)."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import studies.gating as package
from egmla.files import output_directory
from egmla.training.config import seed_arg
from studies.gating.plan import choose_lrs, eval_runs, plan
from studies.gating.plots import write_figures
from studies.gating.protocol import (ARM, ARMS, LR_EXTENSIONS, LRS, PHASES, RESULTS, ROOT, SEEDS,
                                     Setup, StudyError)
from studies.gating.runner import _before, execute, record, remake, score, stored_records
from studies.gating.summary import write_results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.gating", description=package.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs-dir", type=output_directory, default=ROOT / "runs" / "study",
                        help="where the runs (and their checkpoints) go (default: runs/study)")
    parser.add_argument("--results", type=output_directory, default=RESULTS,
                        help="where the record goes (default: benchmarks/results/study)")
    parser.add_argument("--phase", choices=[*PHASES, "all"], default="all")
    parser.add_argument("--arms", nargs="+", choices=list(ARM), default=[a.name for a in ARMS],
                        metavar="ARM", help=f"the arms (default: all: {', '.join(ARM)})")
    parser.add_argument("--lrs", nargs="+", type=float, default=list(LRS), metavar="LR",
                        help=f"the learning-rate grid (default: {' '.join(map(str, LRS))})")
    parser.add_argument("--lr-extensions", type=int, default=LR_EXTENSIONS, metavar="N",
                        help="how many times a best learning rate at the grid's edge may double "
                             f"(or halve) the grid past it (default: {LR_EXTENSIONS}; 0: the "
                             "grid as given)")
    parser.add_argument("--seeds", nargs="+", type=seed_arg, default=list(SEEDS), metavar="SEED",
                        help="the seeds; the first is the LR grid's (default: 0 1 2)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply every run's steps (a quick rehearsal: --scale 0.02)")
    parser.add_argument("--extra", nargs="+", default=[], metavar="OVERRIDE",
                        help="train.py overrides added to every run (a rehearsal: "
                             "trainer.final_val_batches=2); they change what the study measures")
    parser.add_argument("--eval-limit", type=int, metavar="N",
                        help="score only the first N documents of each lm-eval task (a "
                             "rehearsal; it changes what the study measures)")
    parser.add_argument("--dry-run", action="store_true",
                        help="list the runs: done (its run directory), kept (only in the "
                             "record under --results) or todo")
    parser.add_argument("--summarize", action="store_true", help="only rewrite the record")
    args = parser.parse_args(argv)
    if not 0 < args.scale < math.inf:
        parser.error(f"--scale {args.scale}: must be a finite number > 0")
    if any(not 0 < lr < math.inf for lr in args.lrs):
        parser.error(f"--lrs {' '.join(map(str, args.lrs))}: learning rates must be finite "
                     "numbers > 0")
    if args.lr_extensions < 0:
        parser.error(f"--lr-extensions {args.lr_extensions}: must be >= 0")
    if args.eval_limit is not None and args.eval_limit < 1:
        parser.error(f"--eval-limit {args.eval_limit}: must be >= 1")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds {' '.join(map(str, args.seeds))}: repeated seed")
    args.setup = Setup(tuple(dict.fromkeys(args.arms)), tuple(dict.fromkeys(args.lrs)),
                       args.lr_extensions, tuple(args.seeds), args.scale, tuple(args.extra))
    log = lambda message: print(time.strftime("%H:%M:%S"), message, flush=True)  # noqa: E731
    try:
        return _run(args, log)
    except StudyError as error:
        print(f"python -m studies.gating: error: {error}", file=sys.stderr)
        return 2


def _known(stored: dict[tuple[str, str], dict[str, Any]], records: dict[Path, dict[str, Any]],
           runs_dir: Path) -> list[dict[str, Any]]:
    """Every run known now: the stored record's, each replaced by this pass's where it has one."""
    known = {runs_dir / phase / name: r for (phase, name), r in stored.items()}
    return list({**known, **records}.values())


def _run(args, log) -> int:
    setup = args.setup
    selected = PHASES if args.phase == "all" else (args.phase,)
    train_here = not (args.dry_run or args.summarize)
    stored = stored_records(args.results)
    records: dict[Path, dict[str, Any]] = {}
    for phase in PHASES[:-1]:  # the training phases, in order: each may need the one before
        seen: set[Path] = set()
        while True:  # a phase's plan may grow from its own results (the LR grid does)
            # a phase this invocation trains needs every arm's rate (StudyError names the
            # missing); otherwise the runs of the arms that have theirs are read
            runs = plan(phase, list(records.values()), setup,
                        ready_only=not (phase in selected and train_here))
            new = [r for r in runs if r.directory(args.runs_dir) not in seen]
            if not new:
                break
            for run in new:
                directory = run.directory(args.runs_dir)
                seen.add(directory)
                finished = (directory / "summary.json").is_file()
                kept = stored.get((run.phase, run.name))
                if args.dry_run:
                    state = "done" if finished else "kept" if kept else "todo"
                    print(f"{state:4s}  {phase:9s} {run.name}")
                if finished:  # what the record knew before a remake stays in it
                    records[directory] = {**record(run, directory), **_before(kept)}
                elif kept:
                    records[directory] = kept
                elif phase in selected and train_here:
                    records[directory] = execute(run, args.runs_dir, log)
                    # the record as it stands: what this pass has read so far, and what the
                    # stored record holds of the phases it has not reached yet
                    write_results(args.results, _known(stored, records, args.runs_dir), setup)
        if args.dry_run:
            try:
                plan(phase, list(records.values()), setup)
            except StudyError as waiting:  # some arms' runs of this phase wait for a rate
                print(f"wait  {phase:9s} ({waiting})")
        elif phase == "seeds" and "eval" in selected and not args.summarize:
            # scored as soon as the runs it scores are in, while their exports are on this
            # machine (a run directory lost before would have to be trained again for it)
            _score(args, stored, records, log)
    if args.dry_run:
        return 0
    known = _known(stored, records, args.runs_dir)
    chosen = choose_lrs(known, setup)
    write_results(args.results, known, setup)
    figures = write_figures(args.results, chosen, known, choose_lrs(known, setup, "mqar_lr"))
    log(f"{len(known)} runs recorded in {args.results}"
        + (f"; figures: {', '.join(figures)}" if figures else ""))
    return 0


def _score(args, stored: dict[tuple[str, str], dict[str, Any]], records: dict[Path, dict[str, Any]],
           log) -> None:
    """The eval phase: lm-eval on every arm's seeds at its learning rate, each record rewritten
    as its scores come; a run known only from the record, and not scored there, is trained again
    for its export."""
    for run in eval_runs(list(records.values()), args.setup):
        directory = run.directory(args.runs_dir)
        if directory not in records:  # its phase has not run yet
            continue
        if not (directory / "summary.json").is_file():  # known from the record alone
            if records[directory].get("lm_eval"):  # and scored: nothing to do
                continue
            records[directory] = remake(run, args.runs_dir, records[directory], log)
            write_results(args.results, _known(stored, records, args.runs_dir), args.setup)
        score(run, args.runs_dir, log, args.eval_limit)
        records[directory] = {**record(run, directory), **_before(records[directory])}
        write_results(args.results, _known(stored, records, args.runs_dir), args.setup)


if __name__ == "__main__":
    sys.exit(main())
