"""Embedding-gated MLA (Cai & Hou, arXiv 2509.16686): MLA whose KV path is gated per token id.

Notation as in mla.py, plus a gate table E (vocab x d_e) shared by `gate_group_size` consecutive
layers and a per-layer up-projection W_UE:

    g = W_UE E[id_t]                                     the gate: a function of the token id only

    gate_position = kv       [k_nope; v] = Norm(W_UKV c  *  g)      g has width H * (d_nope + d_v)
    gate_position = latent   c'          = Norm(c  *  g)            g has width d_c; c' is cached

`kv` is the reading that matches the paper's summary (gate, then layer norm, then split into
heads). Norm(u * g) is nonlinear in the key-side latent, so W_UK cannot be folded into the
query: every decode step rebuilds K/V for all cached positions from the cached c and token ids
(about S * (d_c + d_e) * H * (d_nope + d_v) MACs per layer). `latent` keeps MLA's absorbed
decode. Which one the paper used could not be verified (docs/attention.md).
"""

from __future__ import annotations

import torch
from torch import nn

from egmla.config import EGMLAConfig, ModelConfig
from egmla.models.attention.mla import MLA
from egmla.models.layers import make_norm


class EGMLA(MLA):
    """Caches c and k_rope per layer like MLA; under `kv` the model also caches token ids once."""

    def __init__(self, config: ModelConfig, gate_table: nn.Embedding) -> None:
        super().__init__(config)
        a = config.attention
        assert isinstance(a, EGMLAConfig)
        if gate_table.embedding_dim != a.d_e:
            raise ValueError(f"gate table width {gate_table.embedding_dim} != d_e={a.d_e}")
        self.gate_position = a.gate_position
        self.needs_token_ids = a.gate_position == "kv"
        gated = config.n_heads * (a.d_nope + a.d_v) if self.needs_token_ids else a.d_c
        self.gate_table = gate_table  # the same module in every layer of a group (shared weight)
        self.w_gate = nn.Linear(a.d_e, gated, bias=False)  # W_UE
        self.gate_norm = make_norm(a.gate_norm, gated, config.norm_eps)

    def gate(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token ids (B, S) -> g (B, S, gated width)."""
        if token_ids is None:
            raise ValueError("EG-MLA needs the token ids: pass token_ids to forward")
        return self.w_gate(self.gate_table(token_ids))

    def latent(self, x, token_ids):
        c, k_rope = super().latent(x, token_ids)
        if self.gate_position == "latent":
            c = self.gate_norm(c * self.gate(token_ids))  # (B, T, C): the gated latent is cached
        return c, k_rope

    def expand(self, c, key_ids):
        if self.gate_position == "latent":
            return super().expand(c, key_ids)
        B, S, _ = c.shape
        kv = self.gate_norm(self.wkv_b(c) * self.gate(key_ids))  # (B, S, H * (n + d_v))
        kv = kv.view(B, S, self.n_heads, self.d_nope + self.d_v)
        return kv.split([self.d_nope, self.d_v], dim=-1)

    def supports_absorbed(self) -> bool:
        return self.gate_position == "latent"
