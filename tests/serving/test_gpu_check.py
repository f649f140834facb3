"""benchmarks/gpu_check.py, the prepared GPU run, works end to end: here on the CPU (its smoke
mode), so that the lent GPU machine's few minutes are not spent finding a broken script."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from support import ROOT


def test_the_gpu_check_runs_every_part_in_its_cpu_smoke_mode(tmp_path):
    run = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--quick",
                          "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check_quick.json").read_text())
    for part in ("checks", "attention_path", "decode", "variants", "serving", "training"):
        assert "error" not in report[part], (part, report[part])
    assert report["checks"]["passed"] and report["checks"]["greedy_equals_cpu"]
    assert report["checks"]["greedy_equals_cpu_by_engine"] == {
        "sdpa": True, "flex": True, "auto_compiled": True}
    assert report["attention_path"]["auto"] == "native"
    for engine, attention in (("auto", "native"), ("sdpa", "sdpa"), ("flex", "flex"),
                              ("auto_compiled", "native")):
        decoded = report["decode"][engine]
        assert decoded["attention"] == attention and decoded["by_batch"]["1"]["decode_tok_s"] > 0
    assert report["decode"]["auto_compiled"]["enforce_eager"] is False
    assert report["training"]["eager"]["tokens_per_s"] > 0
    variants = report["variants"]
    for name in ("original (GQA)", "mla d_c 24", "egmla-kv d_c 24", "egmla-latent d_c 24"):
        assert "error" not in variants[name] and variants[name]["by_batch"]["4"]["decode_tok_s"] > 0
        assert variants[name]["attention"] == "sdpa"
    # the converted caches are smaller than the original's: d_c + 3 RoPE keys against 2 n_kv d_h
    assert variants["mla d_c 24"]["kv_bytes_per_token"] < variants["original (GQA)"][
        "kv_bytes_per_token"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_gpu_check_without_a_gpu_says_so_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 2 and "CUDA is not available" in run.stderr
    assert "Traceback" not in run.stderr and not list(tmp_path.iterdir())


def test_the_gpu_check_runs_the_parts_asked_for_and_refuses_an_unknown_one(tmp_path):
    run = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--quick",
                          "--parts", "attention_path", "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "EGMLA_GIT_SHA": "0123abc"})
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check_quick.json").read_text())
    assert "attention_path" in report and "checks" not in report and "decode" not in report
    assert report["machine"]["git"] == "0123abc"
    bad = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu",
                          "--parts", "decode,warp", "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "unknown --parts warp" in bad.stderr
    assert "Traceback" not in bad.stderr
