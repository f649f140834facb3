"""What a conversion measures on calibration text: per layer, from the inputs of the source's
attention (the hidden state after its norm), the query/key pair norms (the 2-norm rule) and
the inputs' second moment (the whitened SVD); and the paper-form gate's LayerNorm fit."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from tqdm.auto import tqdm

from egmla.models.attention.common import RopeKV
from egmla.models.transformer import Transformer


class LayerStats:
    """Running sums over calibration tokens for one attention layer."""

    def __init__(self, attn: RopeKV, covariance: bool) -> None:
        self.wq, self.wk = attn.wq.detach().double(), attn.wk.detach().double()
        self.head_dim = d_h = attn.rope.dim
        self.n_heads, self.n_kv = self.wq.shape[0] // d_h, self.wk.shape[0] // d_h
        self.tokens = 0
        self.q_norms = torch.zeros(self.n_heads, d_h // 2, dtype=torch.float64)
        self.k_norms = torch.zeros(self.n_kv, d_h // 2, dtype=torch.float64)
        d = self.wq.shape[1]
        self.moment = torch.zeros(d, d, dtype=torch.float64) if covariance else None

    def add(self, x: torch.Tensor) -> None:
        """x (B, T, d): the layer's attention inputs for a batch."""
        x = x.detach().reshape(-1, x.shape[-1]).double()  # (N, d)
        q = (x @ self.wq.T).view(len(x), self.n_heads, self.head_dim)
        k = (x @ self.wk.T).view(len(x), self.n_kv, self.head_dim)
        self.q_norms += pair_norms(q).sum(0)
        self.k_norms += pair_norms(k).sum(0)
        if self.moment is not None:
            self.moment += x.T @ x
        self.tokens += len(x)

    def pair_scores(self) -> torch.Tensor:
        """(G, d_h/2): per KV head, sum over its query heads of mean |q_j| * mean |k_j|."""
        n = max(self.tokens, 1)
        q = (self.q_norms / n).view(self.n_kv, self.n_heads // self.n_kv, -1)  # (G, R, d_h/2)
        return (q * (self.k_norms / n)[:, None]).sum(1)

    def covariance(self) -> torch.Tensor | None:
        """E[x x^T] over the calibration tokens, (d, d) float64; None if not collected."""
        return None if self.moment is None else self.moment / max(self.tokens, 1)


def pair_norms(x: torch.Tensor) -> torch.Tensor:
    """(..., d_h) -> (..., d_h/2): the 2-norm of each half-split pair (x_j, x_(j + d_h/2))."""
    a, b = x.chunk(2, dim=-1)
    return torch.sqrt(a.square() + b.square())


def collect_stats(model: Transformer, layers: list[RopeKV], calibration: torch.Tensor,
                  batch_size: int = 4, progress: bool = False,
                  covariance: bool = False) -> list[LayerStats]:
    """One pass of `model` over `calibration` (N, T) token ids, gathering each attention
    layer's LayerStats (`layers`: its weights) from its inputs."""
    stats = [LayerStats(attn, covariance) for attn in layers]
    for _ in attention_inputs(model, calibration, batch_size, progress, "calibrate",
                              lambda i, x: stats[i].add(x)):
        pass
    return stats


def attention_inputs(model: Transformer, ids: torch.Tensor, batch_size: int, progress: bool,
                     desc: str, visit: Callable[[int, torch.Tensor], None]) -> Iterator[int]:
    """Run `model` over `ids` in batches, calling visit(layer, attention input) for every
    layer; yields after each batch (the number of tokens so far)."""
    if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"calibration must be (N, T) integer token ids, got {tuple(ids.shape)} "
                         f"{ids.dtype}")
    hooks = [block.attn.register_forward_pre_hook(
        lambda _m, args, i=i: visit(i, args[0])) for i, block in enumerate(model.layers)]
    done = 0
    try:
        with torch.no_grad():
            for start in tqdm(range(0, len(ids), batch_size), desc=desc, disable=not progress,
                              unit="batch"):
                batch = ids[start:start + batch_size].long()
                model(batch)
                done += batch.numel()
                yield done
    finally:
        for hook in hooks:
            hook.remove()


def fit_gate_norms(target: Transformer, source: Transformer, calibration: torch.Tensor,
                   batch_size: int) -> dict:
    """Fit each layer's gate LayerNorm (gain gamma_d, bias beta_d per dimension) so that
    LN(u) ~ u for the converted K/V u = W_UKV W_DKV x on the source's attention inputs x: per
    dimension, least squares of u_d on z_d = (u_d - mean(u)) / std(u). Returns the fit's
    relative error per layer, || LN(u) - u || / || u ||."""
    n_layers = len(target.layers)
    sums = [torch.zeros(5, target.layers[i].attn.gate_norm.weight.numel(), dtype=torch.float64)
            for i in range(n_layers)]  # per dim: n, sum z, sum z^2, sum u, sum u z
    sq = torch.zeros(n_layers, 2, dtype=torch.float64)  # sum u^2, and later the residual

    def latent_kv(i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        attn = target.layers[i].attn
        c = (x.double() @ attn.wkv_a.weight.double().T)[..., :attn.d_c]
        u = (c @ attn.wkv_b.weight.double().T).reshape(-1, sums[i].shape[1])  # (N, width)
        norm = attn.gate_norm
        var, mu = torch.var_mean(u, dim=-1, keepdim=True, correction=0)
        return u, (u - mu) / torch.sqrt(var + norm.eps)

    def accumulate(i: int, x: torch.Tensor) -> None:
        u, z = latent_kv(i, x)
        sums[i] += torch.stack([torch.ones_like(z).sum(0), z.sum(0), z.square().sum(0),
                                u.sum(0), (u * z).sum(0)])
        sq[i, 0] += u.square().sum()

    for _ in attention_inputs(source, calibration, batch_size, False, "fit gate norm", accumulate):
        pass
    for i in range(n_layers):
        n, sz, szz, su, suz = sums[i]
        var_z = szz / n - (sz / n).square()
        gamma = (suz / n - (sz / n) * (su / n)) / var_z.clamp_min(1e-12)
        beta = su / n - gamma * sz / n
        norm = target.layers[i].attn.gate_norm
        norm.weight.copy_(gamma)
        norm.bias.copy_(beta)

    def residual(i: int, x: torch.Tensor) -> None:
        u, z = latent_kv(i, x)
        norm = target.layers[i].attn.gate_norm
        sq[i, 1] += (z * norm.weight.double() + norm.bias.double() - u).square().sum()

    for _ in attention_inputs(source, calibration, batch_size, False, "gate norm error", residual):
        pass
    error = (sq[:, 1] / sq[:, 0].clamp_min(1e-300)).sqrt()
    return {"norm_fit_relative_error": [round(float(e), 6) for e in error]}
