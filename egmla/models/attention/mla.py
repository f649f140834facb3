"""Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, section 2.1).

Per token t with hidden h (notation of the paper; H heads, n = d_nope, r = d_rope):

    c      = RMSNorm(W_DKV h)                       (d_c)      cached
    k_rope = RoPE(W_KR h)                           (r)        cached, shared by all heads
    q      = W_Q h   or   W_UQ RMSNorm(W_DQ h)      (H, n + r) split into q_nope, q_rope=RoPE(.)
    k_nope = W_UK c,  v = W_UV c                    (H, n), (H, d_v)
    score  = (q_nope . k_nope + q_rope . k_rope) / sqrt(n + r)

Naive: up-project k_nope/v for every cached token and run SDPA. Absorbed: q_nope . (W_UK c) =
(W_UK^T q_nope) . c, so fold W_UK into the query and attend over the latent directly, an MQA with
one shared "head" of key [c, k_rope] and value c; then apply W_UV to the attended latent. Both
compute the same function; absorbed never materializes per-head K/V (cheap decode), naive does
less arithmetic for long prefills.

A model converted from GQA/MHA (egmla.upcycle) needs three generalizations, all config
(MLAConfig; the defaults are the paper's form): no norm on c (`latent_norm`); G = n_kv_heads
up-projected K/V heads, each shared by H / G query heads (W_UK, W_UV per KV head, as the
original's K/V heads were); and Hr = rope_heads RoPE keys per token, each rotating at its own
frequencies (`rope_freqs`) and shared by H / Hr query heads, whose q_rope rotate at them too.
Then k_rope is (Hr, r) per token, the cache d_c + Hr * r, and attention is grouped like GQA.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from egmla.cache import FieldSpec, LayerSpec, LayerView
from egmla.config import MLAConfig, ModelConfig
from egmla.models.attention.common import TOKEN_IDS_FIELD, AttentionLayer, attend
from egmla.models.layers import Linear, RMSNorm, Rotary, apply_rope
from egmla.models.positions import Positions


class MLA(AttentionLayer):
    """Caches c (d_c) and k_rope (rope_heads x d_rope) per layer: d_c + rope_heads * d_rope
    elements per token."""

    config_class = MLAConfig

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        a = config.attention
        assert isinstance(a, MLAConfig)
        d, H = config.d_model, config.n_heads
        self.n_heads, self.d_c, self.d_nope, self.d_rope, self.d_v = H, a.d_c, a.d_nope, a.d_rope, a.d_v
        self.impl, self.d_q = a.impl, a.d_q
        self.n_kv, self.rope_heads = a.kv_heads(config), a.rope_heads  # G, Hr
        q_width = H * (a.d_nope + a.d_rope)
        eps = a.latent_eps(config)  # the latent norms' own (DeepSeek: 1e-6), else norm_eps
        if a.d_q is None:
            self.wq = Linear(d, q_width, bias=False)
        else:
            self.wq_a = Linear(d, a.d_q, bias=False)  # W_DQ
            self.q_norm = RMSNorm(a.d_q, eps)
            self.wq_b = Linear(a.d_q, q_width, bias=False)  # W_UQ (and W_QR)
        self.wkv_a = Linear(d, a.d_c + self.rope_heads * a.d_rope, bias=False)  # [W_DKV; W_KR]
        self.kv_norm = RMSNorm(a.d_c, eps) if a.latent_norm else nn.Identity()
        self.wkv_b = Linear(a.d_c, self.n_kv * (a.d_nope + a.d_v), bias=False)  # [W_UK; W_UV] per KV head
        self.wo = Linear(H * a.d_v, d, bias=False)
        freqs = a.layer_freqs(layer)
        self.rope = Rotary(a.d_rope, config.rope_theta, freqs,
                           None if freqs is None else a.d_nope + a.d_rope)
        self.scale = (a.d_nope + a.d_rope) ** -0.5

    @classmethod
    def build_layers(cls, config: ModelConfig) -> list[MLA]:
        """One module per layer, each told its index (its RoPE frequencies may be its own)."""
        return [cls(config, layer=i) for i in range(config.n_layers)]

    def cache_spec(self) -> LayerSpec:
        rope = (self.d_rope,) if self.rope_heads == 1 else (self.rope_heads, self.d_rope)
        return {"c": FieldSpec((self.d_c,)), "k_rope": FieldSpec(rope)}

    # ---- pieces a subclass (EG-MLA) may refine ------------------------------------------------

    def cached_fields(self, x: torch.Tensor, token_ids: torch.Tensor | None, cos: torch.Tensor,
                      sin: torch.Tensor, with_auxiliary: bool) -> dict[str, torch.Tensor]:
        """x (B, T, d) -> what this layer caches for the T new tokens: the normed latent c
        (B, T, d_c) and the rotated k_rope (B, T, d_rope). `with_auxiliary`: also the auxiliary
        fields of `cache_spec()` (none here), needed when a cache is written or `absorbed` runs."""
        B, T, _ = x.shape
        c, k_rope = self.wkv_a(x).split([self.d_c, self.rope_heads * self.d_rope], dim=-1)
        k_rope = apply_rope(k_rope.view(B, T, self.rope_heads, self.d_rope), cos, sin)  # (B, T, Hr, r)
        if self.rope_heads == 1:
            k_rope = k_rope[:, :, 0]  # (B, T, r): one key shared by all heads
        return {"c": self.kv_norm(c), "k_rope": k_rope}

    def expand(self, c: torch.Tensor, key_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent c (B, S, d_c) -> k_nope (B, S, G, d_nope), v (B, S, G, d_v), G = n_kv_heads."""
        B, S, _ = c.shape
        kv = self.wkv_b(c).view(B, S, self.n_kv, self.d_nope + self.d_v)
        return kv.split([self.d_nope, self.d_v], dim=-1)

    def key_rope(self, k_rope: torch.Tensor, heads: int) -> torch.Tensor:
        """Cached k_rope (B, S, r) or (B, S, Hr, r) -> (B, S, heads, r), each of `heads` (a
        multiple of Hr) reading its group's key."""
        if k_rope.dim() == 3:
            return k_rope[:, :, None].expand(-1, -1, heads, -1)
        return k_rope if heads == self.rope_heads else k_rope.repeat_interleave(
            heads // self.rope_heads, dim=2)

    def decode_cost(self, context: int, dtype: torch.dtype = torch.float32) -> dict[str, int]:
        H, C, n, r, v = self.n_heads, self.d_c, self.d_nope, self.d_rope, self.d_v
        cost = {"cache_bytes_per_key": self._cache_bytes_per_key(dtype), "lookup_bytes_per_key": 0}
        if self._use_absorbed(1, context, cached=True):  # an MQA over [c, k_rope] with value c
            return {"macs_per_key": H * (2 * C + r), "macs_per_query": H * (n + v) * C, **cost}
        # K/V up-projected from every cached latent, then attention over them
        return {"macs_per_key": self.n_kv * (n + v) * C + H * (n + r + v), "macs_per_query": 0,
                **cost}

    def supports_absorbed(self) -> bool:
        return True

    def prefers_absorbed(self, T: int, S: int) -> bool:
        """`impl: auto` with a cache: absorbed for single-token decode, naive for prefill chunks
        (the up-projection of S keys is shared by T queries, the absorbed query is not)."""
        return T == 1

    # ---- forward ------------------------------------------------------------------------------

    def forward(
        self,
        x: torch.Tensor,
        positions: Positions | torch.Tensor,
        cache: LayerView | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # B batch, T new tokens, S cached + new tokens, H heads, C = d_c, n = d_nope, r = d_rope
        B, T, _ = x.shape
        positions = Positions.of(positions)
        cos, sin = positions.cos_sin(self.rope, x.dtype)
        q = self.wq(x) if self.d_q is None else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(B, T, self.n_heads, self.d_nope + self.d_rope)  # (B, T, H, n + r)
        q_nope, q_rope = q.split([self.d_nope, self.d_rope], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin)

        fields = self.cached_fields(x, token_ids, cos, sin,
                                    with_auxiliary=cache is not None or self.impl == "absorbed")
        if cache is not None:
            o = self._absorbed_in_place(cache, q_nope, q_rope, fields)
            if o is not None:  # a paged decode step read its pools in place
                return self.wo(o.reshape(B, T, self.n_heads * self.d_v))
        key_positions, key_ids = None, token_ids
        if cache is not None:
            fields = cache.update(**fields)  # every cached token's fields, (B, S, .)
            key_positions = cache.key_positions
            if self.needs_token_ids:
                key_ids = cache.sequence_field(TOKEN_IDS_FIELD).long()  # (B, S)

        S = fields["c"].shape[1]
        if self._use_absorbed(T, S, cached=cache is not None):
            o = self._absorbed(q_nope, q_rope, fields, key_ids, positions, key_positions)
        else:
            o = self._naive(q_nope, q_rope, fields, key_ids, positions, key_positions)
        return self.wo(o.reshape(B, T, self.n_heads * self.d_v))

    def _use_absorbed(self, T: int, S: int, cached: bool) -> bool:
        if self.impl == "auto":
            return cached and self.supports_absorbed() and self.prefers_absorbed(T, S)
        return self.impl == "absorbed"

    def _naive(self, q_nope, q_rope, fields, key_ids, positions, key_positions) -> torch.Tensor:
        k_nope, v = self.expand(fields["c"], key_ids)  # (B, S, G, n), (B, S, G, d_v)
        heads = math.lcm(self.n_kv, self.rope_heads)  # K/V heads of the attention (H by default)
        if heads != self.n_kv:
            k_nope, v = (t.repeat_interleave(heads // self.n_kv, dim=2) for t in (k_nope, v))
        k_rope = self.key_rope(fields["k_rope"], heads)  # (B, S, heads, r)
        q = torch.cat((q_nope, q_rope), dim=-1)  # (B, T, H, n + r)
        k = torch.cat((k_nope, k_rope), dim=-1)  # (B, S, heads, n + r)
        return attend(q, k, v, self.scale, positions, key_positions)  # (B, T, H, d_v)

    def _absorbed(self, q_nope, q_rope, fields, key_ids, positions, key_positions) -> torch.Tensor:
        c, k_rope = fields["c"], fields["k_rope"]  # (B, S, C), (B, S, [Hr,] r)
        Hr = self.rope_heads
        q = torch.cat((self._absorb_query(q_nope), q_rope), dim=-1)  # (B, T, H, C + r)
        if Hr == 1:
            k = torch.cat((c, k_rope), dim=-1)[:, :, None]  # (B, S, 1, C + r)
            value = c[:, :, None]  # (B, S, 1, C)
        else:  # one latent "head" per RoPE key: c repeated beside each
            value = c[:, :, None].expand(-1, -1, Hr, -1)  # (B, S, Hr, C)
            k = torch.cat((value, k_rope), dim=-1)  # (B, S, Hr, C + r)
        o_latent = attend(q, k, value, self.scale, positions, key_positions)  # (B, T, H, C)
        return self._values(o_latent)

    def _absorbed_in_place(self, cache, q_nope, q_rope, fields) -> torch.Tensor | None:
        """The absorbed attention (B, T, H, d_v) computed by the cache in place, with `fields`
        written (egmla.cache.AttendsInPlace), or None (nothing written) where it cannot: MLA's
        MQA over [c, k_rope] with value c, `fused_latent_attention`, for a decode step
        (`impl: auto` runs it absorbed)."""
        in_place = getattr(cache, "fused_latent_attention", None)
        if (in_place is None or not self._absorbed_is_mqa()
                or not self._use_absorbed(q_nope.shape[1], 1, cached=True)):
            return None
        q_abs = torch.cat((self._absorb_query(q_nope), q_rope), dim=-1)  # (B, T, H, C + r)
        o_latent = in_place(q_abs, fields, scale=self.scale)
        return None if o_latent is None else self._values(o_latent.to(q_abs.dtype))

    def _absorbed_is_mqa(self) -> bool:
        """Whether this layer's absorbed attention is MLA's MQA over the cached [c, k_rope] with
        value c, which a cache may compute in place (`fused_latent_attention`): not where a
        subclass computes its own (EG-MLA `kv`'s gated form, the value-embedding control)."""
        return type(self)._absorbed is MLA._absorbed

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK (G, n, C) and W_UV (G, d_v, C), views of wkv_b."""
        w = self.wkv_b.weight.view(self.n_kv, self.d_nope + self.d_v, self.d_c)
        return w.split([self.d_nope, self.d_v], dim=1)

    def _absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope (B, T, H, n) -> W_UK^T q_nope (B, T, H, C)."""
        return self._per_kv_head(q_nope, self._up_projections()[0])

    def _values(self, o_latent: torch.Tensor) -> torch.Tensor:
        """Each head's attended latent (B, T, H, C) -> its value W_UV o (B, T, H, d_v)."""
        return self._per_kv_head(o_latent, self._up_projections()[1].transpose(1, 2))

    @staticmethod
    def _per_kv_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x (B, T, H, X) @ w (G, X, Y) -> (B, T, H, Y), query head h through its KV head's
        matrix w[h // (H / G)]."""
        B, T, H, X = x.shape
        G = w.shape[0]
        y = torch.einsum("btgrx,gxy->btgry", x.view(B, T, G, H // G, X), w)
        return y.reshape(B, T, H, w.shape[-1])
