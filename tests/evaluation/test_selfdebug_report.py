"""eval.selfdebug.report: pass@k against brute force, the bootstrap's coverage and pairing, a
hand-computed summary (early stopping, first visible pass kept), trace reading, files and CLI."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from eval.selfdebug import report
from eval.selfdebug.report import load_traces, pass_at_k, summarize, write_report
from eval.stats import bootstrap_ci
from support import ROOT

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---- pass@k ----------------------------------------------------------------------------------


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k),
                                                           abs=1e-12), (n, c, k)


def test_pass_at_k_known_values_and_errors():
    assert pass_at_k(10, 1, 1) == pytest.approx(0.1)
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 6, 5) == 1.0  # n - c < k
    assert pass_at_k(200, 3, 100) == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100))
    for n, c, k in [(5, 1, 6), (5, 1, 0), (5, 6, 1), (5, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


# ---- bootstrap -------------------------------------------------------------------------------


def test_bootstrap_ci_covers_the_true_mean():
    rng = np.random.default_rng(123)
    covered = 0
    for rep in range(200):
        low, high = bootstrap_ci(rng.random(100) < 0.3, n_boot=500, seed=rep)
        covered += low <= 0.3 <= high
    assert 0.88 <= covered / 200 <= 0.99


def test_bootstrap_ci_narrows_with_more_problems():
    rng = np.random.default_rng(0)
    few = bootstrap_ci(rng.random(20) < 0.5)
    many = bootstrap_ci(rng.random(2000) < 0.5)
    assert few[0] <= few[1] and many[0] <= many[1]
    assert (many[1] - many[0]) < (few[1] - few[0]) / 5


def test_bootstrap_ci_is_paired_across_columns():
    rng = np.random.default_rng(1)
    a = rng.random(50)
    values = np.column_stack([a, a + 0.1, (a + 0.1) - a])
    low, high = bootstrap_ci(values)
    assert low.shape == high.shape == (3,)
    assert high[0] - low[0] > 0.05
    # the same problems drawn for every column: a shifted column's CI is shifted exactly
    assert (low[1], high[1]) == pytest.approx((low[0] + 0.1, high[0] + 0.1))
    assert (low[2], high[2]) == pytest.approx((0.1, 0.1))
    assert bootstrap_ci(values, seed=5)[0] == pytest.approx(bootstrap_ci(values, seed=5)[0])
    with pytest.raises(ValueError):
        bootstrap_ci(np.array([]))


# ---- a hand-built evaluation -----------------------------------------------------------------


def rnd(visible: str, hidden: str, prompt: int, completion: int, *, cached: int = 0,
        sandbox: int = 2) -> dict:
    code = visible != "no_code"
    return {"prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached,
            "model_calls": 1, "code_found": code, "visible_status": visible,
            "hidden_status": hidden, "sandbox_runs": sandbox if code else 0,
            "sandbox_s": 0.5 if code else 0.0, "generate_s": 1.0}


def record(task: str, method: str, rounds: list[dict], final: int | None = None,
           sample: int = 0) -> dict:
    last = rounds[-1 if final is None else final]
    p = sum(r["prompt_tokens"] for r in rounds)
    c = sum(r["completion_tokens"] for r in rounds)
    for i, r in enumerate(rounds):
        r["round"] = i
    return {"task_id": task, "method": method, "sample": sample, "rounds": rounds,
            "visible_passed": last["visible_status"] == "passed",
            "hidden_passed": last["hidden_status"] == "passed",
            "prompt_tokens": p, "completion_tokens": c, "tokens": p + c, "wall_s": 2.0}


P, F = "passed", "failed"


def records() -> list[dict]:
    """Self-debug on A..E (stopping at a visible pass), resampling on A..D, sampling on A, B.

    Self-debug, tokens per round and what passes (visible/hidden):
      A: r0 F/F 120, r1 P/P 180               -> pass@1 by round F P P, tokens 120 300 300
      B: r0 P/P 90                            -> P P P, 90 90 90
      C: r0 no code 130, r1 F/P 150, r2 P/F 150 -> F P F, 130 280 430
      D: r0 F/F 150, r1 F/F 150, r2 P/P 150   -> F F P, 150 300 450
      E: r0 P/P 100                           -> P P P, 100 100 100
    Resampling (the first visible pass is the program kept):
      A: F/F 120, P/P 130        -> after 1, 2, 3 samples: F P P, tokens 120 250 250
      B: F/P 50, P/F 45          -> P F F (the first sample passes hidden, the kept one not),
                                    50 95 95
      C: no code 100, F/F 150, F/P 180 -> F F P (no visible pass: the latest), 100 250 430
      D: P/F 60, P/P 60          -> F F F (the first visible pass wins over a later one), 60 120 120
    """
    selfdebug = [
        record("A", "selfdebug", [rnd(F, F, 100, 20, cached=50), rnd(P, P, 150, 30, cached=100)]),
        record("B", "selfdebug", [rnd(P, P, 80, 10)]),
        record("C", "selfdebug", [rnd("no_code", "no_code", 90, 40), rnd(F, P, 120, 30),
                                  rnd(P, F, 130, 20)]),
        record("D", "selfdebug", [rnd(F, F, 100, 50), rnd("error", "error", 100, 50),
                                  rnd(P, P, 100, 50)]),
        record("E", "selfdebug", [rnd(P, P, 70, 30)]),
    ]
    resample = [
        record("A", "resample", [rnd(F, F, 100, 20), rnd(P, P, 100, 30)]),
        record("B", "resample", [rnd(F, P, 40, 10), rnd(P, F, 40, 5)]),
        record("C", "resample", [rnd("no_code", "no_code", 60, 40),
                                 rnd("timeout", "timeout", 100, 50), rnd(F, P, 100, 80)]),
        record("D", "resample", [rnd(P, F, 40, 20), rnd(P, P, 40, 20)], final=0),
    ]
    sample = ([record("A", "sample", [rnd(P if i == 0 else F, P if i == 0 else F, 10, 5)], sample=i)
               for i in range(5)]
              + [record("B", "sample", [rnd(F, P if i < 3 else F, 10, 5)], sample=i)
                 for i in range(6)])
    return selfdebug + resample + sample


def test_summarize_by_hand():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the records' hidden_passed agree with their rounds
        s = summarize(records(), n_boot=500)
    json.dumps(s, allow_nan=False)  # plain JSON types only

    assert s["counts"] == {
        "problems": 5, "records": {"selfdebug": 5, "resample": 4, "sample": 11},
        "problems_by_method": {"selfdebug": 5, "resample": 4, "sample": 2},
        "rounds": {"selfdebug": 10, "resample": 9, "sample": 11},
        "no_code_rounds": {"selfdebug": 1, "resample": 1, "sample": 0}}

    sd = s["selfdebug"]
    assert [r["round"] for r in sd["rounds"]] == [0, 1, 2]
    assert [r["pass_at_1"] for r in sd["rounds"]] == pytest.approx([2 / 5, 4 / 5, 4 / 5])
    assert [r["tokens"] for r in sd["rounds"]] == pytest.approx(
        [(120 + 90 + 130 + 150 + 100) / 5, (300 + 90 + 280 + 300 + 100) / 5,
         (300 + 90 + 430 + 450 + 100) / 5])
    assert [r["model_calls"] for r in sd["rounds"]] == pytest.approx([1, 8 / 5, 10 / 5])
    assert [r["sandbox_runs"] for r in sd["rounds"]] == pytest.approx([8 / 5, 14 / 5, 18 / 5])
    assert [r["running"] for r in sd["rounds"]] == [5, 3, 2]
    for r in sd["rounds"]:
        assert 0 <= r["ci"][0] <= r["pass_at_1"] <= r["ci"][1] <= 1
    assert sd["final_pass_rate"] == pytest.approx(4 / 5)
    totals = sd["totals"]
    assert totals["tokens"] == 1370 and totals["rounds"] == 10
    assert totals["prompt_tokens"] + totals["completion_tokens"] == 1370
    assert totals["cached_tokens"] == 150 and totals["sandbox_runs"] == 18
    assert totals["model_calls"] == 10 and totals["generate_s"] == pytest.approx(10.0)
    assert totals["sandbox_s"] == pytest.approx(4.5)

    rs = s["resample"]
    assert [r["samples"] for r in rs["samples"]] == [1, 2, 3]
    assert [r["pass_rate"] for r in rs["samples"]] == pytest.approx([1 / 4, 1 / 4, 2 / 4])
    assert [r["tokens"] for r in rs["samples"]] == pytest.approx(
        [(120 + 50 + 100 + 60) / 4, (250 + 95 + 250 + 120) / 4, (250 + 95 + 430 + 120) / 4])
    assert rs["final_pass_rate"] == pytest.approx(0.5)

    eb = s["equal_budget"]
    assert eb["problems"] == 4  # E has no resampling record
    assert eb["selfdebug_pass_rate"] == pytest.approx(3 / 4)  # A, B, D
    assert eb["resample_pass_rate"] == pytest.approx(2 / 4)  # A, C
    assert eb["difference"] == pytest.approx(1 / 4)
    assert eb["difference_ci"][0] <= 0.25 <= eb["difference_ci"][1]
    assert -1 <= eb["difference_ci"][0] < 0 < eb["difference_ci"][1] <= 1  # 4 problems: wide
    assert eb["selfdebug_mean_tokens"] == pytest.approx((300 + 90 + 430 + 450) / 4)
    assert eb["resample_mean_tokens"] == pytest.approx((250 + 95 + 430 + 120) / 4)

    sm = s["sampling"]
    assert (sm["problems"], sm["n_min"], sm["n_max"], sm["correct"]) == (2, 5, 6, 4)
    assert [r["k"] for r in sm["pass_at_k"]] == [1, 2, 5]
    # A: n=5, c=1; B: n=6, c=3
    assert [r["value"] for r in sm["pass_at_k"]] == pytest.approx(
        [(1 / 5 + 3 / 6) / 2, ((1 - 6 / 10) + (1 - 3 / 15)) / 2, 1.0])


def test_summarize_sections_follow_the_methods_present():
    only_selfdebug = [r for r in records() if r["method"] == "selfdebug"]
    s = summarize(only_selfdebug, n_boot=100)
    assert "selfdebug" in s and not {"resample", "equal_budget", "sampling"} & set(s)
    with pytest.raises(ValueError, match="no trace records"):
        summarize([])
    with pytest.raises(ValueError, match="twice"):
        summarize(only_selfdebug + only_selfdebug[:1])
    with pytest.raises(ValueError, match="method"):
        summarize([{**only_selfdebug[0], "method": "other"}])


def test_summarize_warns_when_hidden_passed_disagrees_with_the_rounds():
    bad = [{**records()[0], "hidden_passed": False}]  # A's self-debug ends hidden-passing
    with pytest.warns(UserWarning, match="disagrees"):
        summarize(bad, n_boot=10)


# ---- reading traces --------------------------------------------------------------------------


def write_jsonl(path: Path, recs: list[dict], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + tail)
    return path


def test_load_traces_round_trip_and_truncated_last_line(tmp_path):
    recs = records()
    assert load_traces(write_jsonl(tmp_path / "ok.jsonl", recs)) == recs
    truncated = write_jsonl(tmp_path / "cut.jsonl", recs, tail=json.dumps(recs[0])[:40])
    with pytest.warns(UserWarning, match=f"line {len(recs) + 1}"):
        assert load_traces(truncated) == recs


def test_load_traces_rejects_a_corrupt_middle_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps(r) for r in records()[:3]]
    lines[1] = lines[1][:30]
    path.write_text("\n".join(lines) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"bad\.jsonl: line 2"):
            load_traces(path)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_traces(tmp_path / "missing.jsonl")


# ---- files and command line ------------------------------------------------------------------


def test_write_report(tmp_path):
    paths = write_report(records(), tmp_path / "out", meta={"run": "unit"}, n_boot=200)
    assert set(paths) == {"json", "md", "png"}
    assert paths["png"].read_bytes().startswith(PNG_SIGNATURE)
    saved = json.loads(paths["json"].read_text())
    assert saved["meta"]["run"] == "unit" and saved["meta"]["provenance"]["git"]
    assert saved["selfdebug"]["final_pass_rate"] == pytest.approx(4 / 5)
    md = paths["md"].read_text()
    for heading in ("## Self-debug", "## Resampling", "## Equal budget", "## Sampling: pass@k"):
        assert heading in md
    assert "| round | pass@1 |" in md and "| samples | pass rate |" in md
    assert "self-debug − resampling | +0.250" in md
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        ["summary.json", "summary.md", "passrate_vs_tokens.png"])  # no temporary files left


def test_plot_writes_a_png_even_without_curves(tmp_path):
    only_samples = [r for r in records() if r["method"] == "sample"]
    path = report.plot(summarize(only_samples, n_boot=10), tmp_path / "p.png")
    assert path.read_bytes().startswith(PNG_SIGNATURE)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eval.selfdebug.report", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)


def test_cli(tmp_path):
    traces = write_jsonl(tmp_path / "traces.jsonl", records(), tail='{"task_id": "A", "meth')
    done = run_cli(str(traces), "--bootstrap", "300", "--seed", "3")
    assert done.returncode == 0, done.stderr
    assert "# Self-debugging evaluation" in done.stdout and "| round | pass@1 |" in done.stdout
    assert "warning:" in done.stderr and f"line {len(records()) + 1}" in done.stderr
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["bootstrap"] == {"n_boot": 300, "seed": 3, "level": 0.95}
    assert saved["meta"]["traces"] == str(traces.resolve())
    assert (tmp_path / "passrate_vs_tokens.png").read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.parametrize("content", [None, "", "{\"bad\n" + json.dumps(records()[0]) + "\n"],
                         ids=["missing", "empty", "corrupt-middle"])
def test_cli_bad_input_exits_2_writing_nothing(tmp_path, content):
    traces = tmp_path / "traces.jsonl"
    if content is not None:
        traces.write_text(content)
    out = tmp_path / "out"
    done = run_cli(str(traces), "--out", str(out))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "traces.jsonl" in lines[0]
    assert done.stdout == "" and not out.exists()
