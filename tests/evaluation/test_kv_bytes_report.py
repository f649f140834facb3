"""The KV-bytes report (`python -m eval.kv_bytes`): paper numbers, measured == analytic, CLI errors.

The report is run as a real subprocess where the command line is the thing under test; the
expected numbers are recomputed here from each config's dimensions, not from `egmla.cache`.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import eval.kv_bytes as kv
from egmla.cache import ContiguousCache
from egmla.presets import PRESETS, preset
from support import ROOT

PAPER_ELEMENTS = {"paper-mha": 18432, "paper-gqa4": 6144, "paper-mla": 3840,
                  "paper-egmla-kv256": 3840, "paper-egmla-kv64": 1536, "paper-egmla-kv16": 960}


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eval.kv_bytes", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def hand_elements(config: dict) -> int:
    """Cached float elements per token from the config dict alone (REFERENCE.md section 1)."""
    a, L = config["attention"], config["n_layers"]
    if a["type"] == "mha":
        n_kv = a["n_kv_heads"] or config["n_heads"]
        head_dim = a["head_dim"] or config["d_model"] // config["n_heads"]
        return L * 2 * n_kv * head_dim
    return L * (a["d_c"] + a["d_rope"])


def hand_sequence_bytes(config: dict) -> int:
    """EG-MLA with the gate on K/V rebuilds K/V from token ids, and the value-embedding control
    adds its keys' embeddings: one int32 per token (the constant-gate control reads no ids)."""
    a = config["attention"]
    token_gate = a["type"] in ("egmla", "egmla_v_gate") and a["gate_position"] == "kv"
    return 4 if token_gate or a["type"] in ("mla_value_embed", "mla_kv_embed") else 0


def hand_stats_bytes(config: dict) -> int:
    """EG-MLA `kv` with the absorbed decode available caches the gate norm's statistics per layer:
    LayerNorm's mean and 1/sigma (RMSNorm: 1/rms), float32 in every dtype reported here."""
    a = config["attention"]
    gated = a["type"] in ("egmla", "egmla_const_gate") and a["gate_position"] == "kv"
    if not gated or a["impl"] == "naive":
        return 0
    return config["n_layers"] * {"layernorm": 2, "rmsnorm": 1, "none": 0}[a["gate_norm"]] * 4


def check_rows(report: dict, itemsize: dict[str, int]) -> None:
    """Every row: hand-computed bytes, exact totals, and every allocation measured == analytic."""
    assert report["all_match"] is True and report["mismatches"] == []
    for row in report["configs"]:
        elements, seq = hand_elements(row["config"]), hand_sequence_bytes(row["config"])
        stats = hand_stats_bytes(row["config"])
        assert row["elements_per_token"] == elements, row["name"]
        for dt, d in row["dtypes"].items():
            assert d["layer_bytes_per_token"] == itemsize[dt] * elements, (row["name"], dt)
            assert d["auxiliary_bytes_per_token"] == stats
            assert d["sequence_bytes_per_token"] == seq
            assert d["bytes_per_token"] == itemsize[dt] * elements + stats + seq
            assert d["match"] is True
            assert d["measurements"], "no allocation was measured"
            for m in d["measurements"]:
                assert m["nbytes"] == m["analytic_nbytes"] == d["bytes_per_token"] * m["tokens"]
                assert m["bytes_per_token"] == d["bytes_per_token"]
            for t in d["totals"]:
                assert t["bytes"] == d["bytes_per_token"] * t["context"]
                if t["measured_bytes"] is not None:
                    assert t["measured_bytes"] == t["bytes"]


@pytest.fixture(scope="module")
def paper_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("kv")
    result = run("--json", "--output-dir", str(out))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), out


def test_paper_elements_and_bf16_bytes(paper_run):
    report, _ = paper_run
    rows = {r["name"]: r for r in report["configs"]}
    assert list(rows) == kv.PAPER_SET
    assert {n: r["elements_per_token"] for n, r in rows.items()} == PAPER_ELEMENTS
    for name, elements in PAPER_ELEMENTS.items():
        ids, stats = (4, 12 * 2 * 4) if "egmla" in name else (0, 0)  # id once; mu, 1/sigma
        assert rows[name]["dtypes"]["bf16"]["bytes_per_token"] == 2 * elements + stats + ids
    assert rows["paper-egmla-kv64"]["dtypes"]["bf16"]["bytes_per_token"] == 3172
    check_rows(report, {"bf16": 2})


