"""The joint low-rank factorization of a layer's non-RoPE keys and values (MHA2MLA's joint SVD).

W (N, d) stacks the rows the up-projection must produce; the latent has d_c < N dims:

    plain      W = U S V^T;  W_DKV = V_k^T (d_c, d),  W_UKV = U_k S_k (N, d_c)
               (MHA2MLA's split: an orthonormal down-projection, the scale in the up one)
    whitened   with C = E[h h^T] on calibration inputs and C = L L^T (Cholesky),
               W L = U S V^T;  W_DKV = V_k^T L^-1,  W_UKV = U_k S_k
               W_UKV W_DKV h is then the best rank-d_c map in the inputs' own metric: the
               error || (W - W_k) h || is smallest on average over the calibration inputs

Both in float64. `energy` is the share of the squared singular values kept (of W, or of W L).
"""

from __future__ import annotations

import torch

SVD_KINDS = ("plain", "whitened")


def factor(w: torch.Tensor, d_c: int, kind: str = "plain", covariance: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """w (N, d) -> down (d_c, d), up (N, d_c) with up @ down ~ w, and the energy kept."""
    w = w.double()
    if kind == "plain":
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        down = vh[:d_c]
    elif kind == "whitened":
        if covariance is None:
            raise ValueError("svd='whitened' needs the inputs' covariance")
        c = covariance.double()
        c = c + torch.eye(c.shape[0], dtype=c.dtype) * 1e-6 * c.diagonal().mean()  # keeps it PD
        chol = torch.linalg.cholesky(c)  # L, lower triangular: C = L L^T
        u, s, vh = torch.linalg.svd(w @ chol, full_matrices=False)
        # V_k^T L^-1, as a triangular solve: (L^T X^T = V_k)^T
        down = torch.linalg.solve_triangular(chol.T, vh[:d_c].T, upper=True).T
    else:
        raise ValueError(f"svd={kind!r}: must be one of {', '.join(SVD_KINDS)}")
    energy = float((s[:d_c].square().sum() / s.square().sum().clamp_min(1e-300)).item())
    if d_c > s.shape[0]:  # wider than the rank of w: the extra latent dims are unused
        pad = d_c - s.shape[0]
        down = torch.cat((down, down.new_zeros(pad, w.shape[1])))
        return down, torch.cat((u * s, u.new_zeros(w.shape[0], pad)), dim=1), energy
    return down, u[:, :d_c] * s[:d_c], energy
