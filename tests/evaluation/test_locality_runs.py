"""The issue-19 pipeline (studies/locality/runs.py) rehearsed end to end on tiny models: every run
trains and is recorded, the loss table compares each activation with SwiGLU, each seed-0 model
is profiled, gets predictors and is benchmarked as soon as it is trained; a second invocation
redoes nothing, and one on a new machine (run directories gone) rebuilds the losses from the
records alone."""

from __future__ import annotations

import json
import statistics
import shutil
import subprocess
import sys

import pytest

from studies.locality import runs as locality_runs
from support import ROOT

TINY = ["model.d_model=64", "model.n_heads=2", "model.n_layers=2", "data.seq_len=64",
        "data.batch_size=4", "trainer.max_steps=2", "trainer.val_every_n_steps=2",
        "trainer.checkpoint_every_n_steps=2", "trainer.limit_val_batches=2",
        "trainer.final_val_batches=2"]


def pipeline(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "studies.locality.runs", "--runs-dir", str(tmp_path / "runs"),
         "--results", str(tmp_path / "results"), "--no-smollm2", "--overrides", *TINY,
         "--profile-args", "--tokens 1024 --seq-len 64",
         "--predictors-args", "--tokens 1024 --seq-len 64 --held-out-tokens 512 --ranks 8 "
                              "--steps 20 --tolerance 1.0",
         "--benchmark-args", "--quick --skip-lm-eval", *extra],
        capture_output=True, text=True, cwd=ROOT, timeout=1500)


@pytest.mark.slow
def test_the_pipeline_runs_records_and_resumes(tmp_path):
    first = pipeline(tmp_path)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    # model by model, the acceptance model (drelu) first: it is benchmarked before the next
    # model trains, and no benchmark waits for the extra seeds, which only the loss table needs
    at = first.stdout.index
    assert at("locality-drelu-s0-benchmark.log") < at("locality-swiglu-s0.log")
    assert at("locality-relu2-s0-benchmark.log") < at("locality-swiglu-s1.log")
    results = tmp_path / "results"
    records = {p.stem: json.loads(p.read_text()) for p in (results / "runs").glob("*.json")}
    assert set(records) == {locality_runs.run_name(f, s) for f, s in locality_runs.RUNS}
    assert {r["tokens"] for r in records.values()} == {2 * 4 * 64}
    params = {r["ffn"]: r["params"] for r in records.values()}
    # equal parameters: relu2 (no gate) at 1.5x the width holds what the gated ones hold
    assert params["relu2"] == params["swiglu"] == params["drelu"] == params["reglu"]
    losses = json.loads((results / "losses.json").read_text())["rows"]
    by_ffn = {row["ffn"]: row for row in losses}
    assert by_ffn["swiglu"]["val_loss"]["n"] == by_ffn["drelu"]["val_loss"]["n"] == 3
    assert by_ffn["drelu"]["vs_swiglu"] == pytest.approx(
        by_ffn["drelu"]["val_loss"]["mean"] - by_ffn["swiglu"]["val_loss"]["mean"])
    for ffn in ("swiglu", "reglu", "drelu", "relu2"):
        for report in ("profile.json", "predictors.json"):
            assert (results / f"locality-{ffn}-s0" / report).is_file(), (ffn, report)
    bench = json.loads((results / "activation_locality_quick.json").read_text())
    assert [m["ffn"] for m in bench["models"]] == ["drelu", "swiglu", "reglu", "relu2"]
    assert any("speedup" in key for m in bench["models"] for r in m["speed"] for key in r)
    # SwiGLU at per-layer thresholds calibrated for the target sparsity, the others at zeros
    swiglu = next(m for m in bench["models"] if m["ffn"] == "swiglu")
    assert swiglu["sparsity"] == locality_runs.SWIGLU_SPARSITY and len(swiglu["threshold"]) == 2
    assert {m["threshold"] for m in bench["models"] if m["ffn"] != "swiglu"} == {0.0}
    # again: nothing is redone
    again = pipeline(tmp_path)
    assert again.returncode == 0 and " ... (log " not in again.stdout, again.stdout[-2000:]
    # a report made at another setting is made again, and only it
    stale = results / "locality-swiglu-s0" / "profile.json"
    report = json.loads(stale.read_text())
    report["meta"]["config"]["sparsity"] = None
    stale.write_text(json.dumps(report))
    redo = pipeline(tmp_path, "--steps", "profile")
    assert redo.returncode == 0, redo.stdout[-2000:] + redo.stderr[-2000:]
    assert redo.stdout.count(" ... (log ") == 1 and "locality-swiglu-s0-profile.log" in redo.stdout
    # a new machine: the run directories are gone, the records stay; the losses need no model
    shutil.rmtree(tmp_path / "runs")
    fresh = pipeline(tmp_path, "--steps", "losses")
    assert fresh.returncode == 0 and " ... (log " not in fresh.stdout, fresh.stdout[-2000:]
    assert json.loads((results / "losses.json").read_text())["rows"] == losses