def test_paper_reductions(paper_run):
    report, _ = paper_run
    rows = {r["name"]: r for r in report["configs"]}
    for row in rows.values():
        assert row["references"] == {"mha": "paper-mha", "mla": "paper-mla"}
    kv64 = rows["paper-egmla-kv64"]
    assert round(kv64["elements_change_pct"]["mha"], 2) == -91.67
    assert round(kv64["elements_change_pct"]["mla"], 2) == -60.00
    assert round(rows["paper-egmla-kv16"]["elements_change_pct"]["mha"], 2) == -94.79
    assert rows["paper-mha"]["elements_change_pct"]["mha"] == 0.0
    # bytes include the 4-byte token id and the norm statistics (96 bytes over 12 layers), so
    # EG-MLA's byte reduction is slightly smaller than its element reduction
    assert kv64["dtypes"]["bf16"]["bytes_change_pct"]["mha"] == pytest.approx(
        100 * (3172 - 36864) / 36864)
    assert kv64["dtypes"]["bf16"]["bytes_change_pct"]["mla"] == pytest.approx(
        100 * (3172 - 7680) / 7680)


def test_paper_totals_measured_up_to_the_cap(paper_run):
    report, _ = paper_run
    assert report["settings"]["contexts"] == [1024, 4096, 32768]
    assert report["settings"]["measured_lengths"] == [1024, 4096]
    totals = report["configs"][0]["dtypes"]["bf16"]["totals"]
    assert [t["measured_bytes"] is not None for t in totals] == [True, True, False]
    assert totals[2]["bytes"] == 36864 * 32768


def test_params_with_and_without_gate_tables(paper_run):
    report, _ = paper_run
    rows = {r["name"]: r["params"] for r in report["configs"]}
    assert rows["paper-mla"]["with_gate_tables"] == rows["paper-mla"]["without_gate_tables"]
    kv64 = rows["paper-egmla-kv64"]
    assert kv64["with_gate_tables"] - kv64["without_gate_tables"] == 12 * 50257 * 256


def test_output_dir_files_and_metadata(paper_run):
    report, out = paper_run
    assert json.loads((out / "kv_bytes.json").read_text())["configs"] == report["configs"]
    md = (out / "kv_bytes.md").read_text()
    assert "| paper-egmla-kv64 |" in md and "-91.67%" in md and "18,432" in md
    assert "Measured == analytic for every row" in md
    meta = report["metadata"]
    assert meta["command"].startswith("python -m eval.kv_bytes --json --output-dir")
    assert meta["torch"] == torch.__version__ and meta["python"] and meta["hostname"]
    assert "git_sha" in meta


def test_default_table_is_readable():
    result = run()
    assert result.returncode == 0, result.stderr
    text = result.stdout
    for needle in ("18,432", "3,840", "1,536", "960", "-91.67%", "-60.00%", "token_ids:int32",
                   "36.00 MiB", "1.12 GiB", "Measured == analytic for every row"):
        assert needle in text, needle
    assert "MISMATCH" not in text
    assert max(len(line) for line in text.splitlines()) < 200
    doc = (ROOT / "docs" / "kv_bytes.md").read_text()
    assert "```text\n" + text + "```" in doc, "docs/kv_bytes.md's default output is out of date"


def test_small_and_tiny_groups_in_every_dtype():
    result = run("--presets", "small", "tiny", "--json", "--dtype", "fp32", "bfloat16", "fp16",
                 "fp8", "--context", "64", "300", "--measure-len", "64", "--measure-max", "300")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    names = [r["name"] for r in report["configs"]]
    by_prefix = lambda p: [n for n in PRESETS if n.startswith(p)]  # noqa: E731
    assert names == by_prefix("small-") + by_prefix("tiny-")
    assert report["settings"]["measured_lengths"] == [64, 300]
    check_rows(report, {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1})
    rows = {r["name"]: r for r in report["configs"]}
    assert rows["small-egmla"]["references"] == {"mha": "small-mha", "mla": "small-mla"}
    assert rows["tiny-gqa2"]["references"] == {"mha": "tiny-mha", "mla": "tiny-mla"}
    assert rows["tiny-egmla"]["dtypes"]["fp8"]["torch_dtype"] == "torch.float8_e4m3fn"
    assert rows["tiny-egmla-latent"]["sequence_fields"] == {}  # latent gate: no ids cached


