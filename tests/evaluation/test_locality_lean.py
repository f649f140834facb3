"""The lean step of the locality pipeline (studies/locality/runs.py, issue 42): drelu trained again
if its model is missing, the default predictors and the documented search made, then both
benchmarked one after the other, each record beside the report naming its predictors' hash; a
part is skipped when its output is there and made with its settings. The plan is checked on
real files in a temporary directory; one slow test runs the step for real on a tiny model."""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from studies.locality import runs
from studies.locality.cli import build_parser, recorded_config
from studies.pipeline import PipelineError
from support import ROOT

ORDER = ["train", "default predictors", "search", "benchmark, search",
         "benchmark, default predictors"]


def lean_args(tmp_path) -> argparse.Namespace:
    """What `python -m studies.locality.runs --steps lean` parses to, under tmp_path."""
    return argparse.Namespace(runs_dir=tmp_path / "runs", lean_results=tmp_path / "lean",
                              predictors_args=[], benchmark_args=[], overrides=[])


def parts(args) -> dict[str, runs.LeanPart]:
    return {part.what: part for part in runs.lean_plan(args)}


def todo(args) -> list[str]:
    return [part.what for part in runs.lean_plan(args) if part.todo]


def report(cmd: list[str], sha: str | None) -> dict:
    """A predictors report as `python -m studies.locality` writes it for `cmd` (the fields read)."""
    config = json.loads(json.dumps(recorded_config(build_parser().parse_args(cmd[3:]))))
    return {"meta": {"config": config, **({"predictors_sha256": sha} if sha else {})}}


def record(cmd: list[str], sha: str) -> dict:
    """A benchmark record as benchmarks/activation_locality.py writes it for `cmd`."""
    bench = runs.benchmark_module()
    settings = {k: v for k, v in vars(bench.parse_args(cmd[2:])).items() if k not in bench.PER_MODEL}
    return {"settings": json.loads(json.dumps(settings)),
            "models": [{"model": cmd[cmd.index("--model") + 1],
                        "predictors_provenance": {"sha256": sha}}]}


