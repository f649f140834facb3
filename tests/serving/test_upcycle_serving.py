"""benchmarks/upcycle_serving.py end to end on a quick budget: a converted EG-MLA export beside
the original, the capacity each budget holds (the bytes the engine allocates), and each decode
speed as the per-repeat ratio to the original's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support import ROOT


@pytest.mark.slow
def test_the_serving_benchmark_records_capacity_and_paired_speed(tmp_path):
    export = tmp_path / "eg24"
    convert = subprocess.run(
        [sys.executable, "-m", "egmla.upcycle", "--model", "SmolLM2-135M-Instruct", "--to", "egmla",
         "--gate-position", "kv", "--d-c", "24", "--rule", "high", "--svd", "plain",
         "--calibration-tokens", "0", "--out", str(export)],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert convert.returncode == 0, convert.stderr[-2000:]
    run = subprocess.run(
        [sys.executable, "benchmarks/upcycle_serving.py", "--quick", "--repeats", "2",
         "--model", f"eg24={export}", "--out", str(tmp_path / "results")],
        capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads((tmp_path / "results" / "serving_quick.json").read_text())
    rows = {r["model"]: r for r in record["rows"]}
    original, eg = rows["original"], rows["eg24"]
    assert eg["kv_elements_per_token"] == 30 * (24 + 3 * 8) == 1440  # latent + RoPE keys, 30 layers
    assert original["kv_elements_per_token"] == 30 * 2 * 3 * 64
    assert eg["fit_sequences"] > original["fit_sequences"]  # the smaller cache holds more
    for key in ("at_fit", "at_common"):
        own = original[key]["ratio_to_original"]
        assert own["ratios"] == [1.0, 1.0] and own["n"] == 2
        theirs = eg[key]["ratio_to_original"]
        expected = [a / b for a, b in zip(eg[key]["decode_tokens_per_s"],
                                          original[key]["decode_tokens_per_s"])]
        assert theirs["ratios"] == pytest.approx(expected)
    assert eg["at_common"]["concurrency"] == original["at_fit"]["concurrency"]
    # every timed step had all sequences decoding: left enough tokens to generate for that
    n = eg["at_fit"]["concurrency"]
    assert 256 - eg["at_fit"]["prompt_tokens"] >= -(-n * 256 // 2048) + n + 2 * 3
    assert all(t > 0 for r in rows.values() for k in ("at_fit", "at_common")
               for t in r[k]["decode_tokens_per_s"])
    table = (tmp_path / "results" / "serving_quick.md").read_text()
    assert "| eg24 | 1,440 |" in table and "| original | 11,520 |" in table
    assert record["meta"]["git"]["sha"] and record["meta"]["hardware"]["cpu"]
    import hashlib

    identity = record["meta"]["exports"]["eg24"]  # what was measured, by hash and conversion
    assert identity["sha256"] == hashlib.sha256(
        (export / "model.safetensors").read_bytes()).hexdigest()
    assert identity["conversion"]["rule"] == "high" and identity["conversion"]["d_c"] == 24
