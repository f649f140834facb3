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
  approximation of TEAL / CATS, not exact.
- `"oracle"`: the active set taken from a dense pass (every neuron with h != 0 in some row), then
  the sparse computation over it: exact, and slower than dense; it checks the sparse arithmetic
  and is the ideal a predictor is measured against.

`permute_neurons(mlp, order)` reorders the hidden neurons in place (rows of w_gate and w_up,
columns of w_down), which leaves the function unchanged: with the most frequently active neurons
first, a hot set is a contiguous block (a dense slice, no gather).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from egmla.models.layers import FeedForward

Mode = Literal["gate", "oracle"]
MODES = ("gate", "oracle")
MAX_ROWS = 16  # rows (decode sequences) up to which the sparse path is taken; dense above


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


class SparseDecode:
    """mlp(x) over only the neurons that fire, for a decode step's rows (see the module doc).

    Holds no parameters of its own (the model's state dict is unchanged): the down projection
    transposed, so that a neuron's output row is contiguous and gathering active neurons reads
    whole rows. Call `refresh()` after changing the MLP's weights.
    """

    def __init__(self, mlp: FeedForward, mode: Mode = "gate", threshold: float = 0.0,
                 max_rows: int = MAX_ROWS) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: must be one of {list(MODES)}")
        if not (isinstance(threshold, (int, float)) and threshold >= 0):
            raise ValueError(f"threshold={threshold!r}: must be a number >= 0")
        if mlp.activation == "swiglu" and mode == "gate" and threshold == 0:
            raise ValueError("a SwiGLU MLP is not sparse: silu is non-zero almost everywhere, so "
                             "mode='gate' needs a threshold > 0 (an approximation), or use 'oracle'")
        self.mlp, self.mode, self.threshold, self.max_rows = mlp, mode, float(threshold), max_rows
        self.stats = {"steps": 0, "rows": 0, "active": 0, "neurons": mlp.w_up.out_features}
        self.refresh()

    def refresh(self) -> None:
        self.down_t = self.mlp.w_down.weight.detach().t().contiguous()  # (d_ff, d_model)

    def runs(self, x: torch.Tensor) -> bool:
        rows = x.numel() // x.shape[-1]
        return 0 < rows <= self.max_rows and not (torch.is_grad_enabled() and x.requires_grad)

    def active(self, x: torch.Tensor) -> torch.Tensor:
        """Indices of the neurons this step computes, for x (rows, d_model)."""
        mlp = self.mlp
        if self.mode == "oracle":
            return (mlp.hidden(x) != 0).any(0).nonzero().squeeze(1)
        deciding = mlp.w_up if mlp.w_gate is None else mlp.w_gate
        pre = deciding(x)
        score = F.silu(pre).abs() if mlp.activation == "swiglu" else pre
        return (score > self.threshold).any(0).nonzero().squeeze(1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.mlp.w_down.weight
        if self.down_t.dtype != w.dtype or self.down_t.device != w.device:  # the model moved
            self.refresh()
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        idx = self.active(x)
        y = self.hidden_at(x, idx) @ self.down_t[idx]
        self.stats["steps"] += 1
        self.stats["rows"] += x.shape[0]
        self.stats["active"] += idx.numel()
        return y.view(*shape[:-1], y.shape[-1])

    def hidden_at(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """h(x) of neurons idx only: (rows, len(idx)); the threshold's neurons are zeroed."""
        mlp = self.mlp
        up = x @ mlp.w_up.weight[idx].t()
        if mlp.w_gate is None:
            h = F.relu(up).square()
        else:
            gate = x @ mlp.w_gate.weight[idx].t()
            if mlp.activation == "swiglu":
                h = F.silu(gate) * up
            elif mlp.activation == "reglu":
                h = F.relu(gate) * up
            else:
                h = F.relu(gate) * F.relu(up)
        if self.threshold > 0:  # a row computes only the neurons above the threshold in it
            deciding = F.silu(gate).abs() if mlp.activation == "swiglu" else (
                up if mlp.w_gate is None else gate)
            h = h * (deciding > self.threshold)
        return h

    def density(self) -> float | None:
        """Mean fraction of the neurons computed per step so far (None before the first)."""
        s = self.stats
        return s["active"] / (s["steps"] * s["neurons"]) if s["steps"] else None


def attach(mlp: FeedForward, mode: Mode = "gate", threshold: float = 0.0,
           max_rows: int = MAX_ROWS) -> SparseDecode:
    """Make mlp's decode steps sparse (`mlp.sparse`); `detach(mlp)` undoes it."""
    mlp.sparse = SparseDecode(mlp, mode, threshold, max_rows)
    return mlp.sparse


def detach(mlp: FeedForward) -> None:
    mlp.sparse = None


def check_settings(mode: str | None, threshold: float = 0.0) -> None:
    """ValueError naming a bad `mode` (None: dense) or `threshold`, before any model is loaded."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"ffn_sparsity={mode!r}: must be None (dense) or one of {list(MODES)}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not (
            0 <= threshold < float("inf")):
        raise ValueError(f"ffn_threshold={threshold!r}: must be a finite number >= 0")
    if mode is None and threshold:
        raise ValueError(f"ffn_threshold={threshold!r} needs an ffn_sparsity mode")


def sparsify(model, mode: str | None, threshold: float = 0.0) -> list[SparseDecode]:
    """Attach (mode) or remove (None) sparse decoding on every block's MLP of a Transformer;
    a SwiGLU model needs a threshold > 0 in "gate" mode (see SparseDecode)."""
    check_settings(mode, threshold)
    if mode is None:
        for block in model.layers:
            detach(block.mlp)
        return []
    return [attach(block.mlp, mode, threshold) for block in model.layers]
