"""A reference written apart from the model code: a Llama-style GQA decoder computed from a
state dict with plain tensor algebra, where each KV head rotates only some of its frequency
pairs (the others, in the key and in its query heads, are left unrotated). With every pair
kept it is the original model. What a converted model must equal at full rank."""

from __future__ import annotations

import math

import torch


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate_pairs(x: torch.Tensor, keep: list[int], theta: float) -> torch.Tensor:
    """x (T, d_h) at positions 0..T-1: pair j = (x[:, j], x[:, j + d_h/2]) turned by the angle
    t * theta^(-2j/d_h) for j in `keep`; the other pairs as they are."""
    T, d_h = x.shape
    half = d_h // 2
    out = x.clone()
    t = torch.arange(T, dtype=x.dtype)
    for j in keep:
        angle = t * theta ** (-2 * j / d_h)
        a, b = x[:, j], x[:, j + half]
        out[:, j] = a * angle.cos() - b * angle.sin()
        out[:, j + half] = b * angle.cos() + a * angle.sin()
    return out


def partial_rope_logits(state: dict[str, torch.Tensor], cfg, ids: torch.Tensor,
                        keep: list[list[list[int]]] | None) -> torch.Tensor:
    """Logits (T, vocab) of one sequence `ids` (T,); `keep[layer][kv_head]` lists the rotated
    pairs (None: all, the original model). Float64."""
    s = {k: v.double() for k, v in state.items()}
    H, G = cfg.n_heads, cfg.attention.kv_heads(cfg)
    d_h = cfg.attention.head_size(cfg)
    R, T, eps = H // G, len(ids), cfg.norm_eps
    x = s["tok_emb.weight"][ids]  # (T, d)
    mask = torch.ones(T, T).tril().bool()
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        h = rms(x, s[p + "attn_norm.weight"], eps)
        q = (h @ s[p + "attn.wq.weight"].T).view(T, H, d_h)
        k = (h @ s[p + "attn.wk.weight"].T).view(T, G, d_h)
        v = (h @ s[p + "attn.wv.weight"].T).view(T, G, d_h)
        heads = []
        for head in range(H):
            g = head // R
            pairs = range(d_h // 2) if keep is None else keep[i][g]
            qh = rotate_pairs(q[:, head], list(pairs), cfg.rope_theta)
            kh = rotate_pairs(k[:, g], list(pairs), cfg.rope_theta)
            scores = (qh @ kh.T / math.sqrt(d_h)).masked_fill(~mask, float("-inf"))
            heads.append(scores.softmax(-1) @ v[:, g])
        x = x + torch.cat(heads, dim=-1) @ s[p + "attn.wo.weight"].T
        h = rms(x, s[p + "mlp_norm.weight"], eps)
        gate, up = h @ s[p + "mlp.w_gate.weight"].T, h @ s[p + "mlp.w_up.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ s[p + "mlp.w_down.weight"].T
    return rms(x, s["norm.weight"], eps) @ s["lm_head.weight"].T