def test_bad_arguments_are_one_clear_line():
    run = subprocess.run([sys.executable, "-m", "studies.locality.runs", "--steps", "fly"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 2 and "'fly'" in run.stderr and "Traceback" not in run.stderr


def test_the_loss_table_gives_each_activations_difference_from_swiglu_with_welchs_interval(
        tmp_path):
    """Three seeds each, unpaired: the difference of means and its interval are scipy's Welch
    test's; paired by seed, scipy's paired test's; one seed gives the mean and no interval;
    SwiGLU itself has no difference row."""
    from scipy.stats import ttest_ind, ttest_rel

    swiglu, drelu = [3.843, 3.851, 3.839], [3.734, 3.722, 3.741]
    records = ([{"ffn": "swiglu", "seed": s, "val_loss": v} for s, v in enumerate(swiglu)]
               + [{"ffn": "drelu", "seed": s, "val_loss": v} for s, v in enumerate(drelu)]
               + [{"ffn": "relu2", "seed": 0, "val_loss": 3.692}])
    rows = {r["ffn"]: r for r in locality_runs.losses(records, tmp_path)["rows"]}
    welch = ttest_ind(drelu, swiglu, equal_var=False).confidence_interval(0.95)
    d = rows["drelu"]["vs_swiglu_interval"]
    assert d["diff"] == pytest.approx(sum(drelu) / 3 - sum(swiglu) / 3)
    assert (d["low"], d["high"]) == pytest.approx((welch.low, welch.high))
    assert rows["drelu"]["val_loss"]["n"] == 3 and rows["drelu"]["val_loss"]["low"] is not None
    paired = ttest_rel(drelu, swiglu).confidence_interval(0.95)
    p = rows["drelu"]["vs_swiglu_paired"]
    assert p["n"] == 3 and (p["low"], p["high"]) == pytest.approx((paired.low, paired.high))
    assert (p["high"] - p["low"]) != pytest.approx(d["high"] - d["low"])  # not Welch's again
    assert rows["relu2"]["vs_swiglu_interval"]["low"] is None
    assert rows["relu2"]["vs_swiglu"] == pytest.approx(3.692 - sum(swiglu) / 3)
    assert rows["swiglu"]["vs_swiglu_interval"] is None
    md = (tmp_path / "losses.md").read_text()
    assert f"[{welch.low:+.4f}, {welch.high:+.4f}]" in md
    assert f"[{paired.low:+.4f}, {paired.high:+.4f}] (3 seeds)" in md
    assert json.loads((tmp_path / "losses.json").read_text())["rows"][1]["ffn"] == "drelu"


def test_the_docs_give_the_committed_records_figures():
    """docs/activation_locality.md (and the README) state the loss table and the acceptance
    figures as the committed records hold them: every row of losses.md, and drelu's batch-1
    speedups (the median of the per-repeat paired ratios, and each ratio) and perplexity
    (default predictors; the leaner ones) at the precision given."""
    docs = (ROOT / "docs" / "activation_locality.md").read_text()
    results = ROOT / "benchmarks" / "results"
    table = [line for line in (results / "locality" / "losses.md").read_text().splitlines()
             if line.startswith("| ") and "---" not in line]
    assert len(table) == 5  # the header and the four activations
    for line in table:
        assert line in docs, line
    # "drelu is at most 0.026 nats (0.7%) worse than SwiGLU" (the paired interval's upper end),
    # and the README's "no measurable loss": the interval does not lie above zero
    rows = json.loads((results / "locality" / "losses.json").read_text())["rows"]
    drelu = next(r for r in rows if r["ffn"] == "drelu")["vs_swiglu_paired"]
    swiglu = next(r for r in rows if r["ffn"] == "swiglu")["val_loss"]["mean"]
    flat = " ".join(docs.split())
    assert (f"drelu is at most {drelu['high']:.3f} nats ({100 * drelu['high'] / swiglu:.1f}%) "
            "worse than SwiGLU") in flat
    assert drelu["low"] <= 0
    readme_flat = " ".join((ROOT / "README.md").read_text().split())
    assert (f"No loss difference between dReLU and SwiGLU is detected (3 seeds each; the interval "
            f"allows dReLU up to {100 * drelu['high'] / swiglu:.1f}% worse)") in readme_flat

    def batch1(record, mode):
        """The mode's per-repeat paired ratios to dense at batch 1, their median, and its
        perplexity increase (%)."""
        model = next(m for m in json.loads(record.read_text())["models"]
                     if m["ffn"] == "drelu")
        runs = {s["mode"]: s["runs"] for s in model["speed"] if s["batch"] == 1}
        ratios = [a / b for a, b in zip(runs[mode], runs["dense"])]
        quality = next(q for q in model["quality"] if q["mode"] == mode)
        return statistics.median(ratios), ratios, 100 * quality["perplexity_increase"]

    default = batch1(results / "locality" / "activation_locality.json", "predicted")
    lean = batch1(results / "locality_lean_predictors" / "activation_locality.json",
                  "predicted")
    # the default predictors measured right after the searched ones (the lean step)
    beside = batch1(results / "locality_lean_predictors" / "defaults" / "activation_locality.json",
                    "predicted")
    each = [f"{r:.2f}" for r in default[1]]
    assert (f"paired per repeat {', '.join(each[:-1])} and {each[-1]}, median "
            f"**{default[0]:.2f}x**, with held-out perplexity {default[2]:+.2f}%") in flat
    assert (f"is **{lean[0]:.2f}x** dense by the median of the per-repeat paired ratios "
            f"({', '.join(f'{r:.2f}' for r in lean[1])}: every repeat above 1.5x") in flat
    assert f"held-out perplexity **{lean[2]:+.2f}%**" in docs
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (f"predicted decoding is {lean[0]:.2f}x dense at batch 1 (the median of {len(lean[1])} "
            f"paired repeats, each above 1.5x) at {lean[2]:+.2f}% perplexity") in readme
    assert (f"{beside[0]:.2f}x with the default predictors ({len(beside[1])} repeats, measured "
            f"right after, {sum(r > 1.5 for r in beside[1])} of them above 1.5x)") in readme
    assert (f"measured right after: {beside[0]:.2f}x at batch 1 "
            f"({', '.join(f'{r:.2f}' for r in beside[1])})") in flat
    assert f"perplexity {beside[2]:+.2f}%. The dense decode" in flat
    assert lean[0] >= 1.5 and min(lean[1]) > 1.5 and lean[2] < 1.0  # the acceptance, as recorded


def test_a_corrupt_record_is_named_and_nothing_is_trained(tmp_path, capsys):
    """A record the pipeline cannot read is not taken for a missing one (which would train the
    run again and write over it): it stops, naming the file, which stays as it was."""
    results, runs_dir = tmp_path / "results", tmp_path / "runs"
    (results / "runs").mkdir(parents=True)
    for ffn, seed in locality_runs.RUNS:
        (results / "runs" / f"{locality_runs.run_name(ffn, seed)}.json").write_text('{"name": ')
    first = results / "runs" / f"{locality_runs.run_name(*locality_runs.RUNS[0])}.json"
    assert locality_runs.main(["--steps", "losses", "--runs-dir", str(runs_dir),
                               "--results", str(results)]) == 1
    err = capsys.readouterr().err
    assert f"{first}: not valid JSON" in err and "Traceback" not in err
    assert first.read_text() == '{"name": ' and not runs_dir.exists()
