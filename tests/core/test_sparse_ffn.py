"""Activation-locality decoding (egmla.models.sparse_ffn): computing only the neurons that fire
equals the dense MLP exactly for the ReLU family, in a whole model's prefill + decode; reordering
the neurons leaves the model's function unchanged; SwiGLU's thresholded form is what it says."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from egmla import kernels
from egmla.models import FeedForward
from egmla.models.sparse_ffn import (Predictor, attach, calibrate_thresholds, detach,
                                     firing, firing_score, permute_neurons, sparsify)
from egmla.presets import preset
from support import ops_called
from support.models import build, decode, exact_predictor, random_ids

RELU_FAMILY = ("reglu", "drelu", "relu2")
SUPPORTED = kernels.unsupported() is None


@pytest.mark.parametrize("mode", ["gate", "oracle"])
@pytest.mark.parametrize("ffn", RELU_FAMILY)
@pytest.mark.parametrize("base", ["tiny-gqa2", "tiny-mla"])
def test_sparse_decode_equals_dense_decode_in_float64(base, ffn, mode):
    cfg = preset(base, ffn=ffn)
    model, ids = build(cfg), random_ids(cfg, 3, 14)
    with torch.no_grad():
        dense = model(ids)
    sparse = [attach(block.mlp, mode) for block in model.layers]
    got = decode(model, ids, prompt=6)  # 3 x 6 rows: more than MAX_ROWS, a dense prefill
    assert (got - dense).abs().max().item() < 1e-12
    assert sparse[0].stats["steps"] == 14 - 6  # every decode step took the sparse path
    assert all(0 < s.density() < 0.9 for s in sparse)  # and skipped some neurons


@pytest.mark.parametrize("ffn", RELU_FAMILY)
def test_the_sparse_path_computes_only_the_neurons_that_fire(ffn):
    torch.manual_seed(0)
    mlp = FeedForward(32, 256, ffn).double().eval()
    sparse = attach(mlp, "gate")
    x = torch.randn(1, 32, dtype=torch.float64)
    with torch.no_grad():
        fired = (mlp.hidden(x) != 0).sum().item()
        idx, _ = sparse.active(x)
        mlp(x)
    # gate (relu2: up) > 0 is the set; drelu's up may still zero some of it
    assert fired <= idx.numel() < 256
    assert ffn == "drelu" or fired == idx.numel()
    assert sparse.stats["active"] == idx.numel()


def test_a_batch_computes_the_union_of_its_rows_neurons():
    torch.manual_seed(0)
    mlp = FeedForward(32, 256, "reglu").double().eval()
    sparse = attach(mlp, "gate")
    x = torch.randn(8, 32, dtype=torch.float64)
    with torch.no_grad():
        union = (mlp.hidden(x) != 0).any(0).sum().item()
        one = (mlp.hidden(x[:1]) != 0).sum().item()
        assert union == sparse.active(x)[0].numel() > one
        got = mlp(x)
        detach(mlp)
        assert (got - mlp(x)).abs().max().item() < 1e-12


@pytest.mark.parametrize("ffn", ["swiglu", *RELU_FAMILY])
def test_reordering_the_neurons_leaves_the_model_unchanged(ffn):
    cfg = preset("tiny-gqa2", ffn=ffn)
    model, ids = build(cfg), random_ids(cfg, 2, 12)
    with torch.no_grad():
        before = model(ids)
        d_ff = cfg.d_ff
        for i, block in enumerate(model.layers):
            order = torch.randperm(d_ff, generator=torch.Generator().manual_seed(i))
            gate = None if block.mlp.w_gate is None else block.mlp.w_gate.weight[order[0]].clone()
            permute_neurons(block.mlp, order)
            if gate is not None:  # neuron order[0] is now neuron 0
                assert torch.equal(block.mlp.w_gate.weight[0], gate)
        after = model(ids)
    assert (after - before).abs().max().item() < 1e-12


@pytest.mark.parametrize("order", [torch.arange(5), torch.zeros(192, dtype=torch.long),
                                   torch.arange(1, 193)])
def test_a_non_permutation_is_refused(order):
    mlp = FeedForward(64, 192, "reglu")
    with pytest.raises(ValueError, match="permutation of range\\(192\\)"):
        permute_neurons(mlp, order)


def test_swiglu_needs_a_threshold_and_then_computes_the_thresholded_mlp():
    torch.manual_seed(0)
    mlp = FeedForward(32, 128, "swiglu").double().eval()
    with pytest.raises(ValueError, match="SwiGLU MLP is not sparse"):
        attach(mlp, "gate")
    x = torch.randn(2, 32, dtype=torch.float64)
    t = 0.1
    with torch.no_grad():
        gate, up = mlp.w_gate(x), mlp.w_up(x)
        h = F.silu(gate) * up * (F.silu(gate).abs() > t)
        expected = mlp.w_down(h)
        sparse = attach(mlp, "gate", threshold=t)
        got = mlp(x)
    assert (got - expected).abs().max().item() < 1e-12
    assert 0 < sparse.density() < 1


@pytest.mark.parametrize("sparsity", [0.3, 0.5, 0.8])
def test_calibrated_thresholds_skip_the_target_share_of_each_layers_neurons(sparsity):
    cfg = preset("tiny-gqa2")  # SwiGLU
    model, ids = build(cfg), random_ids(cfg, 4, 32)
    thresholds = calibrate_thresholds(model, ids.split(2), sparsity)
    assert len(thresholds) == cfg.n_layers and len(set(thresholds)) == cfg.n_layers
    inputs = []  # each MLP's input on the calibration tokens, to measure what fires there
    hooks = [b.mlp.register_forward_pre_hook(lambda m, a: inputs.append((m, a[0])))
             for b in model.layers]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    for (mlp, x), t in zip(inputs, thresholds):
        with torch.no_grad():
            skipped = 1 - firing(mlp, x, t).double().mean().item()
            scores = firing_score(mlp, x)
        # the share at or below each threshold is the target, to one (token, neuron) pair
        assert abs(skipped - sparsity) <= 1 / scores.numel() + 1e-12
    higher = calibrate_thresholds(model, ids.split(2), min(0.95, sparsity + 0.1))
    assert all(b > a for a, b in zip(thresholds, higher))


def test_a_relu_layer_sparser_than_the_target_keeps_its_exact_zeros():
    cfg = preset("tiny-gqa2", ffn="reglu")
    model = build(cfg)
    assert calibrate_thresholds(model, random_ids(cfg, 2, 16).split(1), 0.1) == [0.0] * cfg.n_layers
    with pytest.raises(ValueError, match="sparsity=1.0: must be a number in \\(0, 1\\)"):
        calibrate_thresholds(model, [], 1.0)


def test_per_layer_thresholds_reach_each_layers_sparse_mlp():
    cfg = preset("tiny-gqa2")
    model = build(cfg)
    thresholds = [0.02 * (i + 1) for i in range(cfg.n_layers)]
    attached = sparsify(model, "gate", thresholds)
    assert [s.threshold for s in attached] == thresholds
    x = torch.randn(3, cfg.d_model, dtype=torch.float64)
    for block, t in zip(model.layers, thresholds):
        mlp = block.mlp
        with torch.no_grad():
            expected = mlp.w_down(mlp.hidden(x) * firing(mlp, x, t))
            got = mlp(x)
        assert (got - expected).abs().max().item() < 1e-12
    with pytest.raises(ValueError, match=f"threshold: 1 per-layer thresholds; the model has "
                                         f"{cfg.n_layers} layers"):
        sparsify(model, "gate", [0.1])
    with pytest.raises(ValueError, match="ffn_threshold\\[1\\]=-1"):
        sparsify(model, "gate", [0.1, -1] + [0.1] * (cfg.n_layers - 2))


def test_the_fused_decode_kernel_takes_the_mlp_sparse_where_sparse_decoding_runs():
    mlp = FeedForward(32, 128, "swiglu")
    assert mlp.kernel(1).sparse is None and mlp.kernel(1).activation == "swiglu"
    attach(mlp, "gate", threshold=0.05, max_rows=4)
    assert mlp.kernel(4).sparse.threshold == 0.05
    assert mlp.kernel(5).sparse is None  # more rows than sparse decoding takes: dense
    attach(mlp, "oracle")
    assert mlp.kernel(1) is None  # a dense pass decides: the modules run


SPARSE_CASES = [("reglu", "gate", 0.0), ("drelu", "gate", 0.0), ("relu2", "gate", 0.0),
                ("swiglu", "gate", 0.05), ("reglu", "predicted", 0.0), ("drelu", "predicted", 0.0),
                ("relu2", "predicted", 0.0), ("swiglu", "predicted", 0.05)]


@pytest.mark.skipif(not SUPPORTED, reason="the kernels need x86-64 with AVX2 and FMA")
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("ffn, mode, threshold, hot", [
    *[(*case, 32 if case[1] == "predicted" else 0) for case in SPARSE_CASES],
    ("drelu", "predicted", 0.0, 256)])  # every neuron hot: the kernel scores none
def test_the_sparse_kernel_computes_what_the_pytorch_path_does(ffn, mode, threshold, hot, rows):
    """egmla.kernels.sparse_mlp (float32) against SparseDecode's PyTorch path (float64): the same
    neurons computed and the same output to float32's rounding; a predictor that misses
    neurons (a random one) and a hot block, so that predicted mode is not simply exact."""
    torch.manual_seed(0)
    mlp = FeedForward(64, 256, ffn).eval()
    reference = FeedForward(64, 256, ffn).double().eval()
    reference.load_state_dict(mlp.state_dict())
    predictor = None
    if mode == "predicted":
        predictor = Predictor(torch.randn(8, 64), torch.randn(256, 8), torch.full((256,), -2.0))
    kwargs = {"threshold": threshold, "predictor": predictor, "hot": hot}
    fast = attach(mlp, mode, **kwargs)
    slow = attach(reference, mode, **{**kwargs, "predictor": predictor and Predictor(
        predictor.w1.double(), predictor.w2.double(), predictor.bias.double())})
    x = torch.randn(rows, 64)
    with torch.no_grad():
        ops = ops_called(lambda: mlp(x))
        got, expected = mlp(x), reference(x.double())
    assert "egmla::sparse_mlp" in ops
    assert fast.stats["active"] == 2 * slow.stats["active"]  # fast ran twice, the same neurons
    assert (got.double() - expected).abs().max().item() < 1e-5 * expected.abs().max().item()
    assert 0 < slow.density() < 1 or rows > 1 or hot == 256  # a batch's union may cover all


@pytest.mark.parametrize("kwargs, message", [({"mode": "predicted"}, "mode='predicted'"),
                                             ({"threshold": -1}, "threshold=-1"),
                                             ({"threshold": "0.1"}, "threshold='0.1'")])
def test_bad_settings_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        attach(FeedForward(16, 64, "reglu"), **kwargs)


def test_training_and_prefill_stay_dense():
    torch.manual_seed(0)
    mlp = FeedForward(16, 64, "relu2")
    sparse = attach(mlp, "gate", max_rows=4)
    x = torch.randn(3, 16, requires_grad=True)
    mlp(x).sum().backward()  # grad wanted: dense
    with torch.no_grad():
        mlp(torch.randn(5, 16))  # more rows than max_rows: dense
    assert sparse.stats["steps"] == 0 and x.grad is not None


@pytest.mark.parametrize("ffn", RELU_FAMILY)
def test_predicted_mode_with_an_exact_predictor_equals_dense(ffn):
    cfg = preset("tiny-gqa2", ffn=ffn)
    model, ids = build(cfg), random_ids(cfg, 3, 14)
    with torch.no_grad():
        dense = model(ids)
    sparse = [attach(b.mlp, "predicted", predictor=exact_predictor(b.mlp)) for b in model.layers]
    assert (decode(model, ids, prompt=6) - dense).abs().max().item() < 1e-12
    assert all(0 < s.density() < 0.9 for s in sparse)


def test_predicted_mode_computes_the_hot_block_and_what_the_predictor_adds():
    torch.manual_seed(0)
    mlp = FeedForward(32, 96, "reglu").double().eval()
    x = torch.randn(3, 32, dtype=torch.float64)
    never = Predictor(torch.zeros(4, 32, dtype=torch.float64), torch.zeros(96, 4, dtype=torch.float64),
                      torch.full((96,), -1.0, dtype=torch.float64))  # predicts nothing fires
    with torch.no_grad():
        h = mlp.hidden(x)
        for hot in (0, 40, 96):
            attach(mlp, "predicted", predictor=never, hot=hot)
            expected = h[:, :hot] @ mlp.w_down.weight[:, :hot].t()
            assert (mlp(x) - expected).abs().max().item() < 1e-12, hot


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "predicted"}, "takes a predictor"),
    ({"mode": "gate", "predictor": Predictor(torch.zeros(2, 16), torch.zeros(64, 2), torch.zeros(64))},
     "takes a predictor, and only it does"),
    ({"mode": "predicted", "predictor": Predictor(torch.zeros(2, 16), torch.zeros(32, 2),
                                                  torch.zeros(32))}, "scores 32 neurons, the MLP has 64"),
    ({"mode": "gate", "hot": 65}, "hot=65"),
])
def test_bad_predicted_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        attach(FeedForward(16, 64, "reglu"), **kwargs)


def test_a_predictor_whose_shapes_do_not_chain_is_refused():
    with pytest.raises(ValueError, match="do not chain"):
        Predictor(torch.zeros(4, 16), torch.zeros(64, 5), torch.zeros(64))
