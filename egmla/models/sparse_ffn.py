"""Activation-locality decoding of an MLP (PowerInfer's idea), in plain PyTorch.

In a ReLU-family MLP (egmla.models.layers.FeedForward: reglu, drelu, relu2) a neuron whose
deciding pre-activation is <= 0 (the gate's; relu2's up, which has no gate) contributes exactly
nothing to the output, and for one token most neurons are such. A decode step can then compute
the deciding projection and skip the rest of the MLP for the neurons that do not fire:

    y = sum over active neurons i of h_i(x) * w_down[:, i]

`SparseDecode(mlp, mode=...)`, attached with `attach(mlp, ...)`, computes `mlp(x)` that way for
the few rows of a decode step; training, prefill and larger batches keep the dense path. Modes:

- `"gate"`: the deciding projection for every neuron (dense), then the rest of the MLP (up, for
  the gated kinds, and down) only for the neurons where it is above `threshold` in some row of x
  (the union over the rows: a batch computes what any of its rows needs). With threshold 0 this
  is exact for the ReLU family. For SwiGLU a threshold on |silu(gate)| > 0 is the training-free
  approximation of TEAL / CATS, not exact; `calibrate_thresholds` sets one per layer for a
  target sparsity, as CATS does.
- `"oracle"`: the active set taken from a dense pass (every neuron with h != 0 in some row), then
  the sparse computation over it: exact, and slower than dense; it checks the sparse arithmetic
  and is the ideal a predictor is measured against.
- `"predicted"`: the first `hot` neurons (after `permute_neurons`, the most frequent) always,
  and the others where a `Predictor` says they fire in some row; each computed neuron's h is
  exact, a missed one is lost: an approximation whose quality is the predictor's recall.

`permute_neurons(mlp, order)` reorders the hidden neurons in place (rows of w_gate and w_up,
columns of w_down), which leaves the function unchanged: with the most frequently active neurons
first, a hot set is a contiguous block (a dense slice, no gather).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Union

import torch
import torch.nn.functional as F
from torch import nn

from egmla import kernels
from egmla.models.layers import FeedForward

Mode = Literal["gate", "oracle", "predicted"]
MODES = ("gate", "oracle", "predicted")
MAX_ROWS = 16  # rows (decode sequences) up to which the sparse path is taken; dense above
# A firing threshold: one for every layer, or one per layer (as `calibrate_thresholds` sets them)
Threshold = Union[float, Sequence[float]]


def _one_threshold(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0 <= value < float("inf")):
        raise ValueError(f"{name}={value!r}: must be a finite number >= 0")
    return float(value)


def layer_thresholds(threshold: Threshold, n_layers: int, name: str = "threshold") -> list[float]:
    """Each layer's threshold: `threshold` for all, or its per-layer list (which must have
    `n_layers` entries); ValueError naming a bad value."""
    if isinstance(threshold, (list, tuple)):
        if len(threshold) != n_layers:
            raise ValueError(f"{name}: {len(threshold)} per-layer thresholds; the model has "
                             f"{n_layers} layers")
        return [_one_threshold(t, f"{name}[{i}]") for i, t in enumerate(threshold)]
    return [_one_threshold(threshold, name)] * n_layers


def firing_score(mlp, x: torch.Tensor) -> torch.Tensor:
    """(..., d_ff): the score a threshold applies to, per neuron: |silu(gate)| for SwiGLU, the
    gate pre-activation for the gated ReLU family, up for relu2 (which has no gate)."""
    if mlp.w_gate is None:
        return mlp.w_up(x)
    score = mlp.w_gate(x)
    return F.silu(score).abs() if mlp.activation == "swiglu" else score


def firing(mlp, x: torch.Tensor, threshold: float = 0.0) -> torch.Tensor:
    """Boolean (..., d_ff): the neurons of `mlp` that fire for each row of x: h != 0 and, with a
    threshold, a deciding score above it (`firing_score`; the set SparseDecode computes, and
    what studies.locality profiles)."""
    fired = mlp.hidden(x) != 0
    if threshold > 0:
        fired &= firing_score(mlp, x) > threshold
    return fired


def over_mlp_inputs(model, batches: Iterable[torch.Tensor], record) -> None:
    """Run `model` over the (B, T) token `batches` (inference mode), calling `record(i, mlp, x)`
    with each layer's MLP and its input x (B, T, d_model) before the MLP runs."""
    hooks = [block.mlp.register_forward_pre_hook(lambda mlp, args, i=i: record(i, mlp, args[0]))
             for i, block in enumerate(model.layers)]
    try:
        with torch.inference_mode():
            for ids in batches:
                model(ids)
    finally:
        for h in hooks:
            h.remove()


