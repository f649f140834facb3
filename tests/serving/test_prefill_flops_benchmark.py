"""benchmarks/prefill_flops.py runs end to end (its quick form) and its rows follow from their
own measurements: the MACs counted from the model, achieved = MACs / time, and the fraction of
the GEMM peak measured in the same run."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

from support import ROOT


@pytest.mark.slow
def test_the_prefill_benchmark_writes_consistent_rows(tmp_path):
    run = subprocess.run([sys.executable, "benchmarks/prefill_flops.py", "--quick", "--out",
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "prefill_flops_quick.json").read_text())
    assert report["meta"]["git"]["sha"]
    (row,) = report["rows"]
    assert row["dtype"] == "float32" and row["tokens"] == 64 and len(row["runs_s"]) == 1
    # SmolLM2-135M: 30 blocks of 3.54M linear weights, 9 heads of 64, a 49,152 x 576 LM head
    linear, attention, head = 30 * 3_538_944 * 64, 30 * 9 * 64 * 64 * 65, 49152 * 576
    assert row["macs"] == linear + attention + head
    assert row["median_s"] == pytest.approx(statistics.median(row["runs_s"]))
    assert row["achieved_gmac_s"] == pytest.approx(row["macs"] / row["median_s"] / 1e9)
    peak = max(report["gemm_peak_runs_gmac_s"]["float32"])
    assert row["fraction_of_peak"] == pytest.approx(row["achieved_gmac_s"] / peak)
    assert "| float32 | 64 |" in (tmp_path / "prefill_flops_quick.md").read_text()
