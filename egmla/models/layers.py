"""Building blocks shared by every backbone: linear layers, RMSNorm, rotary embeddings, the MLP."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from egmla import kernels


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms and RoPE angles run in at least float32 (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state dict) whose inference on a few rows, a decode
    step's, runs on egmla's CPU kernel where there is one (`egmla.kernels.linear`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in >= float32 then cast back."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm is one op where the formula is seven (a decode step runs 61 of these);
        # in float32 it is the formula, and in bf16 the formula is: normalize in float32,
        # round, then multiply by the weight in bf16.
        work = _compute_dtype(x.dtype)
        if x.dtype == work and self.weight.dtype == work:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.to(work), self.weight.shape, None, self.eps).to(x.dtype)


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """A normalization chosen by name: `layernorm`, `rmsnorm` or `none`."""
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm {kind!r}; expected layernorm, rmsnorm or none")


@dataclasses.dataclass(frozen=True)
class Rotary:
    """Rotary position embedding in the half-split ("rotate_half") layout used by Llama.

    The angles are computed from absolute positions, so any offset (a cached prefix, a chunk of
    a prompt) is just a different `positions` tensor. A value (equal when its arguments are),
    holding nothing between calls and no buffers: the frequencies cannot be silently cast to
    bf16 by `model.to(dtype)`. A forward computes each rotary's angles once and hands them to
    its layers (egmla.models.positions.Positions).

    Frequencies: by default the dim/2 standard ones, theta^(-2j/dim). With `freqs`, one tuple
    of dim/2 indices per RoPE head, each head rotating its pair i at theta^(-2 freqs[h][i] /
    spectrum): a subset of a wider head's spectrum, as a converted model keeps (egmla.upcycle).
    Example: spectrum 64, freqs ((0, 8, 16, 24),) rotates an 8-wide key's pairs (i, i + 4) at
    the frequencies of a 64-wide head's pairs 0, 8, 16 and 24.
    """

    dim: int
    theta: float
    freqs: tuple[tuple[int, ...], ...] | None = None
    spectrum: int | None = None

    def __post_init__(self) -> None:
        if self.dim % 2:
            raise ValueError(f"RoPE dim must be even, got {self.dim}")
        if self.freqs is not None and (self.spectrum is None
                                       or any(len(f) != self.dim // 2 for f in self.freqs)):
            raise ValueError(f"RoPE freqs={self.freqs}: need dim/2={self.dim // 2} indices per "
                             "head and a spectrum width")
        # the CPU's inverse frequencies, made with the rotary (a decode step then runs 7 small
        # ops, not 11); other devices compute theirs in each forward
        with torch.inference_mode(False):  # plain tensors, usable by any later forward
            cpu = {work: self._make_inv_freq(torch.device("cpu"), work)
                   for work in (torch.float32, torch.float64)}
        object.__setattr__(self, "_cpu_inv_freq", cpu)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) integer -> cos, sin (B, T, dim) in `dtype`; with per-head `freqs`,
        (B, T, heads, dim)."""
        work = _compute_dtype(dtype)
        inv_freq = self._inv_freq(positions.device, work)  # (dim/2,) or (heads, dim/2)
        shape = positions.shape + (1,) * inv_freq.dim()
        angles = positions.to(work).view(shape) * inv_freq  # (B, T, [heads,] dim/2)
        angles = torch.cat((angles, angles), dim=-1)  # (B, T, [heads,] dim)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _inv_freq(self, device: torch.device, work: torch.dtype) -> torch.Tensor:
        if device.type == "cpu" and work in self._cpu_inv_freq:
            return self._cpu_inv_freq[work]
        return self._make_inv_freq(device, work)

    def _make_inv_freq(self, device: torch.device, work: torch.dtype) -> torch.Tensor:
        """theta^(-2i/dim) for i < dim/2, (dim/2,) in `work`, or theta^(-2j/spectrum) for the
        `freqs` j, (heads, dim/2)."""
        if self.freqs is None:
            exponent = torch.arange(0, self.dim, 2, device=device, dtype=torch.int64).to(work)
            return 1.0 / (self.theta ** (exponent / self.dim))
        exponent = 2 * torch.tensor(self.freqs, device=device, dtype=torch.int64)
        return 1.0 / (self.theta ** (exponent.to(work) / self.spectrum))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, D) rotated by cos/sin (B, T, D), or by per-head cos/sin (B, T, Hr, D) each
    shared by H / Hr consecutive heads of x: pairs (i, i + D/2) share one frequency."""
    if cos.dim() == 3:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # (B, T, 1, D)
    elif cos.shape[2] != x.shape[2]:
        repeat = x.shape[2] // cos.shape[2]
        cos, sin = cos.repeat_interleave(repeat, dim=2), sin.repeat_interleave(repeat, dim=2)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


FFN_ACTIVATIONS = ("swiglu", "reglu", "drelu", "relu2")
GATED = frozenset({"swiglu", "reglu", "drelu"})


class FeedForward(nn.Module):
    """A block's MLP, down(h(x)), with the hidden activations h(x) one of (`activation`):

        swiglu  silu(gate(x)) * up(x)        (Llama, SmolLM2)
        reglu   relu(gate(x)) * up(x)
        drelu   relu(gate(x)) * relu(up(x))  (TurboSparse's dReLU)
        relu2   relu(up(x)) ** 2             (squared ReLU; no gate matrix)

    A neuron (a column of h) is active for a token where its h is non-zero: in the ReLU family
    that is exact sparsity, which the activation-locality work exploits; SwiGLU's h is almost
    never exactly zero.
    """

    def __init__(self, d_model: int, d_ff: int, activation: str = "swiglu") -> None:
        super().__init__()
        if activation not in FFN_ACTIVATIONS:
            raise ValueError(f"activation={activation!r}: must be one of {list(FFN_ACTIVATIONS)}")
        self.activation = activation
        self.w_gate = Linear(d_model, d_ff, bias=False) if activation in GATED else None
        self.w_up = Linear(d_model, d_ff, bias=False)
        self.w_down = Linear(d_ff, d_model, bias=False)
        self.sparse = None  # activation-locality decoding (egmla.models.sparse_ffn.attach)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """h(x), the (..., d_ff) activations that w_down mixes."""
        if self.w_gate is None:
            return self.activate(None, self.w_up(x))
        gate, up = kernels.linears(x, (self.w_gate.weight, self.w_up.weight))  # one pass
        return self.activate(gate, up)

    def activate(self, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
        """h from the gate and up projections (relu2: gate None), for any subset of neurons."""
        if self.activation == "relu2":
            return F.relu(up).square()
        if self.activation == "swiglu":
            return F.silu(gate) * up
        if self.activation == "reglu":
            return F.relu(gate) * up
        return F.relu(gate) * F.relu(up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sparse is not None and self.sparse.runs(x):
            return self.sparse(x)
        return self.w_down(self.hidden(x))

    def decodes_sparse(self, rows: int) -> bool:
        """Whether a decode step of `rows` rows runs this MLP sparse (decoding attached, and
        taking that many rows)."""
        return self.sparse is not None and 0 < rows <= self.sparse.max_rows

    def dense_kernel(self) -> kernels.MLP:
        """This MLP's weights as the kernels take them, dense."""
        gate = None if self.w_gate is None else self.w_gate.weight
        return kernels.MLP(self.activation, gate, self.w_up.weight, self.w_down.weight)

    def kernel(self, rows: int) -> kernels.MLP | None:
        """This MLP as egmla.kernels computes it for a decode step of `rows` rows: dense, or
        sparse where sparse decoding is attached and takes that step; None where the kernel
        cannot compute it (the oracle mode's dense pass)."""
        if not self.decodes_sparse(rows):
            return self.dense_kernel()
        sparse = self.sparse.kernel()
        return None if sparse is None else dataclasses.replace(self.dense_kernel(), sparse=sparse)