def calibrate_thresholds(model, batches: Iterable[torch.Tensor], sparsity: float) -> list[float]:
    """Per-layer thresholds for a target sparsity, as CATS sets them (TEAL likewise, per tensor):
    each layer's threshold is the `sparsity` quantile of its firing scores over every token of
    the (B, T) token `batches` and every neuron, so that a neuron at or below it (skipped) is
    that share of the layer's (token, neuron) pairs. A layer already sparser than the target
    (the ReLU family) gets 0: its exact zeros."""
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not (
            0 < sparsity < 1):
        raise ValueError(f"sparsity={sparsity!r}: must be a number in (0, 1)")
    scores: list[list[torch.Tensor]] = [[] for _ in model.layers]
    over_mlp_inputs(model, batches, lambda i, mlp, x: scores[i].append(
        firing_score(mlp, x).reshape(-1).float()))
    if not scores or not scores[0]:
        raise ValueError("no tokens to calibrate the thresholds on")
    out = []
    for layer in scores:
        values = torch.cat(layer)
        k = min(values.numel(), max(1, math.ceil(sparsity * values.numel())))
        out.append(max(0.0, values.kthvalue(k).values.item()))
    return out


def permute_neurons(mlp: FeedForward, order: torch.Tensor) -> None:
    """Reorder mlp's hidden neurons in place: neuron order[j] becomes neuron j. `order` must be a
    permutation of range(d_ff). The function mlp(x) is unchanged (the hidden vector is permuted,
    and w_down's columns with it), up to the order of the final sum."""
    d_ff = mlp.w_up.out_features
    order = torch.as_tensor(order, dtype=torch.long)
    if order.shape != (d_ff,) or not torch.equal(order.sort().values, torch.arange(d_ff)):
        raise ValueError(f"order must be a permutation of range({d_ff}), got shape "
                         f"{tuple(order.shape)}")
    with torch.no_grad():
        for linear in (mlp.w_gate, mlp.w_up):
            if linear is not None:
                linear.weight.copy_(linear.weight[order.to(linear.weight.device)])
        down = mlp.w_down.weight
        down.copy_(down[:, order.to(down.device)])
    if mlp.sparse is not None:  # its cached layout follows the weights
        mlp.sparse.refresh()