def write(path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def measured(args, shas: dict[str, str]) -> None:
    """Each predictors set's report and benchmark record in the results, as a finished step
    leaves them (no run directory: a new machine)."""
    plan = parts(args)
    for p in runs.lean_predictors(args.runs_dir / runs.LEAN_NAME / "export", args.lean_results, []):
        write(p.results / "predictors.json", report(p.cmd, shas[p.what]))
        write(p.results / "activation_locality.json",
              record(plan[f"benchmark, {p.what}"].cmd, shas[p.what]))


def made(p: runs.Predictors, content: bytes, cmd: list[str] | None = None) -> None:
    """p's predictors file with its report beside it, as the predictors command leaves them."""
    p.work.mkdir(parents=True, exist_ok=True)
    p.file.write_bytes(content)
    write(p.work / "predictors.json", report(cmd or p.cmd, hashlib.sha256(content).hexdigest()))


def test_on_a_new_machine_every_part_runs_in_order_with_the_documented_search(tmp_path):
    args = lean_args(tmp_path)
    plan = runs.lean_plan(args)
    assert [p.what for p in plan] == ORDER and all(p.todo for p in plan)
    export = args.runs_dir / "locality-drelu-s0" / "export"
    by = {p.what: p for p in plan}
    assert by["train"].cmd[2:] == ["experiment=locality", "model.ffn=drelu", "seed=0",
                                   "wandb.mode=disabled", "name=locality-drelu-s0",
                                   f"hydra.run.dir={export.parent}"]
    # the default predictors where the predictors step writes them, with its arguments
    assert by["default predictors"].cmd[1:] == [
        "-m", "studies.locality", "predictors", "--model", str(export), "--out",
        str(export / "locality"), "--threshold", "0.0"]
    # the search: the command docs/activation_locality.md gives, for this run directory
    docs = " ".join((ROOT / "docs" / "activation_locality.md").read_text().split())
    documented = shlex.split(re.search(r"The search's command: `(python -m studies\.locality "
                                       r"predictors [^`]*)`", docs).group(1))
    there = documented[documented.index("--model") + 1]
    assert [t.replace(str(export), there) for t in by["search"].cmd[1:]] == documented[1:]
    # the search's predictors into the results, the defaults into results/defaults
    for what, out, file in (("search", args.lean_results, export / "locality-search"),
                            ("default predictors", args.lean_results / "defaults",
                             export / "locality")):
        cmd = by[f"benchmark, {what}"].cmd
        assert cmd[1] == str(ROOT / "benchmarks" / "activation_locality.py")
        assert cmd[2:] == ["--out", str(out), "--model", str(export), "--predictors",
                           str(file / "predictors.safetensors"), "--repeats", "5",
                           "--skip-lm-eval", "--fresh"]
    assert len({p.log for p in plan}) == len(plan)  # a log each


def test_records_that_name_their_reports_hashes_leave_nothing_to_do(tmp_path):
    args = lean_args(tmp_path)
    measured(args, {"search": "a" * 64, "default predictors": "b" * 64})
    assert todo(args) == []
    said = []
    runs.lean(args, said.append)  # runs nothing, trains nothing
    assert len(said) == 1 and "lean: done" in said[0] and not args.runs_dir.exists()
    # the pipeline's dry run says the same
    run = subprocess.run([sys.executable, "-m", "studies.locality.runs", "--steps", "lean",
                          "--dry-run", "--runs-dir", str(args.runs_dir), "--lean-results",
                          str(args.lean_results)], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert [line.split(": ")[0] for line in run.stdout.splitlines()] == [f"done  {w}" for w in ORDER]


@pytest.mark.parametrize("change", ["other predictors measured", "other benchmark settings",
                                    "a search of other settings", "a report without a hash"])
def test_one_record_out_of_step_measures_both_again(tmp_path, change):
    """The pair is measured together: one record that does not match makes both benchmarks
    (and, with no model here, everything before them) run again."""
    args = lean_args(tmp_path)
    measured(args, {"search": "a" * 64, "default predictors": "b" * 64})
    defaults, search = runs.lean_predictors(args.runs_dir / runs.LEAN_NAME / "export",
                                           args.lean_results, [])
    if change == "other predictors measured":
        data = json.loads((defaults.results / "activation_locality.json").read_text())
        data["models"][0]["predictors_provenance"]["sha256"] = "c" * 64
        write(defaults.results / "activation_locality.json", data)
    elif change == "other benchmark settings":
        data = json.loads((search.results / "activation_locality.json").read_text())
        data["settings"]["repeats"] = 3
        write(search.results / "activation_locality.json", data)
    elif change == "a search of other settings":  # the report a search of one pair writes
        write(search.results / "predictors.json", report(
            [*search.cmd[:search.cmd.index("--hot") + 1], "0.03", "--recall", "0.85",
             *search.cmd[search.cmd.index("--out"):]], "a" * 64))
    else:
        write(defaults.results / "predictors.json", report(defaults.cmd, None))
    assert todo(args) == ORDER


def test_the_committed_records_are_done_and_one_without_its_hash_is_not(tmp_path):
    """The records the lean step committed (each beside its predictors' report) count as done,
    on any machine: a restart measures nothing again. A record without the predictors' hash
    (as the one made by hand before hashes were recorded) does not."""
    args = lean_args(tmp_path)
    committed = ROOT / "benchmarks" / "results" / "locality_lean_predictors"
    for sub in ("", "defaults"):
        (args.lean_results / sub).mkdir(parents=True, exist_ok=True)
        for name in ("activation_locality.json", "predictors.json"):
            shutil.copyfile(committed / sub / name, args.lean_results / sub / name)
    assert todo(args) == []
    record = json.loads((args.lean_results / "activation_locality.json").read_text())
    for model in record["models"]:
        model["predictors_provenance"] = None
    write(args.lean_results / "activation_locality.json", record)
    assert todo(args) == ORDER


def test_a_model_and_predictors_there_with_their_hashes_are_not_made_again(tmp_path):
    args = lean_args(tmp_path)
    export = args.runs_dir / runs.LEAN_NAME / "export"
    write(export / "config.json", {})
    write(export.parent / "summary.json", {})
    defaults, search = runs.lean_predictors(export, args.lean_results, [])
    made(defaults, b"default predictors")
    made(search, b"the search's predictors")
    assert todo(args) == ORDER[3:]  # only the benchmarks
    search.file.write_bytes(b"other predictors")  # a file its report does not name
    assert todo(args) == ORDER[2:]
    made(search, b"a search of one pair", [*search.cmd[:search.cmd.index("--hot") + 1], "0.1",
                                           *search.cmd[search.cmd.index("--recall"):]])
    assert todo(args) == ORDER[2:]
    (export.parent / "summary.json").unlink()  # an unfinished run: trained again
    assert todo(args) == ORDER


def test_a_search_that_chose_nothing_stops_the_step_naming_its_report(tmp_path):
    _, search = runs.lean_predictors(tmp_path / "export", tmp_path / "lean", [])
    write(search.work / "predictors.json", {})
    with pytest.raises(PipelineError, match="predictors.md"):
        runs.keep_reports(search)
    assert not (tmp_path / "lean" / "predictors.json").exists()


TINY = ["model.d_model=64", "model.n_heads=2", "model.n_layers=2", "data.seq_len=64",
        "data.batch_size=4", "trainer.max_steps=2", "trainer.val_every_n_steps=2",
        "trainer.checkpoint_every_n_steps=2", "trainer.limit_val_batches=2",
        "trainer.final_val_batches=2"]


def lean_step(tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "studies.locality.runs", "--steps", "lean",
         "--runs-dir", str(tmp_path / "runs"), "--results", str(tmp_path / "results"),
         "--lean-results", str(tmp_path / "lean"), "--overrides", *TINY,
         "--predictors-args", "--tokens 1024 --seq-len 64 --held-out-tokens 512 --steps 20 "
                              "--tolerance 1.0",
         "--benchmark-args=--quick"],
        capture_output=True, text=True, cwd=ROOT, timeout=1500)


@pytest.mark.slow
def test_the_lean_step_measures_both_predictor_sets_and_resumes(tmp_path):
    first = lean_step(tmp_path)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    at = first.stdout.index
    logs = [f"locality-drelu-s0{suffix}.log" for suffix in
            ("", "-lean-locality", "-lean-locality-search", "-lean-benchmark-locality-search",
             "-lean-benchmark-locality")]
    assert [at(log) for log in logs] == sorted(at(log) for log in logs)
    out = tmp_path / "lean"
    for results, work in ((out, "locality-search"), (out / "defaults", "locality")):
        made = json.loads((results / "predictors.json").read_text())["meta"]
        bench = json.loads((results / "activation_locality_quick.json").read_text())["models"][0]
        file = tmp_path / "runs" / "locality-drelu-s0" / "export" / work / "predictors.safetensors"
        assert bench["predictors"] == str(file)
        assert (bench["predictors_provenance"]["sha256"] == made["predictors_sha256"]
                == hashlib.sha256(file.read_bytes()).hexdigest())
        assert (results / "predictors.md").is_file()
    assert len(json.loads((out / "predictors.json").read_text())["tried"]) == 9
    assert json.loads((out / "runs" / "locality-drelu-s0.json").read_text())["ffn"] == "drelu"
    assert not (tmp_path / "results" / "runs").exists()  # issue 19's records untouched
    again = lean_step(tmp_path)
    assert again.returncode == 0 and " ... (log " not in again.stdout, again.stdout[-2000:]
    # a new machine: the records alone say it is done
    shutil.rmtree(tmp_path / "runs")
    fresh = lean_step(tmp_path)
    assert fresh.returncode == 0 and " ... (log " not in fresh.stdout, fresh.stdout[-2000:]


def test_the_docs_name_the_command_and_the_background_job_that_run_the_step():
    docs = " ".join((ROOT / "docs" / "activation_locality.md").read_text().split())
    assert ("one resumable command, `python -m studies.locality.runs --steps lean` (the job `lean` "
            "of `scripts/background.sh`)") in docs
    script = (ROOT / "scripts" / "background.sh").read_text()
    job = script[script.index("        lean)"):script.index(";;", script.index("        lean)"))]
    assert "-m studies.locality.runs --steps lean" in job
    # after the upcycling runs, in either default order (upcycling or study first)
    assert 'JOBS="upcycle lean ' in script and 'JOBS="study upcycle lean ' in script
