"""benchmarks/decode_speed.py --baseline-tree: each of our systems also runs from another
checkout, interleaved, and the report pairs the two repeat by repeat."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support import ROOT

SCRIPT = ROOT / "benchmarks" / "decode_speed.py"


def test_a_directory_that_is_not_a_checkout_is_refused_naming_it(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--baseline-tree", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert f"--baseline-tree {tmp_path}: no benchmarks/decode_speed.py" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.slow
def test_the_checkout_against_itself_pairs_every_cell_with_the_same_tokens(tmp_path):
    """A/A: the baseline is this checkout, started first; the greedy tokens of the two workers
    agree, and every cell has one paired ratio per repeat."""
    run = subprocess.run([sys.executable, str(SCRIPT), "--systems", "ours-fp32",
                          "--prompt-lens", "8", "--new-tokens", "16", "--batch-sizes",
                          "--repeats", "2", "--baseline-tree", str(ROOT), "--baseline-first",
                          "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stdout.index("loading ours-fp32@baseline") < run.stdout.index("loading ours-fp32 ")
    report = json.loads((tmp_path / "decode_speed.json").read_text())
    assert set(report["systems"]) == {"ours-fp32", "ours-fp32@baseline"}
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert report["baseline"]["git"]["sha"] == head
    paired = report["baseline"]["paired"]
    assert [(r["system"], r["prompt_len"], r["new_tokens"]) for r in paired] == [
        ("ours-fp32", 8, 16)]
    row = paired[0]
    assert row["same_tokens"] == 16
    singles = {r["system"]: r["decode_tok_s"]["runs"] for r in report["single_stream"]}
    expected = [a / b for a, b in zip(singles["ours-fp32"], singles["ours-fp32@baseline"])]
    assert row["ratio"]["runs"] == pytest.approx(expected) and len(expected) == 2
    assert "## Against the baseline checkout" in (tmp_path / "decode_speed.md").read_text()
