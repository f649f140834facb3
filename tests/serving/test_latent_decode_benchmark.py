"""benchmarks/latent_decode.py runs end to end (a quick cell) and its JSON agrees with itself:
each row's roofline ratio and paired native/pytorch ratio follow from its own measurements."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

from support import ROOT


@pytest.mark.slow
def test_the_latent_decode_benchmark_writes_consistent_rows(tmp_path):
    run = subprocess.run([sys.executable, "benchmarks/latent_decode.py", "--quick", "--variants",
                          "mla", "egmla-kv", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "latent_decode_quick.json").read_text())
    assert report["meta"]["git"]["sha"] and report["machine"]["before"]["read_gb_s"] > 0
    rows = {(r["variant"], r["path"]): r for r in report["rows"]}
    assert set(rows) == {("mla", "native"), ("mla", "pytorch"), ("egmla-kv", "native"),
                         ("egmla-kv", "pytorch"), ("egmla-kv", "pytorch-rebuild")}
    machine = report["machine"]
    best = {k: max(machine["before"][k], machine["after"][k]) for k in ("read_gb_s", "fma_gmac_s")}
    assert machine["roofline"] == best  # the better measurement of each rate
    for r in rows.values():
        assert r["context"] == 1024 and r["batch"] == 1 and len(r["runs_s"]) == 2
        assert r["roofline_s"] == pytest.approx(max(r["bytes"] / (best["read_gb_s"] * 1e9),
                                                    r["macs"] / (best["fma_gmac_s"] * 1e9)))
        assert r["median_s"] == pytest.approx(statistics.median(r["runs_s"]))
        assert r["time_over_roofline"] == pytest.approx(r["median_s"] / r["roofline_s"])
    for variant in ("mla", "egmla-kv"):
        native, pytorch = rows[variant, "native"], rows[variant, "pytorch"]
        paired = [n / p for n, p in zip(native["runs_s"], pytorch["runs_s"])]
        assert native["native_over_pytorch"] == pytest.approx(statistics.median(paired))
    # the rebuild and the absorbed form have one roofline: the cheaper computation's
    assert rows["egmla-kv", "pytorch-rebuild"]["roofline_s"] == rows["egmla-kv", "native"]["roofline_s"]
    assert "| mla | 1 | 1024 | native |" in (tmp_path / "latent_decode_quick.md").read_text()
