"""Activation-locality decoding in the serving engine (`LLM(..., ffn_sparsity=...)`,
`python -m serve --ffn-sparsity`): the same greedy tokens as dense decoding under continuous
batching, for every ReLU-family MLP; bad settings refused before a model is loaded."""

from __future__ import annotations

import subprocess
import sys

import pytest
import safetensors.torch
import torch

from egmla.models.sparse_ffn import LayerPredictor, predictors_to_tensors
from egmla.presets import preset
from serve import LLM, SamplingParams
from support import ROOT
from support.models import build, decode, exact_predictor, random_ids

PROMPTS = [[5, 9, 2, 7], [1, 2, 3], [30, 31, 32, 33, 34, 35], [8]]


def greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("mode", ["gate", "oracle"])
@pytest.mark.parametrize("ffn", ["reglu", "drelu", "relu2"])
def test_sparse_serving_decodes_what_dense_serving_does(ffn, mode):
    cfg = preset("tiny-gqa2", ffn=ffn)
    dense = greedy(LLM(build(cfg), num_blocks=32, block_size=4))
    llm = LLM(build(cfg), num_blocks=32, block_size=4, ffn_sparsity=mode)
    assert greedy(llm) == dense
    stats = [block.mlp.sparse.stats for block in llm.model.layers]
    assert stats[0]["steps"] > 0  # the decode steps ran sparse...
    assert all(s["active"] < s["steps"] * s["neurons"] for s in stats)  # ...and skipped neurons


