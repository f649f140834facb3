"""The MLP activations (ModelConfig.ffn): each computes its formula, the ReLU family is exactly
sparse, the default widths give every activation the same parameters, and bad values are
refused by name."""

from __future__ import annotations

import pytest
import torch

from egmla.config import ConfigError, ModelConfig
from egmla.models import FeedForward, Transformer

ACTIVATIONS = ("swiglu", "reglu", "drelu", "relu2")


def reference(ffn: str, x, gate, up, down):
    """The formulas, written out on the raw weights: down @ h, h from x @ gate.T, x @ up.T."""
    u = x @ up.T
    if ffn == "relu2":
        h = torch.clamp(u, min=0) ** 2
    else:
        g = x @ gate.T
        h = {"swiglu": g * torch.sigmoid(g) * u,
             "reglu": torch.clamp(g, min=0) * u,
             "drelu": torch.clamp(g, min=0) * torch.clamp(u, min=0)}[ffn]
    return h @ down.T, h


@pytest.mark.parametrize("ffn", ACTIVATIONS)
@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_each_activation_computes_its_formula(ffn, rows, dtype, tol):
    """float64 against the formula in float64; float32 (one row: egmla's CPU kernel) too."""
    torch.manual_seed(0)
    mlp = FeedForward(24, 40, ffn).eval()
    x = torch.randn(rows, 24)
    weights = [None if w is None else w.weight.double() for w in (mlp.w_gate, mlp.w_up, mlp.w_down)]
    expected, hidden = reference(ffn, x.double(), *weights)
    mlp, x = mlp.to(dtype), x.to(dtype)
    with torch.no_grad():
        assert (mlp(x).double() - expected).abs().max().item() < tol
        assert (mlp.hidden(x).double() - hidden).abs().max().item() < tol


@pytest.mark.parametrize("ffn", ["reglu", "drelu", "relu2"])
def test_the_relu_family_is_exactly_sparse_and_swiglu_is_not(ffn):
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    with torch.no_grad():
        share = (FeedForward(32, 128, ffn).hidden(x) == 0).float().mean().item()
        dense = (FeedForward(32, 128, "swiglu").hidden(x) == 0).float().mean().item()
    # random weights: half the pre-activations are negative; drelu needs both of two positive
    low, high = {"reglu": (0.4, 0.6), "relu2": (0.4, 0.6), "drelu": (0.65, 0.85)}[ffn]
    assert low < share < high
    assert dense < 0.01


def test_relu2_has_no_gate_matrix():
    mlp = FeedForward(16, 48, "relu2")
    assert mlp.w_gate is None
    assert set(mlp.state_dict()) == {"w_up.weight", "w_down.weight"}


@pytest.mark.parametrize("d_model", [64, 384, 576])
def test_default_widths_give_every_activation_the_same_parameters(d_model):
    counts = {ffn: ModelConfig(vocab_size=256, d_model=d_model, n_layers=2, n_heads=4,
                               ffn=ffn).num_params() for ffn in ACTIVATIONS}
    assert len(set(counts.values())) == 1, counts


@pytest.mark.parametrize("ffn", ACTIVATIONS)
def test_analytic_parameters_equal_the_built_model(ffn):
    config = ModelConfig(vocab_size=256, d_model=48, n_layers=2, n_heads=4, d_ff=80, ffn=ffn,
                         tie_embeddings=False)
    assert Transformer(config).num_params() == config.num_params()


@pytest.mark.parametrize("bad", ["gelu", "SwiGLU", "", 3])
def test_an_unknown_activation_is_refused_by_name(bad):
    with pytest.raises(ConfigError, match=f"model.ffn={bad!r}: must be one of"):
        ModelConfig(vocab_size=256, d_model=48, n_layers=2, n_heads=4, ffn=bad)
