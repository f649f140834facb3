"""benchmarks/quant_quality.py runs end to end (one window per domain) and its figures agree
with its own per-window record."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from support import ROOT


@pytest.mark.slow
def test_the_quality_benchmark_writes_consistent_figures(tmp_path):
    run = subprocess.run([sys.executable, "benchmarks/quant_quality.py", "--windows", "2",
                          "--quantization", "q8_0", "gguf", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "quant_quality.json").read_text())
    assert report["meta"]["git"]["sha"] and report["config"]["quantization"] == ["q8_0", "gguf"]
    for method, domain in [(m, d) for m in ("q8_0", "gguf") for d in ("recovery", "corpus")]:
        r = report["methods"][method][domain]
        windows = r["per_window"]
        diffs = [q - f for q, f in zip(windows["quantized"], windows["float32"])]
        assert len(diffs) == 2 and r["tokens_scored"] == 2 * 512
        assert r["loss_difference"]["mean"] == pytest.approx(sum(diffs) / 2)
        assert r["ppl_ratio"] == pytest.approx(math.exp(sum(diffs) / 2))
        assert all(k >= 0 for k in windows["kl"])  # a KL divergence
        # a small change, not a broken model (gguf's layers are the reference's own weights:
        # only the activations' quantization and the 8-bit head differ)
        assert abs(r["ppl_ratio"] - 1) < 0.05
    assert "| gguf | corpus |" in (tmp_path / "quant_quality.md").read_text()
