"""benchmarks/train_precision.py runs end to end: both precisions train the same init to the
same loss (bf16-mixed within bf16's rounding of fp32's), and the record names the speedup."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT


@pytest.mark.slow  # about 80 s on 2 cores: Lightning runs in both precisions
def test_the_precision_benchmark_records_both_precisions(tmp_path):
    run = subprocess.run([sys.executable, "benchmarks/train_precision.py", "--shapes", "quickstart",
                          "--rounds", "1", "--steps", "2", "--batch", "4", "--seq-len", "32",
                          "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads((tmp_path / "train_precision.json").read_text())
    (row,) = record["table"]
    assert row["tokens_per_s_32-true"] > 0 and row["bf16_mixed_speedup"] > 0
    assert abs(row["final_loss_32-true"] - row["final_loss_bf16-mixed"]) < 0.02
    assert record["meta"]["git"]["sha"] and "native_bf16" in record["meta"]
    assert (row["batch"], row["seq_len"]) == (4, 32)
    assert "| quickstart | 4 x 32 |" in (tmp_path / "train_precision.md").read_text()
    refused = {("--rounds", "0"): "--rounds", ("--shapes", "quickstart", "--seq-len", "129"): "--seq-len 129",
               ("--batch", "0"): "--batch 0"}
    for args, named in refused.items():
        bad = subprocess.run([sys.executable, "benchmarks/train_precision.py", *args],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert bad.returncode == 2 and named in bad.stderr and "Traceback" not in bad.stderr


def _cpu_flags() -> set[str]:
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def test_auto_precision_is_bf16_exactly_where_the_cpu_has_native_bf16():
    from egmla.devices import native_bf16, slow_precision_note, training_precision

    native = bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})  # read here, not through egmla
    assert native_bf16() == native
    assert training_precision("auto", "cpu") == ("bf16-mixed" if native else "32-true")
    for given in ("32-true", "bf16-mixed", "16-mixed"):
        assert training_precision(given, "cpu") == given  # anything else passes through
    assert slow_precision_note("32-true", "cpu") is None
    assert slow_precision_note(training_precision("auto", "cpu"), "cpu") is None  # never warns
    note = slow_precision_note("bf16-mixed", "cpu")
    assert (note is None) == native
    if note:
        assert "trainer.precision=bf16-mixed" in note and "trainer.precision=auto" in note
    assert slow_precision_note("bf16-mixed", "gpu") is None  # a GPU's bf16 is its own question


@pytest.mark.slow
def test_a_run_records_the_precision_it_trained_in_and_warns_of_slow_bf16(tmp_path):
    """`trainer.precision=auto` resolves on this machine and each start records the result; an
    explicit bf16-mixed on a CPU without native bf16 trains, with one warning at its start."""
    from egmla.devices import native_bf16
    from support.training import TINY, run_train

    expected = "bf16-mixed" if native_bf16() else "32-true"
    for precision, resolved in (("auto", expected), ("bf16-mixed", "bf16-mixed")):
        run_dir = tmp_path / precision
        result = run_train([*TINY, "trainer.max_steps=2", "trainer.val_every_n_steps=2",
                            f"trainer.precision={precision}", "trainer.final_val_batches=1",
                            f"hydra.run.dir={run_dir}"])
        assert result.returncode == 0, result.stderr[-3000:]
        (start,) = json.loads((run_dir / "run_info.json").read_text())["starts"]
        assert start["precision"] == resolved
        config = json.loads((run_dir / "config.json").read_text())
        assert config["trainer"]["precision"] == precision  # the config keeps what was asked
        warned = "without native bf16" in result.stderr
        assert warned == (precision == "bf16-mixed" and not native_bf16()), result.stderr[-2000:]
