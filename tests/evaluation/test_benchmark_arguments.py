"""Bad input to a benchmark script fails at once, before any model loads or training starts:
exit 2, one line naming the bad value or option, no traceback, and nothing left behind (the
case's directory, where its --out points, is as it was). Every case is a real command line;
they run side by side (a process each, most of its time importing torch) to keep this short."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from support import ROOT


def _traces_without_task_id(d: Path) -> None:
    for run in ("a", "b"):
        (d / run).mkdir()
        (d / run / "traces.jsonl").write_text(json.dumps({"method": "selfdebug", "sample": 0}) + "\n")
        (d / run / "config.json").write_text(json.dumps({"backend": "local"}))


SETUP = {
    "partial": lambda d: (d / "out").mkdir() or (d / "out" / "decode_cost.partial.json").write_text("[1, 2]"),
    "junk": lambda d: (d / "predictors.safetensors").write_bytes(b"not safetensors"),
    "traces": _traces_without_task_id,
}

# id: (script, arguments ({d}: the case's directory), what stderr must name, setup or None)
CASES = {
    "stop-strings-huge": ("stop_strings", "--stop-strings 1000000000000 --output-dir {d}/out",
                          ["--stop-strings", "1000000000000"], None),
    "stop-length-huge": ("stop_strings", "--stop-length 100000 --output-dir {d}/out",
                         ["--stop-length", "100000"], None),
    "stop-seed": ("stop_strings", "--seed 100000000000000000000000 --output-dir {d}/out",
                  ["--seed", "100000000000000000000000"], None),
    "decode-speed-prompt": ("decode_speed", "--prompt-lens 1000000000000 --out {d}/out",
                            ["--prompt-lens", "1000000000000"], None),
    "variants-steps": ("train_variants", "--steps -1 --out {d}/out", ["--steps", "-1"], None),
    "variants-seed": ("train_variants", "--seeds 0 4294967296 --out {d}/out",
                      ["--seeds", "4294967296"], None),
    "gate-steps": ("gate_init", "--steps 0 --runs-dir {d}/runs --out {d}/out/g", ["--steps", "0"], None),
    "gate-seed": ("gate_init", "--seeds -1 --runs-dir {d}/runs --out {d}/out/g", ["--seeds", "-1"], None),
    "cost-rounds": ("decode_cost", "--rounds 0 --out {d}/out/decode_cost", ["--rounds", "0"], None),
    "cost-contexts": ("decode_cost", "--contexts 1000000000000 --out {d}/out/decode_cost",
                      ["--contexts", "1000000000000"], None),
    "cost-partial": ("decode_cost", "--out {d}/out/decode_cost", ["decode_cost.partial.json"], "partial"),
    "latent-contexts": ("latent_decode", "--contexts 1000000000000 --out {d}/out",
                        ["--contexts", "1000000000000"], None),
    "throughput-rounds": ("train_throughput", "--rounds 0 --out {d}/out", ["--rounds", "0"], None),
    "throughput-steps": ("train_throughput", "--steps 0 --out {d}/out", ["--steps", "0"], None),
    "prefill-tokens": ("prefill_flops", "--tokens 100000 --out {d}/out", ["--tokens", "100000"], None),
    "quant-windows": ("quant_quality", "--windows 1000000000 --out {d}/out",
                      ["--windows", "1000000000"], None),
    "capacity-block": ("serve_capacity", "--block-size 0 --output-dir {d}/out", ["--block-size", "0"], None),
    "capacity-kv": ("serve_capacity", "--kv-mib -1 --output-dir {d}/out", ["--kv-mib", "-1"], None),
    "capacity-seqs": ("serve_capacity", "--max-seqs 0 --output-dir {d}/out", ["--max-seqs", "0"], None),
    "capacity-quick-explicit": ("serve_capacity", "--quick --seq-len 100000 --output-dir {d}/out",
                                ["--seq-len", "100000"], None),  # --quick keeps what is given
    "throughput-lens-order": ("serve_throughput", "--prompt-lens 512 16 --output-dir {d}/out",
                              ["--prompt-lens", "512 16"], None),
    "throughput-requests": ("serve_throughput", "--requests 0 --output-dir {d}/out",
                            ["--requests", "0"], None),
    "throughput-kv": ("serve_throughput", "--kv-cache-mib -1 --output-dir {d}/out",
                      ["--kv-cache-mib", "-1"], None),
    "upcycle-model": ("upcycle_serving", "--model x=/nonexistent --out {d}/out", ["/nonexistent"], None),
    "upcycle-block": ("upcycle_serving", "--block-size 0 --out {d}/out", ["--block-size", "0"], None),
    "upcycle-seq": ("upcycle_serving", "--seq-len 0 --out {d}/out", ["--seq-len", "0"], None),
    "upcycle-quick-explicit": ("upcycle_serving", "--quick --seq-len 100 --decode-tokens 200 --out {d}/out",
                               ["--decode-tokens 200", "--seq-len 100"], None),  # not quick's 256
    "eval-limit": ("eval_suite", "--limit 0", ["--limit", "0"], None),
    "eval-gsm8k": ("eval_suite", "--gsm8k-limit 0", ["--gsm8k-limit", "0"], None),
    "export-run": ("export_roundtrip", "--run /nonexistent --out {d}/out/x", ["--run", "/nonexistent"],
                   None),
    "locality-model": ("activation_locality", "--model /nonexistent --out {d}/out",
                       ["--model", "/nonexistent"], None),
    "locality-predictors": ("activation_locality", "--model SmolLM2-135M-Instruct --predictors "
                            "{d}/predictors.safetensors --out {d}/out",
                            ["--predictors", "predictors.safetensors"], "junk"),
    "parity-task-id": ("selfdebug_parity", "{d}/a {d}/b --out {d}/out/parity",
                       ["traces.jsonl", "task_id"], "traces"),
    # --quick changes defaults only: an explicit value still applies (and is checked)
    "cost-quick-explicit": ("decode_cost", "--quick --contexts 1000000000000 --out {d}/out/decode_cost",
                            ["--contexts", "1000000000000"], None),
    "latent-quick-explicit": ("latent_decode", "--quick --contexts 1000000000000 --out {d}/out",
                              ["--contexts", "1000000000000"], None),
    "prefill-quick-explicit": ("prefill_flops", "--quick --tokens 100000 --out {d}/out",
                               ["--tokens", "100000"], None),
    "speed-quick-explicit": ("decode_speed", "--quick --prompt-lens 1000000000000 --out {d}/out",
                             ["--prompt-lens", "1000000000000"], None),
    "throughput-quick-explicit": ("serve_throughput", "--quick --prompt-lens 512 16 --output-dir {d}/out",
                                  ["--prompt-lens", "512 16"], None),
    "quickstart-out": ("quickstart", "--out /proc/egmla/quickstart.json", ["/proc/egmla/quickstart.json"],
                       None),
}


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() if p.is_file() else b"/"
            for p in sorted(d.rglob("*"))}


def _run(case: str, d: Path) -> tuple[subprocess.CompletedProcess, dict, dict]:
    script, args, _, setup = CASES[case]
    d.mkdir()
    if setup:
        SETUP[setup](d)
    before = _snapshot(d)
    run = subprocess.run([sys.executable, f"benchmarks/{script}.py",
                          *args.format(d=d).split()], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    return run, before, _snapshot(d)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every case's (process, directory before, directory after), run four at a time."""
    base = tmp_path_factory.mktemp("benchmark-arguments")
    with ThreadPoolExecutor(4) as pool:
        futures = {case: pool.submit(_run, case, base / case) for case in CASES}
        return {case: future.result() for case, future in futures.items()}