class Predictor:
    """A layer's guess of which neurons fire, from the MLP's input: a low-rank MLP,
    scores = relu(x @ w1.T) @ w2.T + bias, neuron i predicted to fire where scores[:, i] > 0.

    Plain tensors, not a module, so that the model's state dict is unchanged; trained and
    calibrated by `python -m studies.locality predictors`, saved with `state()`.
    """

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, bias: torch.Tensor) -> None:
        if w1.dim() != 2 or w2.dim() != 2 or w2.shape[1] != w1.shape[0] or bias.shape != (
                w2.shape[0],):
            raise ValueError(f"predictor shapes do not chain: w1 {tuple(w1.shape)}, w2 "
                             f"{tuple(w2.shape)}, bias {tuple(bias.shape)}")
        self.w1, self.w2, self.bias = w1, w2, bias

    @property
    def rank(self) -> int:
        return self.w1.shape[0]

    def params(self) -> int:
        return self.w1.numel() + self.w2.numel() + self.bias.numel()

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.w1.dtype)
        return F.relu(x @ self.w1.t()) @ self.w2.t() + self.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Boolean (rows, d_ff): the neurons predicted to fire for each row of x."""
        return self.scores(x) > 0

    def state(self) -> dict[str, torch.Tensor]:
        return {"w1": self.w1, "w2": self.w2, "bias": self.bias}


class SparseDecode:
    """mlp(x) over only the neurons that fire, for a decode step's rows (see the module doc).

    Holds no parameters of its own (the model's state dict is unchanged): the down projection
    transposed, so that a neuron's output row is contiguous and gathering active neurons reads
    whole rows. Call `refresh()` after changing the MLP's weights.
    """

    def __init__(self, mlp: FeedForward, mode: Mode = "gate", threshold: float = 0.0,
                 max_rows: int = MAX_ROWS, predictor: Predictor | None = None,
                 hot: int = 0) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: must be one of {list(MODES)}")
        _one_threshold(threshold, "threshold")
        if mlp.activation == "swiglu" and mode == "gate" and threshold == 0:
            raise ValueError("a SwiGLU MLP is not sparse: silu is non-zero almost everywhere, so "
                             "mode='gate' needs a threshold > 0 (an approximation), or use 'oracle'")
        d_ff = mlp.w_up.out_features
        if (mode == "predicted") != (predictor is not None):
            raise ValueError("mode='predicted' takes a predictor, and only it does")
        if predictor is not None and predictor.w2.shape[0] != d_ff:
            raise ValueError(f"the predictor scores {predictor.w2.shape[0]} neurons, the MLP has "
                             f"{d_ff}")
        if not (isinstance(hot, int) and 0 <= hot <= d_ff):
            raise ValueError(f"hot={hot!r}: must be an int in [0, {d_ff}]")
        self.mlp, self.mode, self.threshold, self.max_rows = mlp, mode, float(threshold), max_rows
        self.predictor, self.hot = predictor, hot
        self.stats = {"steps": 0, "rows": 0, "active": 0, "neurons": d_ff}
        self.refresh()

    def refresh(self) -> None:
        self.down_t = self.mlp.w_down.weight.detach().t().contiguous()  # (d_ff, d_model)
        p = self.predictor  # the kernels take the predictor in float32, contiguous
        predictor = None if p is None else tuple(
            t.detach().float().contiguous() for t in (p.w1, p.w2, p.bias))
        self._kernel = kernels.Sparse(self.down_t, self.threshold,
                                      self.hot if self.mode == "predicted" else 0, predictor)

    def _fresh(self) -> None:
        w = self.mlp.w_down.weight
        if self.down_t.dtype != w.dtype or self.down_t.device != w.device:  # the model moved
            self.refresh()

    def kernel(self) -> kernels.Sparse | None:
        """This sparse decoding as the kernels take it (egmla.kernels.Sparse); None for the
        oracle mode, whose active set comes from a dense pass."""
        if self.mode == "oracle":
            return None
        self._fresh()
        return self._kernel

    def record(self, rows: int, computed: int) -> None:
        """Count a step of `rows` rows that computed `computed` neurons (see `density`)."""
        self.stats["steps"] += 1
        self.stats["rows"] += rows
        self.stats["active"] += computed

    def runs(self, x: torch.Tensor) -> bool:
        rows = x.numel() // x.shape[-1]
        return 0 < rows <= self.max_rows and not (torch.is_grad_enabled() and x.requires_grad)

    def _deciding(self) -> nn.Linear:
        mlp = self.mlp
        return mlp.w_up if mlp.w_gate is None else mlp.w_gate

    def _score(self, pre: torch.Tensor) -> torch.Tensor:  # firing_score, from the projection
        return F.silu(pre).abs() if self.mlp.activation == "swiglu" else pre

    def active(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(indices of the neurons this step computes, for x (rows, d_model); the deciding
        projection of every neuron where this mode computed it, else None)."""
        mlp = self.mlp
        if self.mode == "oracle":
            return (mlp.hidden(x) != 0).any(0).nonzero().squeeze(1), None
        if self.mode == "predicted":
            wanted = self.predictor(x).any(0)
            wanted[: self.hot] = True
            return wanted.nonzero().squeeze(1), None
        pre = self._deciding()(x)
        return (self._score(pre) > self.threshold).any(0).nonzero().squeeze(1), pre

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self._fresh()
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        spec = self.kernel()
        done = None if spec is None else kernels.sparse_mlp(x, self.mlp.kernel(x.shape[0]))
        if done is not None:  # the same computation in one kernel call
            y, computed = done
        else:
            idx, pre = self.active(x)
            y = self.hidden_at(x, idx, None if pre is None else pre[:, idx]) @ self.down_t[idx]
            computed = idx.numel()
        self.record(x.shape[0], computed)
        return y.view(*shape[:-1], y.shape[-1])

    def hidden_at(self, x: torch.Tensor, idx: torch.Tensor,
                  deciding: torch.Tensor | None = None) -> torch.Tensor:
        """h(x) of neurons idx only: (rows, len(idx)), with the deciding projection's columns
        `deciding` where already computed; neurons at or below the threshold are zeroed."""
        mlp = self.mlp
        if deciding is None:
            deciding = x @ self._deciding().weight[idx].t()
        up = deciding if mlp.w_gate is None else x @ mlp.w_up.weight[idx].t()
        h = mlp.activate(None if mlp.w_gate is None else deciding, up)
        if self.threshold > 0:  # a row computes only the neurons above the threshold in it
            h = h * (self._score(deciding) > self.threshold)
        return h

    def density(self) -> float | None:
        """Mean fraction of the neurons computed per step so far (None before the first)."""
        s = self.stats
        return s["active"] / (s["steps"] * s["neurons"]) if s["steps"] else None


def attach(mlp: FeedForward, mode: Mode = "gate", threshold: float = 0.0,
           max_rows: int = MAX_ROWS, predictor: Predictor | None = None,
           hot: int = 0) -> SparseDecode:
    """Make mlp's decode steps sparse (`mlp.sparse`); `detach(mlp)` undoes it."""
    mlp.sparse = SparseDecode(mlp, mode, threshold, max_rows, predictor, hot)
    return mlp.sparse


def detach(mlp: FeedForward) -> None:
    mlp.sparse = None


PREDICTORS_FORMAT = "egmla.predictors/1"  # the metadata of a predictors file


@dataclass(frozen=True)
class LayerPredictor:
    """What `python -m studies.locality predictors` saves for one layer: its predictor (in the
    reordered neuron order), the order (neuron order[j] of the original MLP becomes neuron j)
    and how many of the first neurons form the hot block."""

    predictor: Predictor
    order: torch.Tensor
    hot: int


def predictors_to_tensors(layers: list[LayerPredictor], threshold: Threshold = 0.0
                          ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a predictors file (safetensors), `layer{i}.{w1,w2,bias,
    order,hot}`; the metadata names the format and the firing threshold they were trained for
    (a number, or a JSON list of one per layer)."""
    tensors: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        tensors.update({f"layer{i}.{k}": v.contiguous() for k, v in layer.predictor.state().items()})
        tensors[f"layer{i}.order"] = layer.order.contiguous()
        tensors[f"layer{i}.hot"] = torch.tensor(layer.hot)
    per_layer = layer_thresholds(threshold, len(layers))
    written = (json.dumps(per_layer) if isinstance(threshold, (list, tuple))
               else repr(per_layer[0] if per_layer else float(threshold)))
    return tensors, {"format": PREDICTORS_FORMAT, "threshold": written}


def predictors_from_tensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None,
                            n_layers: int, d_ff: int
                            ) -> tuple[list[LayerPredictor], float | list[float]]:
    """The per-layer predictors of a predictors file, checked against a model with `n_layers`
    MLPs of `d_ff` neurons, and the threshold they were trained for (a number, or a list of
    one per layer); ValueError naming what does not fit."""
    metadata = metadata or {}
    if metadata.get("format", PREDICTORS_FORMAT) != PREDICTORS_FORMAT:
        raise ValueError(f"format {metadata['format']!r}: not a predictors file "
                         f"({PREDICTORS_FORMAT})")
    written = metadata.get("threshold", "0.0")
    try:
        threshold = json.loads(written)
    except ValueError:
        raise ValueError(f"threshold {written!r}: not a number or a list of numbers") from None
    per_layer = layer_thresholds(threshold, n_layers, "the file's threshold")
    threshold = per_layer if isinstance(threshold, list) else per_layer[0]
    layers = sorted({int(k.split(".")[0].removeprefix("layer")) for k in tensors
                     if k.startswith("layer") and k.split(".")[0][5:].isdigit()})
    if layers != list(range(n_layers)):
        raise ValueError(f"predictors for layers {layers}; the model has {n_layers} layers")
    out = []
    for i in layers:
        missing = [k for k in ("w1", "w2", "bias", "order", "hot") if f"layer{i}.{k}" not in tensors]
        if missing:
            raise ValueError(f"layer {i}: no {', '.join(missing)}")
        t = {k: tensors[f"layer{i}.{k}"] for k in ("w1", "w2", "bias", "order", "hot")}
        predictor = Predictor(t["w1"].float(), t["w2"].float(), t["bias"].float())
        order, hot = t["order"].long(), t["hot"]
        if predictor.w2.shape[0] != d_ff or order.shape != (d_ff,):
            raise ValueError(f"layer {i}: predictors for {predictor.w2.shape[0]} neurons, the "
                             f"model's MLPs have {d_ff}")
        if hot.numel() != 1 or not 0 <= int(hot) <= d_ff:
            raise ValueError(f"layer {i}: hot={hot.tolist()}: must be one number in [0, {d_ff}]")
        out.append(LayerPredictor(predictor, order, int(hot)))
    return out, threshold


SERVING_MODES = MODES


def check_settings(mode: str | None, threshold: Threshold = 0.0, predictors: object = None
                   ) -> None:
    """ValueError naming a bad `mode` (None: dense), `threshold` (a number, or one per layer)
    or predictors' presence, before any model is loaded ("predicted" takes predictors, and only
    it does)."""
    if mode is not None and mode not in SERVING_MODES:
        raise ValueError(f"ffn_sparsity={mode!r}: must be None (dense) or one of "
                         f"{list(SERVING_MODES)}")
    per_layer = isinstance(threshold, (list, tuple))
    values = layer_thresholds(threshold, len(threshold) if per_layer else 1, "ffn_threshold")
    if mode is None and any(values):
        raise ValueError(f"ffn_threshold={threshold!r} needs an ffn_sparsity mode")
    if (mode == "predicted") != (predictors is not None):
        raise ValueError("ffn_sparsity='predicted' takes ffn_predictors (a file written by "
                         "`python -m studies.locality predictors`), and only it does")


def sparsify(model, mode: str | None, threshold: Threshold = 0.0,
             predictors: list[LayerPredictor] | None = None,
             reorder: bool = True) -> list[SparseDecode]:
    """Attach (mode) or remove (None) sparse decoding on every block's MLP of a Transformer,
    at `threshold` (one for every layer, or a list of one per layer); a SwiGLU model needs a
    threshold > 0 in "gate" mode (see SparseDecode). "predicted" first
    reorders each MLP's neurons as its predictor was trained (in place; the function is
    unchanged), so that the hot block is the first neurons; `reorder=False` where the model's
    neurons are in that order already (`reorder_neurons` ran)."""
    check_settings(mode, threshold, predictors)
    thresholds = layer_thresholds(threshold, len(model.layers))
    if mode is None:
        for block in model.layers:
            detach(block.mlp)
        return []
    if mode != "predicted":
        return [attach(block.mlp, mode, t) for block, t in zip(model.layers, thresholds)]
    if len(predictors) != len(model.layers):
        raise ValueError(f"{len(predictors)} layers of predictors; the model has "
                         f"{len(model.layers)} layers")
    if reorder:
        reorder_neurons(model, predictors)
    attached = []
    for block, layer, t in zip(model.layers, predictors, thresholds):
        detach(block.mlp)
        attached.append(attach(block.mlp, "predicted", t, predictor=layer.predictor,
                               hot=layer.hot))
    return attached


def reorder_neurons(model, predictors: list[LayerPredictor]) -> None:
    """Put each MLP's neurons in the order its predictor was trained in (in place; the model's
    function is unchanged)."""
    if len(predictors) != len(model.layers):
        raise ValueError(f"{len(predictors)} layers of predictors; the model has "
                         f"{len(model.layers)} layers")
    for block, layer in zip(model.layers, predictors):
        permute_neurons(block.mlp, layer.order)
