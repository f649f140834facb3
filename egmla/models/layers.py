"""Building blocks shared by every backbone: RMSNorm, rotary embeddings, SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms and RoPE angles run in at least float32 (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in >= float32 then cast back."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(_compute_dtype(x.dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """A normalization chosen by name: `layernorm`, `rmsnorm` or `none`."""
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm {kind!r}; expected layernorm, rmsnorm or none")


class Rotary:
    """Rotary position embedding in the half-split ("rotate_half") layout used by Llama.

    The angles are computed from absolute positions on every call, so any offset (a cached
    prefix, a chunk of a prompt) is just a different `positions` tensor. No buffers: the
    frequencies cannot be silently cast to bf16 by `model.to(dtype)`.
    """

    def __init__(self, dim: int, theta: float) -> None:
        if dim % 2:
            raise ValueError(f"RoPE dim must be even, got {dim}")
        self.dim, self.theta = dim, theta

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) integer -> cos, sin (B, T, dim) in `dtype`."""
        work = _compute_dtype(dtype)
        exponent = torch.arange(0, self.dim, 2, device=positions.device, dtype=torch.int64).to(work)
        inv_freq = 1.0 / (self.theta ** (exponent / self.dim))  # (dim/2,)
        angles = positions.to(work)[..., None] * inv_freq  # (B, T, dim/2)
        angles = torch.cat((angles, angles), dim=-1)  # (B, T, dim)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, D) rotated by cos/sin (B, T, D): pairs (i, i + D/2) share one frequency."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # (B, T, 1, D)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(d_model, d_ff, bias=False)
        self.w_up = nn.Linear(d_model, d_ff, bias=False)
        self.w_down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
