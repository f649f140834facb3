"""`python -m studies.locality profile`: the firing statistics are what they claim on masks whose
answer is known, the firing set is the one sparse decoding computes, and the command runs on an
export directory with its tokenizer (a real subprocess), refusing bad input in one line."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from egmla.checkpoint import save_export
from egmla.data.tokenizer import get_tokenizer
from egmla.models import FeedForward, Transformer
from egmla.models.sparse_ffn import SparseDecode, firing
from egmla.presets import preset
from studies.locality import (
    LayerStats,
    concentration_curve,
    coverage_share,
    profile_model,
    top_overlap,
)
from support import ROOT


def test_coverage_share_is_the_fewest_neurons_giving_80_percent():
    assert coverage_share(torch.tensor([8, 1, 1, 0])) == 0.25  # neuron 0 alone gives 80%
    assert coverage_share(torch.tensor([1, 1, 1, 1, 1])) == 0.8
    assert coverage_share(torch.tensor([7, 2, 1, 0])) == 0.5
    assert coverage_share(torch.zeros(4, dtype=torch.long)) is None


def test_the_concentration_curve_runs_from_nothing_to_everything_and_is_concave():
    counts = torch.tensor([50, 30, 10, 5, 5] * 20)
    curve = concentration_curve(counts)
    assert curve[0] == 0 and curve[-1] == pytest.approx(1.0)
    steps = torch.tensor(curve, dtype=torch.float64).diff()
    assert (steps >= 0).all() and (steps.diff() <= 1e-12).all()


def test_top_overlap():
    a = torch.arange(10.0)
    assert top_overlap(a, a) == 1.0
    assert top_overlap(a, -a) == 0.0  # the top 2 of one are the bottom 2 of the other


def test_layer_stats_on_a_mask_with_a_known_answer():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(16, 5, 64, generator=g) < 0.1  # (B, T, d_ff)
    stats = LayerStats(64)
    stats.add(mask)
    s = stats.summary()
    assert s["tokens"] == 80 and torch.equal(stats.counts, mask.sum((0, 1)))
    assert s["sparsity"] == pytest.approx(1 - mask.float().mean().item())
    four = torch.stack([mask[i:i + 4].any(0) for i in range(0, 16, 4)])  # 4 sequences per step
    assert s["union_sparsity"]["4"] == pytest.approx(1 - four.float().mean().item())
    assert s["union_sparsity"]["16"] < s["union_sparsity"]["4"] < s["union_sparsity"]["1"]


@pytest.mark.parametrize("ffn", ["reglu", "relu2"])
def test_what_fires_is_what_sparse_decoding_computes(ffn):
    torch.manual_seed(0)
    mlp = FeedForward(32, 128, ffn).eval()
    x = torch.randn(6, 32)
    with torch.no_grad():
        fired = firing(mlp, x)
        assert torch.equal(fired, mlp.hidden(x) != 0)
        computed, _ = SparseDecode(mlp, "gate").active(x)
    assert torch.equal(fired.any(0).nonzero().squeeze(1), computed)


def test_a_neuron_that_cannot_fire_is_never_counted():
    torch.manual_seed(0)
    model = Transformer(preset("tiny-gqa2", ffn="relu2")).eval()
    with torch.no_grad():
        model.layers[1].mlp.w_up.weight[7].zero_()  # relu(0)^2 = 0 for every token
    ids = torch.randint(0, model.config.vocab_size, (32, 8), generator=torch.Generator().manual_seed(1))
    layers = profile_model(model, iter(ids.split(16)))
    assert layers[1].counts[7] == 0 and layers[1].tokens == 256
    assert (layers[0].counts > 0).float().mean() > 0.9


def profile(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "studies.locality", "profile", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def relu2_export(tmp_path_factory):
    """A relu2 model's export with the 512-token BPE of the training tests (built once, cached)."""
    tokenizer = get_tokenizer("bpe", vocab_size=512)
    torch.manual_seed(0)
    model = Transformer(preset("tiny-mha", ffn="relu2", vocab_size=len(tokenizer)))
    return save_export(model, tmp_path_factory.mktemp("locality") / "export", tokenizer=tokenizer)


