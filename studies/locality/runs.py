"""Issue 19's measurements end to end, resumable: `python -m studies.locality.runs`.

Model by model (drelu, swiglu, reglu, relu2 at seed 0, then SmolLM2-135M-Instruct, the
training-free baseline), so that each figure comes as soon as its model is ready:

1. train: the model, `experiment=locality` (equal tokens and parameters across activations);
   the finished run's record (final validation loss, tokens, parameters) goes to
   `<results>/runs/<name>.json`, committed;
2. profile and predictors: `python -m studies.locality profile|predictors`, SwiGLU models at
   per-layer magnitude thresholds calibrated for 50% sparsity (CATS), the ReLU family at exact
   zeros; the reports are copied to `<results>/<name>/` (made again when a report was made at
   another setting);
3. benchmark: `benchmarks/activation_locality.py --add --model M`, which adds the model to the
   record `<results>/activation_locality.{json,md}` (measured again when its entry was made at
   another target sparsity);

then train the two more seeds of swiglu and drelu (only the loss table needs them), and

4. losses: each activation's validation loss against SwiGLU's, mean and 95% interval over the
   seeds it has, the difference unpaired (Welch) and paired by seed (a seed is the data order),
   written to `<results>/losses.{json,md}`.

One more step, asked for by name (`--steps lean`), not by default: issue 42's re-run of drelu's
leaner predictors (docs/activation_locality.md, "Leaner predictors reach it"), whose figure was
measured with predictors made by hand, with no hash in the record, for a model whose run
directory is gone. Into `--lean-results` (`<lean>`, default
benchmarks/results/locality_lean_predictors), each file named by its hash:

5. lean: (a) locality-drelu-s0 trained again if its export is missing (train(), the same
   command), its record in `<lean>/runs/` (issue 19's record of the first run, from which the
   loss table is built, stays as it is); (b) the default predictors, where the predictors step
   writes them (`<export>/locality`); (c) the search, as documented: `python -m studies.locality
   predictors --model <export> --ranks 32 --hot 0.1 0.05 0.03 --recall 0.95 0.9 0.85 --out
   <export>/locality-search`, which keeps the predictors of the setting it chooses (the fewest
   neurons computed within the tolerance) in predictors.safetensors there and the nine
   settings' table in predictors.{json,md}; (d) the benchmark (`--repeats 5 --skip-lm-eval
   --fresh`) with the search's predictors into `<lean>`, replacing the record there, then with
   the defaults into `<lean>/defaults`, one right after the other; each predictors report (its
   file's sha256 in it) is copied beside the record that measured the file.
   The benchmarks are done when both records were made with these settings and each holds the
   hash its report beside it names, the report made with these settings; if either is not,
   both are measured again, so the pair always comes from one session. A predictors file is
   made again unless the one there comes with a report of these settings and its hash; the
   model is trained again only when something is to be measured and it is missing.
   `--dry-run` lists the step's commands, todo or done.

Re-running skips what is done. A run known only from its record (a new machine: run
directories are not committed) is not trained again unless a later step needs its model: a
seed-0 model is, until the benchmark's record holds it.

    python -m studies.locality.runs                       # everything, in the background
    python -m studies.locality.runs --steps train losses  # only some steps
    python -m studies.locality.runs --steps lean --dry-run  # what the lean step would run
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from egmla.files import output_directory
from studies.pipeline import PipelineError, read_record, run_logged, write_json

ROOT = Path(__file__).resolve().parents[2]
# drelu first: the acceptance figure (its predicted-sparse speedup) is the one to have soonest
RUNS = [("drelu", 0), ("swiglu", 0), ("reglu", 0), ("relu2", 0),
        ("swiglu", 1), ("drelu", 1), ("swiglu", 2), ("drelu", 2)]
SMOLLM2 = "SmolLM2-135M-Instruct"
# SwiGLU has no exact zeros: its neurons fire above magnitude thresholds, one per layer,
# calibrated so that this share of each layer's neurons is skipped per token (CATS; TEAL's
# 40-50%)
SWIGLU_SPARSITY = 0.5
STEPS = ("train", "losses", "profile", "predictors", "benchmark")
LEAN = "lean"  # a one-off re-measurement (issue 42): asked for by name, never by default


def run_name(ffn: str, seed: int) -> str:
    return f"locality-{ffn}-s{seed}"


def train_command(ffn: str, seed: int, runs_dir: Path, extra: list[str]) -> list[str]:
    width = ["model.d_ff=2304"] if ffn == "relu2" else []  # no gate: 1.5x wide, equal parameters
    return [sys.executable, str(ROOT / "train.py"), "experiment=locality", f"model.ffn={ffn}",
            *width, f"seed={seed}", "wandb.mode=disabled", f"name={run_name(ffn, seed)}",
            f"hydra.run.dir={runs_dir / run_name(ffn, seed)}", *extra]


def trained_model(directory: Path) -> bool:
    """Whether the run in `directory` finished and exported its model."""
    return (directory / "summary.json").is_file() and (directory / "export" / "config.json").is_file()


def train(ffn: str, seed: int, args, log, need_model: bool,
          record_file: Path | None = None) -> dict[str, Any]:
    """The run's record (at `record_file`, default `<results>/runs/<name>.json`), training it
    first unless the record exists and its model is not needed (or is there)."""
    name = run_name(ffn, seed)
    record_file = record_file or args.results / "runs" / f"{name}.json"
    directory = args.runs_dir / name
    export = directory / "export"
    if record_file.is_file() and (not need_model or (export / "config.json").is_file()):
        return read_record(record_file)
    if not trained_model(directory):
        run_logged(train_command(ffn, seed, args.runs_dir, args.overrides), args.runs_dir / f"{name}.log",
             log)
        shutil.rmtree(directory / "checkpoints", ignore_errors=True)  # only a resume needs them
    summary = json.loads((directory / "summary.json").read_text())
    config = json.loads((directory / "config.json").read_text())
    info = json.loads((directory / "run_info.json").read_text())
    model = json.loads((export / "config.json").read_text())
    data = config["data"]
    record = {"name": name, "ffn": ffn, "seed": seed, "val_loss": summary["val_loss"],
              "steps": summary["global_step"],
              "tokens": summary["global_step"] * data["batch_size"] * data["seq_len"],
              "params": info.get("params"), "d_ff": model["d_ff"],
              "precision": config["trainer"]["precision"], "fit_seconds": summary["fit_seconds"],
              "overrides": args.overrides, "git": info["starts"][-1].get("git")}
    write_json(record_file, record)
    return record


def losses(records: list[dict[str, Any]], results: Path) -> dict[str, Any]:
    """Each activation's final validation loss against SwiGLU's: per seed, mean and interval;
    the difference of means with Welch's interval (unpaired: different models); and the
    difference paired by seed with its t-interval (a seed fixes the data order, shared across
    activations, so the pairing removes the order's share of the spread)."""
    from eval.stats import difference_interval, interval, paired

    by_ffn: dict[str, dict[int, float]] = {}
    for r in records:
        by_ffn.setdefault(r["ffn"], {})[r["seed"]] = r["val_loss"]
    base = interval(list(by_ffn.get("swiglu", {}).values()))
    rows = []
    for ffn, seeds in by_ffn.items():
        ci = interval(list(seeds.values()))
        rows.append({"ffn": ffn, "val_loss_by_seed": seeds, "val_loss": ci,
                     "vs_swiglu": ci["mean"] - base["mean"] if base["n"] else None,
                     "vs_swiglu_percent": 100 * (ci["mean"] - base["mean"]) / base["mean"]
                     if base["n"] else None,
                     "vs_swiglu_interval": difference_interval(
                         list(seeds.values()), list(by_ffn["swiglu"].values()))
                     if base["n"] and ffn != "swiglu" else None,
                     "vs_swiglu_paired": paired(seeds, by_ffn["swiglu"])
                     if base["n"] and ffn != "swiglu" else None})
    report = {"what": "final validation loss (nats/token, held-out split) per MLP activation at "
                      "equal tokens and parameters (configs/experiment/locality.yaml)",
              "rows": rows}
    write_json(results / "losses.json", report)
    lines = ["# Loss cost of each MLP activation against SwiGLU (issue 19)", "",
             report["what"] + "; mean and 95% t-interval over the seeds there are; the "
             "difference from SwiGLU with Welch's 95% interval (unpaired) where both have two "
             "seeds or more, and paired by seed (the same seed is the same data order) with "
             "the t-interval of the per-seed differences.", "",
             "| activation | seeds | val loss | 95% CI | vs SwiGLU | 95% CI of the difference "
             "(Welch) | paired by seed: mean, 95% CI |",
             "|---|---:|---:|---|---:|---|---|"]
    for row in rows:
        ci, d, p = row["val_loss"], row["vs_swiglu_interval"], row["vs_swiglu_paired"]
        span = "" if ci["low"] is None else f"[{ci['low']:.4f}, {ci['high']:.4f}]"
        diff = "" if row["vs_swiglu"] is None else (f"{row['vs_swiglu']:+.4f} "
                                                   f"({row['vs_swiglu_percent']:+.2f}%)")
        d_span = "" if d is None or d["low"] is None else f"[{d['low']:+.4f}, {d['high']:+.4f}]"
        paired = "" if p is None or p["low"] is None else (
            f"{p['mean']:+.4f} [{p['low']:+.4f}, {p['high']:+.4f}] ({p['n']} seeds)")
        lines.append(f"| {row['ffn']} | {ci['n']} | {ci['mean']:.4f} | {span} | {diff} | "
                     f"{d_span} | {paired} |")
    (results / "losses.md").write_text("\n".join(lines) + "\n")
    return report


def benchmarked(results: Path) -> dict[str, float | None]:
    """The models the benchmark's records in `results` hold, by a run's name (its export's
    directory) or a known model's: the target sparsity each was measured at (None: none)."""
    names = {}
    for record in results.glob("activation_locality*.json"):
        for m in (read_record(record) or {}).get("models", []):
            name = m["model"] if m["model"] == SMOLLM2 else Path(m["model"]).parent.name
            names[name] = m.get("sparsity")
    return names


def target(ffn: str) -> float | None:
    """The target sparsity a model of this MLP activation is measured at (None: exact zeros)."""
    return SWIGLU_SPARSITY if ffn == "swiglu" else None


def firing_args(sparsity: float | None) -> list[str]:
    """studies.locality's arguments for a model's firing set: exact zeros, or per-layer
    thresholds for a target sparsity."""
    return ["--threshold", "0.0"] if sparsity is None else ["--sparsity", str(sparsity)]


def locality_command(command: str, model: str, work: Path, sparsity: float | None,
                     extra: list[str]) -> list[str]:
    """`python -m studies.locality <command>` for `model`, writing into `work`."""
    return [sys.executable, "-m", "studies.locality", command, "--model", model, "--out", str(work),
            *firing_args(sparsity), *extra]


def locality(command: str, model: str, name: str, args, log,
             sparsity: float | None = None) -> None:
    """`python -m studies.locality <command>` for `model`, its reports copied to results/<name>.
    It writes where the benchmark looks (studies.locality.default_out)."""
    from studies.locality import default_out

    out = args.results / name
    work = ROOT / default_out(model)
    report_file = out / f"{command}.json"
    report = read_record(report_file)
    # the benchmark reads the predictors' file, which is not committed: remade while it is
    # needed, if a rank was chosen (else there is none to make)
    missing = (command == "predictors" and benchmarked(args.results).get(name, -1) != sparsity
               and report is not None and report["chosen_rank"] is not None
               and not (work / "predictors.safetensors").is_file())
    config = (report or {}).get("meta", {}).get("config", {})
    if report is not None and not missing and config.get("sparsity") == sparsity:
        return
    cmd = locality_command(command, model, work, sparsity, getattr(args, f"{command}_args"))
    run_logged(cmd, args.runs_dir / f"{name}-{command}.log", log)
    out.mkdir(parents=True, exist_ok=True)
    for file in (f"{command}.json", f"{command}.md", "profile.png"):
        if (work / file).is_file():
            shutil.copyfile(work / file, out / file)


# ---- the lean step (issue 42; the module's doc, step 5) --------------------------------------

LEAN_RUN = ("drelu", 0)
LEAN_NAME = run_name(*LEAN_RUN)
LEAN_SEARCH = ["--ranks", "32", "--hot", "0.1", "0.05", "0.03", "--recall", "0.95", "0.9", "0.85"]
# --fresh: never a model kept from an interrupted run's partial record (made with other files)
LEAN_BENCHMARK = ["--repeats", "5", "--skip-lm-eval", "--fresh"]
BENCHMARK_SCRIPT = ROOT / "benchmarks" / "activation_locality.py"
PREDICTORS_REPORTS = ("predictors.json", "predictors.md")
REPORT_PLACE = ("model", "out")  # where a report was made, not how: its directory says that


@dataclass(frozen=True)
class Predictors:
    """A predictors set: the command that makes it in `work` (predictors.safetensors and its
    report), and `results`, where its report and the benchmark's record of it go."""
    what: str
    cmd: list[str]
    work: Path
    results: Path

    @property
    def file(self) -> Path:
        return self.work / "predictors.safetensors"


@dataclass(frozen=True)
class LeanPart:
    """One command of the lean step, its log, and whether it is to run; `reports`: for a
    predictors command, the set whose report is copied beside its record after it (run or
    done before: the report must be the one the benchmark that follows measures)."""
    what: str
    cmd: list[str]
    log: Path
    todo: bool
    reports: Predictors | None = None


def lean_predictors(export: Path, results: Path, extra: list[str]) -> list[Predictors]:
    """The default predictors and the search's, in the order they are made."""
    defaults = export / "locality"  # where the predictors step writes (studies.locality.default_out)
    search = export / "locality-search"
    return [Predictors("default predictors",
                       locality_command("predictors", str(export), defaults, None, extra),
                       defaults, results / "defaults"),
            Predictors("search", [sys.executable, "-m", "studies.locality", "predictors", "--model",
                                  str(export), *LEAN_SEARCH, "--out", str(search), *extra],
                       search, results)]


def benchmark_command(p: Predictors, export: Path, extra: list[str]) -> list[str]:
    return [sys.executable, str(BENCHMARK_SCRIPT), "--out", str(p.results), "--model", str(export),
            "--predictors", str(p.file), *LEAN_BENCHMARK, *extra]


def predictors_settings(cmd: list[str]) -> dict[str, Any]:
    """The settings a predictors report made by `cmd` records (its meta.config, less
    REPORT_PLACE)."""
    from studies.locality.cli import build_parser, recorded_config

    config = json.loads(json.dumps(recorded_config(build_parser().parse_args(cmd[3:]))))
    return {k: v for k, v in config.items() if k not in REPORT_PLACE}


def made_by(report: Path, cmd: list[str]) -> str | None:
    """The sha256 of the predictors file the report describes, if `cmd`'s settings made it."""
    if not report.is_file():
        return None
    meta = (read_record(report) or {}).get("meta", {})
    config = {k: v for k, v in meta.get("config", {}).items() if k not in REPORT_PLACE}
    return meta.get("predictors_sha256") if config == predictors_settings(cmd) else None


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def predictors_ready(p: Predictors) -> bool:
    """Whether p's file is there with a report of p's settings naming its hash."""
    made = made_by(p.work / "predictors.json", p.cmd)
    return made is not None and p.file.is_file() and sha256(p.file) == made


@functools.cache
def benchmark_module():
    """benchmarks/activation_locality.py (a script, not a package): its arguments and record."""
    spec = importlib.util.spec_from_file_location("activation_locality", BENCHMARK_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lean_measured(p: Predictors, cmd: list[str]) -> bool:
    """Whether p's results hold a record of the benchmark `cmd` runs (its settings) that
    measured the predictors its report there names, the report made with p's settings."""
    bench = benchmark_module()
    args = bench.parse_args(cmd[2:])
    record = p.results / f"activation_locality{'_quick' if args.quick else ''}.json"
    made = made_by(p.results / "predictors.json", p.cmd)
    if made is None or not record.is_file():
        return False
    old = read_record(record) or {}
    want = json.loads(json.dumps({k: v for k, v in vars(args).items() if k not in bench.PER_MODEL}))
    return old.get("settings") == want and any(
        (m.get("predictors_provenance") or {}).get("sha256") == made for m in old.get("models", []))


def lean_plan(args) -> list[LeanPart]:
    """The step's commands in order, each marked todo or done from the files there before
    anything runs: the benchmarks both or neither; the model if they are to run and it is not
    there; predictors if they are to run and the model is to be trained (older files of a run
    trained anew do not count) or their file is not there with its report."""
    directory = args.runs_dir / LEAN_NAME
    export = directory / "export"
    sets = lean_predictors(export, args.lean_results, args.predictors_args)
    benchmarks = [benchmark_command(p, export, args.benchmark_args) for p in sets]
    todo = not all(lean_measured(p, cmd) for p, cmd in zip(sets, benchmarks))

    def log(what: str) -> Path:
        return args.runs_dir / f"{LEAN_NAME}-lean-{what}.log"
    model = todo and not trained_model(directory)  # and predictors of a model trained anew
    return [LeanPart("train", train_command(*LEAN_RUN, args.runs_dir, args.overrides),
                     args.runs_dir / f"{LEAN_NAME}.log", model),
            *(LeanPart(p.what, p.cmd, log(p.work.name),
                       model or (todo and not predictors_ready(p)), p) for p in sets),
            # the search's first: the figure the docs quote, then the defaults beside it
            *(LeanPart(f"benchmark, {p.what}", cmd, log(f"benchmark-{p.work.name}"), todo)
              for p, cmd in reversed(list(zip(sets, benchmarks))))]


def describe_plan(parts: list[LeanPart]) -> str:
    """The plan as `--dry-run` prints it: one line a command, todo or done."""
    return "\n".join(f"{'todo' if p.todo else 'done'}  {p.what}: {shlex.join(p.cmd)}"
                     for p in parts)


def keep_reports(p: Predictors) -> None:
    """p's report copied beside its record; PipelineError if it made no predictors file."""
    if not p.file.is_file():
        raise PipelineError(f"{p.what}: no {p.file} (no setting within the tolerance?); see "
                            f"{p.work / 'predictors.md'}")
    p.results.mkdir(parents=True, exist_ok=True)
    for name in PREDICTORS_REPORTS:
        shutil.copyfile(p.work / name, p.results / name)


def lean(args, log) -> None:
    """The lean step (the module's doc, step 5): the plan's todo commands, in order."""
    parts = lean_plan(args)
    if not any(part.todo for part in parts):
        log(f"lean: done ({args.lean_results} holds both benchmarks of these predictors)")
        return
    # the model's record beside the figures (trained first if the export is missing)
    train(*LEAN_RUN, args, log, need_model=True,
          record_file=args.lean_results / "runs" / f"{LEAN_NAME}.json")
    for part in parts[1:]:
        if part.todo:
            run_logged(part.cmd, part.log, log)
        if part.reports is not None:
            keep_reports(part.reports)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.locality.runs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", nargs="+", choices=(*STEPS, LEAN), default=list(STEPS),
                   help="which steps to run (default: all but lean, in the order above; lean "
                        "comes last)")
    p.add_argument("--runs-dir", type=output_directory, default=ROOT / "runs" / "locality-runs",
                   help="where the runs train (default runs/locality-runs)")
    p.add_argument("--results", type=output_directory, default=ROOT / "benchmarks" / "results" / "locality",
                   help="where the records go (default benchmarks/results/locality)")
    p.add_argument("--overrides", nargs="*", default=[],
                   help="train.py overrides for every run (a rehearsal: trainer.max_steps=2 ...)")
    for step, what in (("profile", "python -m studies.locality profile"),
                       ("predictors", "python -m studies.locality predictors"),
                       ("benchmark", "benchmarks/activation_locality.py")):
        p.add_argument(f"--{step}-args", type=shlex.split, default=[], metavar="'ARGS'",
                       help=f"extra arguments for {what}, one quoted string (e.g. '--quick')")
    p.add_argument("--no-smollm2", action="store_true",
                   help="leave SmolLM2 out of the profile, predictors and benchmark steps")
    p.add_argument("--lean-results", type=output_directory,
                   default=ROOT / "benchmarks" / "results" / "locality_lean_predictors",
                   help="where the lean step's records go (default "
                        "benchmarks/results/locality_lean_predictors)")
    p.add_argument("--dry-run", action="store_true",
                   help="with --steps lean: list the lean step's commands, todo or done, and "
                        "run nothing")
    args = p.parse_args(argv)
    if args.dry_run and args.steps != [LEAN]:
        p.error("--dry-run: only the lean step lists its plan (--steps lean --dry-run)")
    args.runs_dir, args.results = args.runs_dir.resolve(), args.results.resolve()
    args.lean_results = args.lean_results.resolve()
    log = lambda message: print(time.strftime("%H:%M:%S"), message, flush=True)  # noqa: E731
    if args.dry_run:
        print(describe_plan(lean_plan(args)))
        return 0
    steps = set(args.steps)
    later = steps & {"profile", "predictors", "benchmark"}

    def trained(runs: list[tuple[str, int]]) -> list[dict[str, Any]]:
        records = []
        if "train" in steps or "losses" in steps or later:
            for ffn, seed in runs:
                name = run_name(ffn, seed)
                need = (seed == 0 and bool(later)
                        and benchmarked(args.results).get(name, -1) != target(ffn))
                if "train" not in steps and not (args.results / "runs" / f"{name}.json").is_file():
                    continue
                records.append(train(ffn, seed, args, log, need_model=need))
        return records

    def measure(name: str, model: str, sparsity: float | None) -> None:
        for command in ("profile", "predictors"):
            if command in steps:
                locality(command, model, name, args, log, sparsity)
        if "benchmark" in steps and benchmarked(args.results).get(name, -1) != sparsity:
            # it finds the predictors (and their thresholds) where studies.locality wrote them
            target = [] if sparsity is None else ["--swiglu-sparsity", str(sparsity)]
            cmd = [sys.executable, str(ROOT / "benchmarks" / "activation_locality.py"),
                   "--out", str(args.results), "--add", "--model", model, *target,
                   *args.benchmark_args]
            run_logged(cmd, args.runs_dir / f"{name}-benchmark.log", log)

    try:
        records = []
        for ffn, seed in [run for run in RUNS if run[1] == 0]:
            done = trained([(ffn, seed)])
            records += done
            if done:  # its record is there (and its model, while the benchmark needs it)
                measure(run_name(ffn, seed), str(args.runs_dir / run_name(ffn, seed) / "export"),
                        target(ffn))
        if not args.no_smollm2:
            measure(SMOLLM2, SMOLLM2, SWIGLU_SPARSITY)
        records += trained([run for run in RUNS if run[1] != 0])
        if "losses" in steps and records:
            print((args.results / "losses.md").read_text() if losses(records, args.results) else "")
        if LEAN in steps:
            lean(args, log)
    except PipelineError as error:
        print(f"locality_runs: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