def save_predictors(model, path, hot: int = 0, threshold: float = 0.0, seed: int = 0):
    """Exact predictors for `model`, as `python -m studies.locality predictors` saves them: for its
    neurons in a random order (which loading must apply: a predictor of reordered neurons
    read against the original order mispredicts)."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for block in model.layers:
        order = torch.randperm(block.mlp.w_up.out_features, generator=g)
        layers.append(LayerPredictor(exact_predictor(block.mlp, order), order, hot))
    tensors, metadata = predictors_to_tensors(layers, threshold)
    safetensors.torch.save_file(tensors, str(path), metadata)
    return path


@pytest.mark.parametrize("ffn", ["reglu", "drelu", "relu2"])
def test_predicted_serving_with_exact_predictors_decodes_what_dense_serving_does(ffn, tmp_path):
    cfg = preset("tiny-gqa2", ffn=ffn)
    dense = greedy(LLM(build(cfg), num_blocks=32, block_size=4))
    path = save_predictors(build(cfg), tmp_path / "predictors.safetensors", hot=8)
    llm = LLM(build(cfg), num_blocks=32, block_size=4, ffn_sparsity="predicted",
              ffn_predictors=path)
    assert greedy(llm) == dense
    stats = [block.mlp.sparse.stats for block in llm.model.layers]
    assert all(0 < s["active"] < s["steps"] * s["neurons"] for s in stats)
    ids = random_ids(cfg, 2, 12)  # the loaded model decodes the dense model's logits (float64)
    with torch.no_grad():
        reference = build(cfg)(ids)
    assert (decode(llm.model, ids, prompt=5) - reference).abs().max().item() < 1e-12


def test_predictors_read_against_the_wrong_neuron_order_change_the_logits(tmp_path):
    """The check above can fail: the same file with the order left out mispredicts."""
    cfg = preset("tiny-gqa2", ffn="reglu")
    path = save_predictors(build(cfg), tmp_path / "predictors.safetensors")
    tensors = safetensors.torch.load_file(str(path))
    for i in range(cfg.n_layers):
        tensors[f"layer{i}.order"] = torch.arange(tensors[f"layer{i}.order"].numel())
    safetensors.torch.save_file(tensors, str(path), {"format": "egmla.predictors/1"})
    llm = LLM(build(cfg), num_blocks=32, block_size=4, ffn_sparsity="predicted",
              ffn_predictors=path)
    ids = random_ids(cfg, 2, 12)
    with torch.no_grad():
        reference = build(cfg)(ids)
    assert (decode(llm.model, ids, prompt=5) - reference).abs().max().item() > 1e-3


def test_predictors_that_do_not_fit_the_model_are_refused_by_name(tmp_path):
    cfg = preset("tiny-gqa2", ffn="reglu")
    other = save_predictors(build(preset("tiny-gqa2", ffn="reglu", d_ff=48)), tmp_path / "a")
    with pytest.raises(ValueError, match="predictors for 48 neurons, the model's MLPs have"):
        LLM(build(cfg), ffn_sparsity="predicted", ffn_predictors=other)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        (tmp_path / "junk").write_bytes(b"not safetensors")
        LLM(build(cfg), ffn_sparsity="predicted", ffn_predictors=tmp_path / "junk")
    at = save_predictors(build(cfg), tmp_path / "b", threshold=0.25)
    with pytest.raises(ValueError, match="trained for the threshold 0.25"):
        LLM(build(cfg), ffn_sparsity="predicted", ffn_predictors=at, ffn_threshold=0.5)
    llm = LLM(build(cfg), ffn_sparsity="predicted", ffn_predictors=at)  # the file's threshold
    assert llm.model.layers[0].mlp.sparse.threshold == 0.25


def test_per_layer_thresholds_travel_in_the_predictors_file(tmp_path):
    cfg = preset("tiny-gqa2")  # SwiGLU: predicted mode keeps only neurons above the threshold
    thresholds = [0.01 * (i + 1) for i in range(cfg.n_layers)]
    at = save_predictors(build(cfg), tmp_path / "p", threshold=thresholds)
    llm = LLM(build(cfg), ffn_sparsity="predicted", ffn_predictors=at)
    assert [b.mlp.sparse.threshold for b in llm.model.layers] == thresholds
    llm = LLM(build(cfg), ffn_sparsity="predicted", ffn_predictors=at, ffn_threshold=thresholds)
    assert [b.mlp.sparse.threshold for b in llm.model.layers] == thresholds
    with pytest.raises(ValueError, match="were trained for the threshold \\[0.01"):
        LLM(build(cfg), ffn_sparsity="predicted", ffn_predictors=at, ffn_threshold=0.01)
    tensors = safetensors.torch.load_file(str(at))
    for bad, message in (("[0.1]", "1 per-layer thresholds; the model has"),
                         ("[0.1, null]", "the file's threshold\\[1\\]=None"),
                         ("half", "threshold 'half': not a number or a list of numbers")):
        safetensors.torch.save_file(tensors, str(tmp_path / "bad"),
                                    {"format": "egmla.predictors/1", "threshold": bad})
        with pytest.raises(ValueError, match=message):
            LLM(build(cfg), ffn_sparsity="predicted", ffn_predictors=tmp_path / "bad")


@pytest.mark.parametrize("kwargs, message", [
    ({"ffn_sparsity": "predicted"}, "takes ffn_predictors"),
    ({"ffn_sparsity": "gate", "ffn_predictors": "p.safetensors"}, "and only it does"),
    ({"ffn_sparsity": "predicted", "ffn_predictors": "/nonexistent/p.safetensors"}, "missing"),
    ({"ffn_sparsity": "sometimes"}, "ffn_sparsity='sometimes'"),
    ({"ffn_sparsity": "gate", "ffn_threshold": -0.5}, "ffn_threshold=-0.5"),
    ({"ffn_sparsity": "gate", "ffn_threshold": float("nan")}, "ffn_threshold=nan"),
    ({"ffn_threshold": 0.1}, "needs an ffn_sparsity mode"),
    ({"ffn_sparsity": "gate", "ffn_threshold": [0.1, True]}, "ffn_threshold\\[1\\]=True"),
    ({"ffn_threshold": [0.0, 0.2]}, "needs an ffn_sparsity mode"),
])
def test_bad_settings_fail_before_loading(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path / "never-loaded"), **kwargs)


def test_a_swiglu_model_needs_a_threshold():
    with pytest.raises(ValueError, match="SwiGLU MLP is not sparse"):
        LLM(build(preset("tiny-gqa2"), dtype=torch.float32), ffn_sparsity="gate")
    llm = LLM(build(preset("tiny-gqa2"), dtype=torch.float32), ffn_sparsity="gate",
              ffn_threshold=0.01)
    assert len(greedy(llm)[0]) == 20


def test_the_server_flag_takes_one_threshold_or_one_per_layer():
    from serve.__main__ import build_parser

    parse = build_parser().parse_args
    assert parse(["--model", "m", "--ffn-threshold", "0.05"]).ffn_threshold == 0.05
    assert parse(["--model", "m", "--ffn-threshold", "0.1, 0.2"]).ffn_threshold == [0.1, 0.2]
    run = subprocess.run([sys.executable, "-m", "serve", "--model", "m", "--ffn-threshold",
                          "0.1,x"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 2 and "--ffn-threshold: 'x': not a number" in run.stderr


def test_the_server_flag_refuses_a_swiglu_model_without_a_threshold(tmp_path):
    from egmla.checkpoint import save_export
    from egmla.models import Transformer

    torch.manual_seed(0)
    export = save_export(Transformer(preset("tiny-mha")), tmp_path / "export")
    run = subprocess.run([sys.executable, "-m", "serve", "--model", str(export), "--ffn-sparsity",
                          "gate"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "SwiGLU MLP is not sparse" in run.stderr