def test_the_command_profiles_an_export(relu2_export, tmp_path):
    out = tmp_path / "out"
    result = profile("--model", str(relu2_export), "--data", "corpus-a", "corpus-b",
                     "--tokens", "1024", "--seq-len", "32", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "profile.json").read_text())
    assert report["meta"]["ffn"] == "relu2" and report["meta"]["git"]["sha"]
    for source in ("corpus-a", "corpus-b"):
        layers = report["sources"][source]["layers"]
        assert len(layers) == 2 and all(s["tokens"] == 1024 for s in layers)
        assert all(0 < s["sparsity"] < 1 for s in layers)
    assert len(report["top20_overlap"]["corpus-a vs corpus-b"]) == 2
    counts = safetensors.torch.load_file(out / "neuron_counts.safetensors")
    assert counts["corpus-a.layer0"].sum() > 0
    assert (out / "profile.png").stat().st_size > 10_000
    assert "| corpus-a | all |" in (out / "profile.md").read_text()


@pytest.mark.parametrize("args, needle", [
    (["--threshold", "-1"], "--threshold: '-1': must be a finite number >= 0"),
    (["--tokens", "0"], "--tokens: '0': must be > 0"),
    (["--data", "wiki"], "invalid choice: 'wiki'"),
    (["--seq-len", "100000"], "--seq-len 100000: the model's max_seq_len is"),
])
def test_bad_input_is_refused_in_one_line(relu2_export, args, needle):
    result = profile("--model", str(relu2_export), *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert needle in result.stderr, result.stderr[-2000:]


def test_a_missing_model_is_refused_in_one_line(tmp_path):
    result = profile("--model", str(tmp_path / "nothing"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "nothing" in result.stderr


# ---- predictors ---------------------------------------------------------------------------------


def test_calibration_reaches_the_recall_it_is_asked_for_on_its_own_tokens():
    from studies.locality.predictors import calibrate, collect, measure, train_predictor

    torch.manual_seed(0)
    model = Transformer(preset("tiny-gqa2", ffn="reglu")).eval()
    ids = torch.randint(0, model.config.vocab_size, (32, 16), generator=torch.Generator().manual_seed(2))
    (x, fired), _ = collect(model, ids.split(16))
    p = train_predictor(x, fired, rank=16, steps=50)
    for recall in (0.5, 0.9, 0.99):
        got = measure(calibrate(p, x, fired, 0, recall), x, fired, 0, 3)
        assert got["recall"] == pytest.approx(recall, abs=0.01)
        assert got["density"] < 1
    hot = measure(calibrate(p, x, fired, 64, 0.9), x, fired, 64, 3)  # the hot block counts
    assert hot["density"] >= 64 / fired.shape[1]


def test_a_predictor_learns_which_neurons_fire_on_held_out_tokens():
    """The firing of a ReLU MLP is a function of its input: a rank of the input's width can
    learn it, measured on tokens it was not trained on."""
    from studies.locality.predictors import collect, measure, train_predictor

    torch.manual_seed(0)
    model = Transformer(preset("tiny-gqa2", ffn="reglu")).eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (96, 16), generator=g)
    (x, fired), _ = collect(model, ids[:80].split(16))
    (hx, hfired), _ = collect(model, ids[80:].split(16))
    got = measure(train_predictor(x, fired, rank=64, steps=300), hx, hfired, 0, 3)
    assert got["recall"] > 0.85 and got["precision"] > 0.85


def test_the_hot_tier_under_a_budget_takes_the_models_most_frequent_neurons():
    from studies.locality.predictors import hot_under_budget

    counts = [torch.tensor([10, 5, 1]), torch.tensor([8, 7, 0])]  # each most frequent first
    assert hot_under_budget(counts, neuron_bytes=4, budget=16) == [2, 2]  # 10, 8, 7, 5
    assert hot_under_budget(counts, neuron_bytes=4, budget=15) == [1, 2]  # room for 3: 10, 8, 7
    assert hot_under_budget(counts, neuron_bytes=4, budget=3) == [0, 0]
    assert hot_under_budget(counts, neuron_bytes=4, budget=10**6) == [3, 3]
    assert hot_under_budget([torch.tensor([5, 5]), torch.tensor([5])], 1, 2) == [2, 0]  # ties


def test_the_predictors_command_trains_chooses_and_saves(relu2_export, tmp_path):
    out = tmp_path / "pred"
    result = subprocess.run(
        [sys.executable, "-m", "studies.locality", "predictors", "--model", str(relu2_export),
         "--tokens", "2048", "--held-out-tokens", "512", "--seq-len", "32", "--ranks", "8", "64",
         "--steps", "60", "--tolerance", "0.5", "--hot-budget", "96KiB", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "predictors.json").read_text())
    assert report["chosen_rank"] == report["tried"][-1]["rank"]
    layers = report["tried"][-1]["layers"]
    assert len(layers) == 2 and all(0 < r["recall"] <= 1 and 0 < r["density"] <= 1 for r in layers)
    # the hot tier under 96 KiB: relu2 (2 matrices of d 64, fp32) is 512 bytes a neuron
    assert report["hot_budget_bytes"] == 96 * 1024 and sum(report["hot"]) == 96 * 1024 // 512
    assert [r["hot"] for r in layers] == report["hot"]
    saved = safetensors.torch.load_file(out / "predictors.safetensors")
    digest = hashlib.sha256((out / "predictors.safetensors").read_bytes()).hexdigest()
    assert report["meta"]["predictors_sha256"] == digest  # the report names the file it wrote
    assert "predictors" in report["meta"]["command"]
    assert saved["layer0.w1"].shape[0] == report["chosen_rank"]
    assert torch.equal(saved["layer1.order"].sort().values, torch.arange(saved["layer1.order"].numel()))
    # what it saved serves: the model reordered as the predictors were trained, decoded sparsely
    from serve import LLM, SamplingParams

    llm = LLM(str(relu2_export), ffn_sparsity="predicted",
              ffn_predictors=out / "predictors.safetensors", num_blocks=64, block_size=8)
    text = llm.generate(["Thou art"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert len(text.token_ids) == 8
    sparse = [block.mlp.sparse for block in llm.model.layers]
    assert all(s.mode == "predicted" and 0 < s.density() < 1 for s in sparse)
    assert [s.hot for s in sparse] == [r["hot"] for r in layers]


def test_the_predictors_search_keeps_the_fewest_neurons_within_the_tolerance(relu2_export, tmp_path):
    """Several hot shares and recall targets: every pair is tried at the first rank (one
    training, several calibrations), the pair within the tolerance that computes the fewest
    neurons is chosen and saved, and no wider rank is tried once one was chosen."""
    from studies import locality

    out = tmp_path / "pred"
    assert locality.main(["predictors", "--model", str(relu2_export), "--tokens", "1024",
                          "--held-out-tokens", "512", "--seq-len", "32", "--ranks", "4", "8",
                          "--steps", "20", "--tolerance", "10", "--hot", "0.05", "0.25",
                          "--recall", "0.5", "0.99", "--out", str(out)]) == 0
    report = json.loads((out / "predictors.json").read_text())
    tried = report["tried"]
    assert [(t["rank"], t["hot_share"], t["recall_target"]) for t in tried] == [
        (4, 0.05, 0.5), (4, 0.05, 0.99), (4, 0.25, 0.5), (4, 0.25, 0.99)]
    densities = [t["density"] for t in tried]
    assert len(set(densities)) > 1  # the settings differ in what they compute
    best = tried[densities.index(min(densities))]
    assert report["chosen_rank"] == 4
    assert (report["hot_share"], report["recall_target"]) == (best["hot_share"], best["recall_target"])
    saved = safetensors.torch.load_file(out / "predictors.safetensors")
    assert [int(saved[f"layer{i}.hot"]) for i in range(2)] == best["hot"] == report["hot"]
    assert "| 0.25 | 0.99 |" in (out / "predictors.md").read_text()


def test_predictors_that_miss_the_tolerance_are_not_saved(relu2_export, tmp_path, monkeypatch):
    """No rank within the tolerance: the report says so, and no predictors file is left, not
    even an older one, for serving or the benchmark to load as if it were chosen. (A model
    where every mask doubles the perplexity: a random tiny model's masked perplexity is as
    likely to fall as to rise.)"""
    from studies import locality
    from studies.locality import predictors

    dense = predictors.perplexity
    monkeypatch.setattr(predictors, "perplexity",
                        lambda model, batches, keep=None: dense(model, batches) * (2 if keep else 1))
    out = tmp_path / "pred"
    out.mkdir()
    (out / "predictors.safetensors").write_bytes(b"stale")
    assert locality.main(["predictors", "--model", str(relu2_export), "--tokens", "1024",
                          "--held-out-tokens", "512", "--seq-len", "32", "--ranks", "4", "8",
                          "--steps", "5", "--out", str(out)]) == 0
    report = json.loads((out / "predictors.json").read_text())
    assert report["chosen_rank"] is None and "nothing saved" in report["note"]
    assert [t["relative_increase"] for t in report["tried"]] == pytest.approx([1.0, 1.0])
    assert not (out / "predictors.safetensors").exists()


@pytest.fixture(scope="module")
def swiglu_export(tmp_path_factory):
    tokenizer = get_tokenizer("bpe", vocab_size=512)
    torch.manual_seed(0)
    model = Transformer(preset("tiny-mha", vocab_size=len(tokenizer)))  # SwiGLU
    return save_export(model, tmp_path_factory.mktemp("swiglu") / "export", tokenizer=tokenizer)


def test_a_target_sparsity_profiles_and_predicts_at_calibrated_per_layer_thresholds(
        swiglu_export, tmp_path):
    """--sparsity 0.5 on a SwiGLU model: one threshold per layer, under which about half of
    each layer's neurons fall on the calibration text (corpus-a); the predictors are held to
    the thresholded model, not to dense, and their file carries the thresholds to serving."""
    from studies import locality
    from serve import LLM

    out = tmp_path / "out"
    common = ["--model", str(swiglu_export), "--seq-len", "32", "--sparsity", "0.5",
              "--out", str(out)]
    assert locality.main(["profile", *common, "--tokens", "1024", "--data", "corpus-a",
                          "humaneval"]) == 0
    profiled = json.loads((out / "profile.json").read_text())
    thresholds = profiled["meta"]["threshold"]
    assert len(thresholds) == 2 and all(t > 0 for t in thresholds) and thresholds[0] != thresholds[1]
    assert profiled["meta"]["sparsity"] == 0.5 and profiled["meta"]["config"]["sparsity"] == 0.5
    for layer in profiled["sources"]["corpus-a"]["layers"]:  # tokens it was calibrated on
        assert layer["sparsity"] == pytest.approx(0.5, abs=0.03)
    assert "per-layer thresholds" in (out / "profile.md").read_text()
    assert locality.main(["predictors", *common, "--tokens", "1024", "--held-out-tokens", "512",
                          "--ranks", "8", "--steps", "20", "--tolerance", "10"]) == 0
    report = json.loads((out / "predictors.json").read_text())
    assert report["meta"]["threshold"] == pytest.approx(thresholds, rel=1e-6)
    assert report["reference_perplexity"] != report["dense_perplexity"]
    tried = report["tried"][0]
    assert tried["relative_increase"] == pytest.approx(
        tried["perplexity"] / report["reference_perplexity"] - 1)
    assert tried["vs_dense"] == pytest.approx(tried["perplexity"] / report["dense_perplexity"] - 1)
    llm = LLM(str(swiglu_export), ffn_sparsity="predicted",
              ffn_predictors=out / "predictors.safetensors", num_blocks=16, block_size=8)
    assert [b.mlp.sparse.threshold for b in llm.model.layers] == report["meta"]["threshold"]
    both = profile("--model", str(swiglu_export), "--threshold", "0.1", "--sparsity", "0.5")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
    one = profile("--model", str(swiglu_export), "--sparsity", "1")
    assert one.returncode == 2 and "--sparsity: '1': must be in (0, 1)" in one.stderr


def _reference_perplexity(export, ids: torch.Tensor, thresholds=None) -> float:
    """Perplexity of `ids` (B, T) written out from the weights: each SwiGLU neuron's
    silu(gate) * up kept only where |silu(gate)| is above its layer's threshold."""
    from egmla.imports import load_pretrained

    model, _ = load_pretrained(str(export), dtype=torch.float32)
    model.eval()
    if thresholds is not None:
        for block, t in zip(model.layers, thresholds):
            def cut(mlp, args, output, t=t):
                a = torch.nn.functional.silu(args[0] @ mlp.w_gate.weight.T)
                return ((a * (args[0] @ mlp.w_up.weight.T)) * (a.abs() > t)) @ mlp.w_down.weight.T
            block.mlp.register_forward_hook(cut)
    with torch.inference_mode():
        logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    return float(loss.exp())


def test_the_sweep_measures_what_each_target_sparsity_costs(swiglu_export, tmp_path):
    """`sweep` on a SwiGLU model: for each target, the thresholds skip about that share of the
    held-out text's neurons, and the perplexity is the one written out from the weights."""
    from studies import locality

    out = tmp_path / "out"
    assert locality.main(["sweep", "--model", str(swiglu_export), "--seq-len", "32",
                          "--tokens", "512", "--targets", "0.6", "0.2", "--tolerance", "0.05",
                          "--out", str(out)]) == 0
    report = json.loads((out / "sweep.json").read_text())
    assert [p["target"] for p in report["points"]] == [0.2, 0.6]  # in order, whatever was given
    tokenizer = get_tokenizer("bpe", vocab_size=512)  # the export's
    held = locality.windows(locality.token_stream(tokenizer, locality.source_texts("corpus-b"),
                                                  512), 32, 512)
    assert report["held_out_tokens"] == held.numel() == 512
    assert report["dense_perplexity"] == pytest.approx(_reference_perplexity(swiglu_export, held),
                                                       rel=1e-5)
    for point in report["points"]:
        assert len(point["thresholds"]) == 2 and all(t > 0 for t in point["thresholds"])
        assert point["held_out_sparsity"] == pytest.approx(point["target"], abs=0.1)
        assert point["perplexity"] == pytest.approx(
            _reference_perplexity(swiglu_export, held, point["thresholds"]), rel=1e-5)
        assert point["vs_dense"] == pytest.approx(
            point["perplexity"] / report["dense_perplexity"] - 1)
    within = [p["target"] for p in report["points"] if p["vs_dense"] <= 0.05]
    assert report["largest_within_tolerance"] == max(within, default=None)
    assert report["meta"]["config"]["targets"] == [0.6, 0.2] and report["meta"]["git"]["sha"]
    md = (out / "sweep.md").read_text()
    assert "| 60% |" in md and "Largest target within 5.0% of dense" in md
    assert (out / "sweep.png").stat().st_size > 10_000


def test_a_sweep_below_a_relu_models_own_sparsity_costs_nothing(relu2_export, tmp_path):
    """A layer already sparser than the target keeps its exact zeros (threshold 0), so the
    model computes what dense computes, to the bit."""
    from studies import locality

    out = tmp_path / "out"
    assert locality.main(["sweep", "--model", str(relu2_export), "--seq-len", "32",
                          "--tokens", "512", "--targets", "0.2", "--out", str(out)]) == 0
    report = json.loads((out / "sweep.json").read_text())
    (point,) = report["points"]
    assert point["thresholds"] == [0.0, 0.0] and point["held_out_sparsity"] > 0.2
    assert point["perplexity"] == report["dense_perplexity"] and point["vs_dense"] == 0
    assert report["largest_within_tolerance"] == 0.2


@pytest.mark.parametrize("args, needle", [
    (["--targets", "1"], "--targets: '1': must be in (0, 1)"),
    (["--targets", "x"], "--targets: 'x': expected a number"),
    (["--threshold", "0.1"], "unrecognized arguments: --threshold"),
])
def test_bad_sweep_input_is_refused_in_one_line(relu2_export, args, needle):
    result = subprocess.run([sys.executable, "-m", "studies.locality", "sweep", "--model",
                             str(relu2_export), *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert needle in result.stderr, result.stderr[-2000:]


@pytest.fixture(scope="module")
def drelu_with_predictors(tmp_path_factory):
    """A drelu model's export and the predictors the command trains for it (tiny, fast)."""
    tokenizer = get_tokenizer("bpe", vocab_size=512)
    torch.manual_seed(0)
    model = Transformer(preset("tiny-mha", ffn="drelu", vocab_size=len(tokenizer)))
    export = save_export(model, tmp_path_factory.mktemp("bench") / "export", tokenizer=tokenizer)
    result = subprocess.run(
        [sys.executable, "-m", "studies.locality", "predictors", "--model", str(export), "--tokens",
         "2048", "--held-out-tokens", "512", "--seq-len", "32", "--ranks", "16", "--steps", "60",
         "--tolerance", "10"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return export


@pytest.mark.slow
def test_the_benchmark_measures_every_mode_of_a_relu_family_model(drelu_with_predictors, tmp_path):
    """benchmarks/activation_locality.py --quick, end to end: every mode at each batch with a
    speedup against dense, the exact modes' perplexity equal to dense's, the predictors found
    where the command wrote them, and the lm-eval tasks scored under each mask."""
    result = subprocess.run(
        [sys.executable, "benchmarks/activation_locality.py", "--model", str(drelu_with_predictors),
         "--quick", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "activation_locality_quick.json").read_text())
    [model] = report["models"]
    assert model["predictors"].endswith("locality/predictors.safetensors")
    made = model["predictors_provenance"]  # what was timed, and the command that made it
    assert made["sha256"] == hashlib.sha256(Path(model["predictors"]).read_bytes()).hexdigest()
    assert made["made_by"]["command"][-2:] == ["--tolerance", "10"]
    cells = {(r["mode"], r["batch"]): r for r in model["speed"]}
    for r in cells.values():  # each repeat's ratio to the dense run beside it
        dense = cells[("dense", r["batch"])]["runs"]
        assert r["paired_vs_dense"]["ratios"] == pytest.approx([a / b for a, b in zip(r["runs"], dense)])
        assert r["paired_vs_dense"]["median"] == pytest.approx(statistics.median(
            r["paired_vs_dense"]["ratios"]))
    assert set(cells) == {(m, b) for m in ("dense", "gate", "oracle", "predicted") for b in (1, 4)}
    assert all(r["speedup_vs_dense"] > 0 and 0 < r["density"] <= 1 for r in cells.values())
    assert cells[("dense", 1)]["speedup_vs_dense"] == 1 and cells[("gate", 1)]["density"] < 1
    assert cells[("gate", 1)]["weight_bytes_per_token"] < cells[("dense", 1)]["weight_bytes_per_token"]
    ppl = {r["mode"]: r for r in model["quality"]}
    for exact in ("gate", "oracle"):  # exact for the ReLU family: the same perplexity
        assert ppl[exact]["perplexity"] == pytest.approx(ppl["dense"]["perplexity"], rel=1e-5)
    assert set(ppl["predicted"]["lm_eval"]) >= {"corpus_cloze/acc", "mqar_recall/acc"}
    assert 0 <= model["hot"]["hot_hit_rate"] <= 1 and 0 < model["hot"]["recall"] <= 1
    assert "speedup" in (tmp_path / "activation_locality_quick.md").read_text()


@pytest.mark.slow
def test_the_benchmark_calibrates_a_swiglu_models_thresholds_for_a_target_sparsity(
        swiglu_export, tmp_path):
    result = subprocess.run(
        [sys.executable, "benchmarks/activation_locality.py", "--model", str(swiglu_export),
         "--quick", "--skip-lm-eval", "--swiglu-sparsity", "0.5", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    [model] = json.loads((tmp_path / "activation_locality_quick.json").read_text())["models"]
    assert model["sparsity"] == 0.5 and len(model["threshold"]) == 2
    cells = {(r["mode"], r["batch"]): r for r in model["speed"]}
    assert set(cells) == {(m, b) for m in ("dense", "gate") for b in (1, 4)}
    assert 0.35 < cells[("gate", 1)]["density"] < 0.65  # half the neurons, on other text
    assert "per-layer thresholds" in (tmp_path / "activation_locality_quick.md").read_text()


@pytest.mark.slow
def test_an_interrupted_benchmark_keeps_the_models_it_finished(drelu_with_predictors, tmp_path):
    """Stopped while measuring its second model, the benchmark has kept the first (with when,
    where and under what load it was measured); run again, it measures only the second."""
    other = tmp_path / "other"
    shutil.copytree(drelu_with_predictors, other)  # a second model, its predictors with it
    out = tmp_path / "out"
    cmd = [sys.executable, "benchmarks/activation_locality.py", "--model", str(drelu_with_predictors),
           "--model", str(other), "--quick", "--skip-lm-eval", "--out", str(out)]
    first = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    for line in first.stdout:
        if line.split(" ", 1)[-1].startswith(f"{other}:"):  # the second model has begun
            first.kill()
            break
    first.wait(timeout=60)
    partial = out / "activation_locality_quick.json.partial"
    kept = json.loads(partial.read_text())
    assert [m["model"] for m in kept["models"]] == [str(drelu_with_predictors)]
    assert set(kept["models"][0]["measured"]) == {"time_utc", "git", "load"}
    assert not (out / "activation_locality_quick.json").exists()  # nothing half-written
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{drelu_with_predictors}: kept from an interrupted run" in again.stdout
    assert f"{other}: drelu" in again.stdout  # measured
    report = json.loads((out / "activation_locality_quick.json").read_text())
    assert [m["model"] for m in report["models"]] == [str(drelu_with_predictors), str(other)]
    assert report["models"][0] == kept["models"][0] and not partial.exists()
    assert "Measured " in (out / "activation_locality_quick.md").read_text()
    # --add: the second model measured again into the same record, the first kept as it was
    added = subprocess.run([*cmd[:2], "--model", str(other), *cmd[6:], "--add"], cwd=ROOT,
                           capture_output=True, text=True, timeout=900)
    assert added.returncode == 0, added.stderr[-3000:]
    record = json.loads((out / "activation_locality_quick.json").read_text())
    assert [m["model"] for m in record["models"]] == [str(drelu_with_predictors), str(other)]
    assert record["models"][0] == report["models"][0]
    assert record["models"][1]["measured"] != report["models"][1]["measured"]
    assert record["earlier_commands"] == [report["command"]]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("activation_locality",
                                                  ROOT / "benchmarks" / "activation_locality.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_benchmark_keeps_nothing_made_with_other_settings(tmp_path):
    bench = load_benchmark()
    partial = tmp_path / "activation_locality.json.partial"
    partial.write_text(json.dumps({"settings": {"repeats": 3}, "models": [{"model": "m"}]}))
    said = []
    assert bench.kept_models(partial, {"repeats": 3}, False, said.append) == {"m": {"model": "m"}}
    assert bench.kept_models(partial, {"repeats": 3}, True, said.append) == {}  # --fresh
    assert bench.kept_models(partial, {"repeats": 5}, False, said.append) == {}
    partial.write_text("{not json")
    assert bench.kept_models(partial, {"repeats": 3}, False, said.append) == {}
    assert "other settings" in said[0] and "unreadable" in said[1]
    run = subprocess.run([sys.executable, "benchmarks/activation_locality.py", "--model", "a",
                          "--model", "a"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "each model once" in run.stderr and "Traceback" not in run.stderr


def test_add_keeps_the_records_other_models_and_refuses_other_settings(tmp_path):
    """--add: the record's models not measured now are kept, in order, those measured now are
    dropped (to be replaced), and a record made with other settings, or not a record, is refused
    with a one-line error that names what differs, leaving it as it was."""
    bench = load_benchmark()
    record = tmp_path / "activation_locality.json"
    assert bench.recorded_models(record, {"repeats": 3}, ["a"]) == ([], [])  # none yet
    record.write_text(json.dumps({"settings": {"repeats": 3}, "command": ["first"],
                                  "models": [{"model": "a"}, {"model": "b"}, {"model": "c"}]}))
    kept, commands = bench.recorded_models(record, {"repeats": 3}, ["b"])
    assert kept == [{"model": "a"}, {"model": "c"}] and commands == [["first"]]
    with pytest.raises(ValueError, match=r"other settings \(repeats\)"):
        bench.recorded_models(record, {"repeats": 5}, ["b"])
    before = record.read_text()
    run = subprocess.run([sys.executable, "benchmarks/activation_locality.py", "--model", "b",
                          "--add", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "other settings" in run.stderr and "Traceback" not in run.stderr
    assert record.read_text() == before
    record.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a benchmark record"):
        bench.recorded_models(record, {"repeats": 3}, ["b"])
