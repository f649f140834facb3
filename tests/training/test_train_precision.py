"""benchmarks/train_precision.py runs end to end: both precisions train the same init to the
same loss (bf16-mixed within bf16's rounding of fp32's), and the record names the speedup."""

from __future__ import annotations

import json
import subprocess
import sys

from support import ROOT


def test_the_precision_benchmark_records_both_precisions(tmp_path):
    run = subprocess.run([sys.executable, "benchmarks/train_precision.py", "--shapes", "quickstart",
                          "--rounds", "1", "--steps", "2", "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads((tmp_path / "train_precision.json").read_text())
    (row,) = record["table"]
    assert row["tokens_per_s_32-true"] > 0 and row["bf16_mixed_speedup"] > 0
    assert abs(row["final_loss_32-true"] - row["final_loss_bf16-mixed"]) < 0.02
    assert record["meta"]["git"]["sha"] and "native_bf16" in record["meta"]
    assert "| quickstart | 16 x 128 |" in (tmp_path / "train_precision.md").read_text()
    bad = subprocess.run([sys.executable, "benchmarks/train_precision.py", "--rounds", "0"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "--rounds" in bad.stderr and "Traceback" not in bad.stderr
