"""Multi-head attention with grouped K/V heads: MHA (n_kv = n_h), GQA, MQA (n_kv = 1)."""

from __future__ import annotations

import torch

from egmla import kernels
from egmla.cache import FieldSpec, LayerSpec, LayerView
from egmla.config import MHAConfig, ModelConfig
from egmla.models.attention.common import AttentionLayer, RopeKV, attend
from egmla.models.layers import Linear, Rotary, apply_rope
from egmla.models.positions import Positions


class MHA(AttentionLayer):
    """Caches K and V per layer: 2 * n_kv * d_h elements per token."""

    config_class = MHAConfig

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        a = config.attention
        assert isinstance(a, MHAConfig)
        d = config.d_model
        self.n_heads, self.n_kv, self.head_dim = config.n_heads, a.kv_heads(config), a.head_size(config)
        self.wq = Linear(d, self.n_heads * self.head_dim, bias=False)
        self.wk = Linear(d, self.n_kv * self.head_dim, bias=False)
        self.wv = Linear(d, self.n_kv * self.head_dim, bias=False)
        self.wo = Linear(self.n_heads * self.head_dim, d, bias=False)
        self.rope = Rotary(self.head_dim, config.rope_theta)

    def cache_spec(self) -> LayerSpec:
        return {"k": FieldSpec((self.n_kv, self.head_dim)), "v": FieldSpec((self.n_kv, self.head_dim))}

    def decode_cost(self, context: int, dtype: torch.dtype = torch.float32) -> dict[str, int]:
        return {"macs_per_key": 2 * self.n_heads * self.head_dim, "macs_per_query": 0,
                "cache_bytes_per_key": self._cache_bytes_per_key(dtype), "lookup_bytes_per_key": 0}

    def rope_kv_attention(self) -> RopeKV:
        return RopeKV(self.wq.weight, self.wk.weight, self.wv.weight, self.wo.weight, self.rope,
                      self.head_dim**-0.5)

    def forward(
        self,
        x: torch.Tensor,
        positions: Positions | torch.Tensor,
        cache: LayerView | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # B batch, T new tokens, S cached + new tokens, H query heads, G kv heads, D head dim
        B, T, _ = x.shape
        positions = Positions.of(positions)
        q, k, v = kernels.linears(x, (self.wq.weight, self.wk.weight, self.wv.weight))  # one pass
        q = q.view(B, T, self.n_heads, self.head_dim)  # (B, T, H, D)
        k = k.view(B, T, self.n_kv, self.head_dim)  # (B, T, G, D)
        v = v.view(B, T, self.n_kv, self.head_dim)  # (B, T, G, D)
        cos, sin = positions.cos_sin(self.rope, x.dtype)  # (B or 1, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        scale, o, key_positions = self.head_dim**-0.5, None, None
        in_place = getattr(cache, "fused_attention", None)  # egmla.cache.AttendsInPlace
        if in_place is not None:  # a paged decode step reads its pools in place
            o = in_place(q, {"k": k, "v": v}, key="k", value="v", scale=scale)
        if cache is not None and o is None:
            kv = cache.update(k=k, v=v)
            k, v, key_positions = kv["k"], kv["v"], cache.key_positions  # (B, S, G, D)
        if o is None:
            o = attend(q, k, v, scale, positions, key_positions)  # (B, T, H, D)
        return self.wo(o.reshape(B, T, self.n_heads * self.head_dim))
