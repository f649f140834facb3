"""Block-quantized weights: Q8_0 as llama.cpp stores it, quantized here from float weights.

A weight (N, K) is cut along K into blocks of 32 values; each block keeps one float16 scale d
and 32 int8 values q in [-127, 127], and stands for d * q. The rule is llama.cpp's
(`quantize_row_q8_0_ref`), so a model quantized here holds the same numbers as llama.cpp's Q8_0
file of the same float weights (tests compare with the `gguf` package's quantizer):

    amax = max |w| over the block,  d = amax / 127,  q = round_half_away(w * (1 / d)),
    stored d = float16(d)  (q is computed with the unrounded d; a zero block has d = 0, q = 0)

Kept as two tensors, `qs` (N, K) int8 and `d` (N, K / 32) float16, which is what the kernel
(`egmla.kernels.gemv_q8_0`) streams: 34 bytes per 32 weights, as in the file.

A model is quantized for inference with `quantize_model(model, "q8_0")`: every linear layer of
its blocks and its LM head becomes a `QuantizedLinear` (the token embedding stays as it is: a
lookup reads one row). A product with a quantized weight quantizes the activations per block
too, as llama.cpp does for Q8_0, on every path: the kernel for a decode step's few rows, and
for more rows (a prefill) the same arithmetic in PyTorch (`egmla.kernels.q8_matmul`), so a
prompt computed in chunks or at once agrees with itself up to float rounding, except where
that rounding moves an activation across a quantization boundary (one step, amax / 127, of
that activation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from egmla import kernels
from egmla.kernels import Q8_BLOCK

METHODS = ("q8_0",)  # what quantize_model (and serve.LLM(quantization=...)) takes


@dataclass(frozen=True)
class Q8Weight:
    """A Q8_0 weight: `qs` (N, K) int8 and `d` (N, K / 32) float16."""

    qs: torch.Tensor
    d: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.qs.shape

    @property
    def dtype(self) -> torch.dtype:
        """int8, so that code checking a weight's float dtype (the fused decode) passes it by."""
        return self.qs.dtype

    @property
    def device(self) -> torch.device:
        return self.qs.device

    def is_contiguous(self) -> bool:
        return self.qs.is_contiguous() and self.d.is_contiguous()

    def nbytes(self) -> int:
        return self.qs.numel() * self.qs.element_size() + self.d.numel() * self.d.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """d * q as a (N, K) tensor of `dtype` (computed in float32)."""
        n, k = self.qs.shape
        blocks = self.qs.view(n, k // Q8_BLOCK, Q8_BLOCK).float() * self.d.float()[..., None]
        return blocks.view(n, k).to(dtype)


def quantize_q8_0(weight: torch.Tensor) -> Q8Weight:
    """`weight` (N, K), any float dtype, K a multiple of 32, as Q8_0 (module docstring)."""
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(f"quantize_q8_0: a 2-D float weight, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    n, k = weight.shape
    if k % Q8_BLOCK:
        raise ValueError(f"quantize_q8_0: the input width {k} is not a multiple of {Q8_BLOCK}")
    w = weight.detach().to(torch.float32).reshape(n, k // Q8_BLOCK, Q8_BLOCK)
    # float32 divisions correctly rounded, as C and numpy divide (PyTorch's CPU division of
    # float32 may differ in the last bit; through float64 it cannot)
    d = (w.abs().amax(dim=-1).double() / 127.0).float()
    inv = torch.where(d > 0, (1.0 / d.double()).float(), torch.zeros_like(d))
    scaled = (w * inv[..., None]).abs()
    whole = torch.floor(scaled)  # roundf, half away from zero, without adding 0.5 in float32
    q = torch.sign(w) * (whole + torch.floor(2 * (scaled - whole)))
    return Q8Weight(qs=q.to(torch.int8).reshape(n, k).contiguous(),
                    d=d.to(torch.float16).contiguous())


class QuantizedLinear(nn.Module):
    """A linear layer (no bias) over a Q8_0 weight, for inference: `weight` is the Q8Weight
    (its tensors are buffers, so `model.to(device)` and `state_dict()` carry them)."""

    def __init__(self, weight: Q8Weight) -> None:
        super().__init__()
        self.register_buffer("qs", weight.qs)
        self.register_buffer("d", weight.d)
        self.out_features, self.in_features = weight.qs.shape

    @property
    def weight(self) -> Q8Weight:
        return Q8Weight(self.qs, self.d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, q8_0"


def quantize_model(model: nn.Module, method: str) -> nn.Module:
    """Replace, in place, every bias-free nn.Linear of `model` whose input width is a multiple of
    32 (its blocks' projections and MLPs, its LM head) by a QuantizedLinear of `method`; the
    token embedding stays float. Returns `model`; for inference only (no gradients)."""
    if method not in METHODS:
        raise ValueError(f"quantization={method!r}: expected one of {', '.join(METHODS)}")
    linears = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and m.bias is None and m.in_features % Q8_BLOCK == 0]
    if not linears:
        raise ValueError(f"quantization={method!r}: the model has no linear layer it can quantize")
    for name, module in linears:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr,
                QuantizedLinear(quantize_q8_0(module.weight)))
    if hasattr(model, "weights_replaced"):  # kernels' kept weights are read again
        model.weights_replaced()
    return model


__all__ = ["METHODS", "Q8_BLOCK", "Q8Weight", "QuantizedLinear", "quantize_model", "quantize_q8_0"]