@pytest.mark.slow  # about 60 s on 2 cores: 39 processes, each mostly importing torch
@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_argument_is_refused_at_once_and_leaves_nothing(case, outcomes):
    run, before, after = outcomes[case]
    named = CASES[case][2]
    assert run.returncode == 2, run.stderr[-2000:]
    assert "Traceback" not in run.stderr, run.stderr[-2000:]
    assert all(n in run.stderr for n in named), (named, run.stderr[-2000:])
    assert "error" in run.stderr.strip().splitlines()[-1]  # the message is the last line
    assert after == before  # no output, no directory made; a bad input file left as it was


def test_quickstart_refuses_to_replace_a_directory_it_did_not_keep(tmp_path):
    """--keep-run DIR used to rmtree an existing DIR (a run of your own, say) at the end of the
    quickstart; it is refused when the arguments are read and stays as it was."""
    mine = tmp_path / "quickstart"
    (mine / "checkpoints").mkdir(parents=True)
    (mine / "summary.json").write_text('{"val_loss": 3.1}')
    (mine / "checkpoints" / "last.ckpt").write_bytes(b"weights")
    before = _snapshot(mine)
    run = subprocess.run([sys.executable, "benchmarks/quickstart.py", "--keep-run", str(mine),
                          "--out", str(tmp_path / "quickstart.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and str(mine) in run.stderr and "Traceback" not in run.stderr
    assert "--keep-run" in run.stderr and _snapshot(mine) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quickstart"]  # no record written


def test_quickstart_may_replace_an_empty_directory_or_its_own_copy(tmp_path):
    spec = importlib.util.spec_from_file_location("quickstart", ROOT / "benchmarks" / "quickstart.py")
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    refusal = quickstart.keep_run_refusal
    assert refusal(tmp_path / "new") is None
    (tmp_path / "empty").mkdir()
    assert refusal(tmp_path / "empty") is None
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    (run / "summary.json").write_text("{}")
    kept = tmp_path / "kept"
    quickstart.keep(run, kept, "abc")  # a copy, marked as this benchmark's
    assert (kept / "summary.json").read_text() == "{}" and refusal(kept) is None
    quickstart.keep(run, kept, "def")  # and replaced whole on the next run
    assert json.loads((kept / quickstart.KEPT_BY).read_text())["run_git_sha"] == "def"
    assert "not kept by this benchmark" in refusal(run)
    (tmp_path / "file").write_text("x")
    assert refusal(tmp_path / "file") is not None


@pytest.mark.slow  # about 8 s: the GGUF reader parses every metadata field
def test_the_context_known_models_give_is_their_ggufs():
    """decode_speed, prefill_flops and serve_throughput bound their lengths by a known model's
    context (KNOWN_MODELS) before loading it: it must be the model's, as its GGUF file says."""
    import gguf

    from egmla.imports import KNOWN_MODELS

    for name, source in KNOWN_MODELS.items():
        fields = gguf.GGUFReader(str(source.path())).fields
        assert source.context == int(fields["llama.context_length"].contents()), name


def test_activation_locality_measures_anew_beside_a_partial_that_is_not_a_record(tmp_path):
    """A partial results file that is JSON but not a record of models (a list, models that are
    not objects) is set aside with a line, as an unreadable one is: every model is measured."""
    spec = importlib.util.spec_from_file_location("activation_locality",
                                                  ROOT / "benchmarks" / "activation_locality.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    partial, said = tmp_path / "activation_locality.json.partial", []
    for text in ("[1, 2]", '{"settings": {}, "models": [1]}', '{"settings": {}, "models": {}}'):
        partial.write_text(text)
        assert bench.kept_models(partial, {}, False, said.append) == {}
        assert "unreadable" in said[-1] and str(partial) in said[-1]
