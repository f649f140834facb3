"""Scaled dot-product attention shared by the variants, with the causal mask from positions."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    positions: torch.Tensor,
    key_positions: torch.Tensor | None,
) -> torch.Tensor:
    """Causal attention; K/V may have fewer heads than Q (GQA/MQA, and MLA's absorbed decode).

    q (B, T, H, Dk), k (B, S, Hkv, Dk), v (B, S, Hkv, Dv) -> (B, T, H, Dv).
    Without `key_positions` the keys are the queries' own tokens in order (training, or a
    prefill with no cache), so the plain causal mask applies. Otherwise query at position p
    sees every cached key at position <= p. `key_positions` is (S,) when all rows share them
    (contiguous cache) or (B, S) for ragged rows (paged cache), whose padding slots carry a
    position larger than any query's, so the mask hides them.
    """
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T or S, D)
    B, H, T, _ = q.shape
    G = k.shape[1]
    if key_positions is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=G != H)
        return out.transpose(1, 2)  # (B, T, H, Dv)
    kp = key_positions if key_positions.dim() == 2 else key_positions[None]  # (B or 1, S)
    mask = kp[:, None, :] <= positions[:, :, None]  # (B or 1, T, S)
    # GQA/MQA with a mask: fold the R = H / G query heads that share a K/V head into the query
    # axis, (B, G, R * T, D), so SDPA sees plain MHA over G heads. Same function as
    # enable_gqa=True, which on CPU takes a slow path when a mask is given (20x at decode).
    R = H // G
    q = q.reshape(B, G, R * T, q.shape[-1])
    mask = mask[:, None, None].expand(-1, -1, R, -1, -1).reshape(mask.shape[0], 1, R * T, -1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # (B, G, R*T, Dv)
    return out.view(B, H, T, -1).transpose(1, 2)  # (B, T, H, Dv)