def test_help_exits_zero():
    result = run("--help")
    assert result.returncode == 0
    assert "examples:" in result.stdout and "--measure-max" in result.stdout


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    for needle in needles:
        assert needle in result.stderr, needle


def test_unknown_preset_exits_2_and_lists_the_known_names():
    result = run("--presets", "paper-mla", "paper-mlaa")
    assert_one_line_error(result, "'paper-mlaa'", "paper-egmla-kv64", "small-mha")


def test_bad_dtype_exits_2_and_lists_the_accepted_ones():
    assert_one_line_error(run("--dtype", "bf16", "int8"), "'int8'", "fp8", "bfloat16")


def test_config_with_a_misspelled_key_names_it(tmp_path):
    path = tmp_path / "typo.json"
    path.write_text(json.dumps({"vocab_size": 256, "d_model": 64, "n_layer": 2, "n_heads": 4}))
    assert_one_line_error(run("--config", str(path)), "'n_layer'", str(path))


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--context", "lots"], "'lots'"),
        (["--measure-max", "0"], "'0'"),
        (["--presets", "none"], "nothing to report"),
        (["--presets", "tiny-mha", "--config", "{dir}/tiny-mha.json"], "duplicate"),
        (["--config", "{dir}/nested.json"], "'d_cc'"),
        (["--config", "{dir}/missing.json"], "cannot read"),
        (["--config", "{dir}/broken.json"], "not valid JSON"),
        (["--output-dir", "{dir}/tiny-mha.json/out"], "--output-dir"),  # under a file
    ],
)
def test_bad_arguments_in_process(tmp_path, capsys, args, needle):
    (tmp_path / "nested.json").write_text(json.dumps(
        {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4,
         "attention": {"type": "mla", "d_cc": 32}}))
    (tmp_path / "tiny-mha.json").write_text(json.dumps(preset("tiny-mha").to_dict()))
    (tmp_path / "broken.json").write_text('{"vocab_size": 256,')
    assert kv.main([a.format(dir=tmp_path) for a in args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and needle in err and len(err.strip().splitlines()) == 1


# ---- in process ------------------------------------------------------------------------------


def test_config_file_is_reported_against_its_own_mha_twin(tmp_path, capsys):
    data = preset("tiny-egmla", n_layers=4).to_dict()
    (tmp_path / "deep.json").write_text(json.dumps(data))
    code = kv.main(["--presets", "tiny-mla", "--config", str(tmp_path / "deep.json"), "--json",
                    "--context", "16", "--measure-len", "16"])
    assert code == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["configs"]}
    deep = rows["deep"]
    assert deep["elements_per_token"] == 4 * (8 + 8)
    assert deep["references"] == {"mha": "deep as mha", "mla": None}  # tiny-mla has 2 layers
    mha = 4 * 2 * 4 * 16  # layers x (k, v) x heads x head_dim
    assert deep["elements_change_pct"]["mha"] == pytest.approx(100 * (64 - mha) / mha)


def test_a_mismatch_is_reported_and_exits_1(monkeypatch, capsys):
    class Padded(ContiguousCache):
        def nbytes(self) -> int:
            return super().nbytes() + 1

    monkeypatch.setattr(kv, "ContiguousCache", Padded)
    code = kv.main(["--presets", "tiny-mha", "--context", "8", "--measure-len", "8"])
    out, err = capsys.readouterr()
    assert code == 1
    assert "MISMATCH" in out and "tiny-mha bf16 contiguous @8: measured 4097, analytic 4096" in out
    assert "measured != analytic" in err


def test_a_paged_mismatch_is_reported_and_exits_1(monkeypatch, capsys):
    from egmla.cache import CacheTensors
    from serve.paged_cache import PagedKVCache

    monkeypatch.setattr(PagedKVCache, "nbytes", lambda self: CacheTensors.nbytes(self) + 1)
    code = kv.main(["--presets", "tiny-mha", "--context", "8", "--measure-len", "8"])
    out, _ = capsys.readouterr()
    assert code == 1
    assert "tiny-mha bf16 paged @8: measured 8193, analytic 8192" in out  # one block of 16


def test_an_allocation_failure_is_not_counted_as_measured(monkeypatch):
    def refuse(spec, batch_size, max_len, dtype, device):
        raise TypeError(f"cannot allocate {dtype}")

    monkeypatch.setattr(kv, "ContiguousCache", refuse)
    report = kv.build_report([("tiny-mla", preset("tiny-mla"))], [8], [torch.float8_e4m3fn], 8, 8)
    assert report["all_match"] is False
    assert "cannot allocate" in report["mismatches"][0]["error"]
    assert report["configs"][0]["dtypes"]["fp8"]["totals"][0]["measured_bytes"] is None


def test_parse_dtype_aliases_and_rejection():
    assert kv.parse_dtype("bf16") is kv.parse_dtype("BFloat16") is torch.bfloat16
    assert kv.parse_dtype("float32") is torch.float32 and kv.parse_dtype("fp16") is torch.float16
    assert kv.parse_dtype("fp8") is torch.float8_e4m3fn
    with pytest.raises(kv.UsageError, match="'fp4'"):
        kv.parse_dtype("fp4")


def test_parse_length():
    assert kv.parse_length("4096") == 4096 and kv.parse_length("32k") == 32768
    assert kv.parse_length("1M") == 1024**2
    for bad in ("0", "-5", "k", "1.5k", ""):
        with pytest.raises(kv.UsageError):
            kv.parse_length(bad)


def test_resolve_presets_groups_and_order():
    assert kv.resolve_presets(["paper"]) == kv.PAPER_SET
    assert kv.resolve_presets(["tiny-mla", "tiny", "none"])[0] == "tiny-mla"
    assert kv.resolve_presets(["tiny-mla", "tiny"]).count("tiny-mla") == 1
    assert kv.resolve_presets(["all"]) == list(PRESETS)
    with pytest.raises(kv.UsageError, match="'Paper-mha'"):
        kv.resolve_presets(["Paper-mha"])


def test_reduction_and_human_bytes():
    assert kv.reduction_pct(1536, 3840) == pytest.approx(-60.0)
    assert kv.reduction_pct(1536, None) is None
    assert kv.human_bytes(512) == "512 B" and kv.human_bytes(1536) == "1.50 KiB"
    assert kv.human_bytes(36864 * 1024) == "36.00 MiB"
    assert kv.human_bytes(3 * 1024**4) == "3072.00 GiB"


@pytest.mark.parametrize("name", ["tiny-mha", "tiny-mla", "tiny-egmla", "tiny-egmla-latent"])
@pytest.mark.parametrize("tokens", [16, 37])
def test_paged_measurement_is_what_the_serving_engine_holds(name, tokens):
    """The report's paged figure for one sequence == blocks the running engine holds for it x
    the bytes of one block of its pool (whole blocks, so 37 tokens cost 48 slots)."""
    from serve.engine import EngineConfig, LLMEngine, SamplingParams
    from support.models import build

    model = build(preset(name), dtype=torch.float32)
    engine = LLMEngine(model, EngineConfig(block_size=16, num_blocks=8))
    engine.add_request(list(range(1, tokens + 1)), SamplingParams(temperature=0, max_tokens=4))
    engine.step()  # the prompt's K/V (or latent) is written; the sequence is running
    held = engine.blocks.num_used() * engine.cache.block_bytes()
    m = kv.measure_paged(model.cache_spec(), torch.float32, tokens, block_size=16)
    assert m["match"] and m["nbytes"] == held
    bpt = model.cache_spec().bytes_per_token(torch.float32)
    assert m["blocks"] == -(-tokens // 16) and m["slack_bytes"] == (m["blocks"] * 16 - tokens) * bpt


def test_report_has_paged_totals_with_last_block_slack():
    report = kv.build_report([("paper-mla", preset("paper-mla"))], [1000, 4096], [torch.bfloat16])
    d = report["configs"][0]["dtypes"]["bf16"]
    bpt = 2 * 12 * (256 + 64)
    assert [t["paged_bytes"] for t in d["totals"]] == [1008 * bpt, 4096 * bpt]
    assert [t["measured_paged_bytes"] for t in d["totals"]] == [1008 * bpt, 4096 * bpt]
    assert all(m["match"] for m in d["paged_measurements"]) and report["all_match"]
    assert "Paged, bf16" in kv.render(report)
