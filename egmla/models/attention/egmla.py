"""Embedding-gated MLA (Cai & Hou, arXiv 2509.16686): MLA whose KV path is gated per token id.

Notation as in mla.py, plus a gate table E (vocab x d_e) shared by `gate_group_size` consecutive
layers and a per-layer up-projection W_UE (D = d_nope + d_v per head, e_j = E[id_j]):

    g = W_UE E[id_t]                                     the gate: a function of the token id only

    gate_position = kv       [k_nope; v] = Norm(W_UKV c  *  g)      g has width H * D
    gate_position = latent   c'          = Norm(c  *  g)            g has width d_c; c' is cached

`kv` is the reading that matches the paper's summary (gate, then layer norm over all heads, then
split into heads). `latent` keeps MLA's absorbed decode. Which one the paper used could not be
verified (docs/attention.md). Each is a class: EGMLA (`kv`) and EGMLALatent (`latent`), sharing
the gate's parts through EGMLABase; the config says which (`type: egmla`, `gate_position`).

`kv` has two exact computations. Rebuild (`naive`): up-project and gate K/V for every cached key,
about S * H * D * (d_c + d_e) MACs per layer per step. Absorbed: the norm's statistics of the
gated vector z_j = W_UKV c_j * W_UE e_j depend only on (c_j, id_j), so they are cached when the
token is written (LayerNorm: mu_j and inv_sigma_j; RMSNorm: inv_sigma_j; none: nothing), and then,
per head i with the norm's gamma, beta split per head like wkv_b ([K_0; V_0; K_1; V_1; ...]):

    score_ij = scale * (inv_sigma_j * (c_j^T M_i e_j - mu_j * sum(q_i * gamma_K,i)) + q^R_i . k^R_j)
               with M_i = W_UK,i^T diag(q_i * gamma_K,i) W_UE,K,i   (d_c x d_e, once per query)
    o_i      = gamma_V,i * (diag(W_UV,i A_i W_UE,V,i^T) - m_i) + beta_V,i
               with A_i = sum_j a_ij inv_sigma_j c_j e_j^T,  m_i = sum_j a_ij inv_sigma_j mu_j

(the key's beta_K term is the same for every key and cancels in the softmax). Per key that is
about H * 2 * d_c * d_e MACs; per query H * D * d_c * d_e. `impl: auto` picks the cheaper one with
`step_macs` (docs/attention.md has the measured decode costs).
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch
from torch import nn

from egmla.cache import FieldSpec, LayerSpec
from egmla.config import EGMLAConfig, ModelConfig
from egmla.models.attention.mla import MLA
from egmla.models.layers import Linear, make_norm

# The norm's per-token statistics: (mu, inv_sigma) for LayerNorm, (inv_sigma,) for RMSNorm. Kept
# in float32 at least: inv_sigma can be large where the gated vector is small.
_STATS_WIDTH = {"layernorm": 2, "rmsnorm": 1, "none": 0}


class EGMLABase(MLA):
    """What both gate positions share: the gate table E (the same module in every layer of a
    group), the up-projection W_UE, the gate norm and their init; `gate(ids)` is g. Where g
    multiplies is the subclass's: EGMLA (`gate_position: kv`), EGMLALatent (`latent`)."""

    gate_reads_ids = True  # the gate's rows are looked up by token id (not: EGMLAConstGate)
    gate_position: ClassVar[str] = ""  # the config's gate_position this class computes

    def __init__(self, config: ModelConfig, gate_table: nn.Embedding, layer: int = 0) -> None:
        super().__init__(config, layer)
        a = config.attention
        assert isinstance(a, EGMLAConfig) and a.gate_position == self.gate_position
        if gate_table.embedding_dim != a.d_e:
            raise ValueError(f"gate table width {gate_table.embedding_dim} != d_e={a.d_e}")
        self.gate_norm_kind, self.d_e = a.gate_norm, a.d_e
        self.gate_residual = a.gate_residual
        gated = a.gated_width(config)
        self.gate_table = gate_table  # the same module in every layer of a group (shared weight)
        self.w_gate = Linear(a.d_e, gated, bias=False)  # W_UE
        self.gate_norm = make_norm(a.gate_norm, gated, config.norm_eps)
        self.gate_init, self.init_std = a.gate_init, config.init_std

    @classmethod
    def build_layers(cls, config: ModelConfig) -> list[EGMLABase]:
        return [cls(config, table, layer=i) for i, table in enumerate(cls.gate_tables(config))]

    @classmethod
    def gate_tables(cls, config: ModelConfig) -> list[nn.Embedding]:
        """Each layer's gate table: one per group of consecutive layers, the same module in
        each layer of it."""
        a = config.attention
        assert isinstance(a, EGMLAConfig)
        tables = [nn.Embedding(config.vocab_size, a.d_e) for _ in range(a.n_gate_tables(config))]
        return [tables[i // a.gate_group_size] for i in range(config.n_layers)]

    def lookup_tables(self) -> list[nn.Parameter]:
        return [self.gate_table.weight]

    def reset_parameters(self) -> None:
        """The gate's init, by `gate_init` (docs/attention.md, where the three are compared):

        - `small` (default): both N(0, init_std^2), as every other weight: g has std
          init_std^2 sqrt(d_e) (3e-3 at d_e = 64), so under `kv` the gated vector sits below the
          norm's eps, which then scales it linearly: the normed K/V start near MLA's scale;
        - `random`: E[id] ~ N(0, 1), W_UE ~ N(0, 1/d_e), so g = W_UE E[id] ~ N(0, 1), a gate of
          unit scale that differs per token;
        - `matched`: the `random` gate, and under `kv` the gate norm's gain at init_std * sqrt(d_c)
          (EGMLA.reset_parameters);
        - `identity` (with `gate_residual`): E[id] ~ N(0, 1), W_UE = 0, so g = 1 + W_UE E[id] = 1:
          the layer computes MLA's function until W_UE moves (egmla.upcycle's starting point).

        A table shared by a group is re-drawn by each of its layers; it stays one tensor.
        """
        table, w = self.gate_table.weight, self.w_gate.weight
        if self.gate_init == "identity":
            nn.init.normal_(table, std=1.0)
            nn.init.zeros_(w)
            return
        if self.gate_init == "small":
            nn.init.normal_(table, std=self.init_std)
            nn.init.normal_(w, std=self.init_std)
            return
        nn.init.normal_(w, std=self.w_gate.in_features**-0.5)
        nn.init.normal_(table, std=1.0)

    def gate_rows(self, token_ids: torch.Tensor | None,
                  like: torch.Tensor | None = None) -> torch.Tensor:
        """The gate table's rows e_j of the tokens (B, S) (those of `like` (B, S, .), where the
        rows do not depend on the ids): (B, S, d_e)."""
        if token_ids is None:
            raise ValueError("EG-MLA needs the token ids: pass token_ids to forward")
        return self.gate_table(token_ids)

    def gate(self, token_ids: torch.Tensor | None,
             like: torch.Tensor | None = None) -> torch.Tensor:
        """g = W_UE e_j (or 1 + W_UE e_j, `gate_residual`) for the tokens (B, S): (B, S, gated
        width)."""
        g = self.w_gate(self.gate_rows(token_ids, like))
        return g + 1 if self.gate_residual else g


class EGMLALatent(EGMLABase):
    """`egmla` with `gate_position: latent`: the latent gated before it is cached, c' = Norm(c *
    g) with g of width d_c; attention is MLA's over c' (absorbed decode included), so the cache
    holds MLA's fields and no token ids. Built by EGMLA.build_layers for that config (the
    weights are named as EGMLA's)."""

    gate_position = "latent"

    def cached_fields(self, x, token_ids, cos, sin, with_auxiliary):
        fields = super().cached_fields(x, token_ids, cos, sin, with_auxiliary)
        fields["c"] = self.gate_norm(fields["c"] * self.gate(token_ids, x))  # the gated latent
        return fields


class EGMLA(EGMLABase):
    """`egmla` (`gate_position: kv`): caches c and k_rope per layer like MLA, the token ids once
    per sequence, and per layer the norm's statistics when the absorbed computation may run.
    A `latent` config builds `latent_form`'s layers instead."""

    config_class = EGMLAConfig
    gate_position = "kv"
    latent_form: ClassVar[type[EGMLABase]] = EGMLALatent

    def __init__(self, config: ModelConfig, gate_table: nn.Embedding, layer: int = 0) -> None:
        super().__init__(config, gate_table, layer)
        self.needs_token_ids = self.gate_reads_ids
        a = config.attention
        self.stats_width = _STATS_WIDTH[a.gate_norm] if a.impl != "naive" else 0

    @classmethod
    def build_layers(cls, config: ModelConfig) -> list[EGMLABase]:
        if config.attention.gate_position == cls.latent_form.gate_position:
            return cls.latent_form.build_layers(config)
        return super().build_layers(config)

    def reset_parameters(self) -> None:
        """The gate's init (EGMLABase.reset_parameters); `matched` also sets the gate norm's gain
        to init_std * sqrt(d_c), the scale MLA's K/V start at (W_UKV ~ N(0, init_std^2) on a
        unit-scale latent)."""
        super().reset_parameters()
        gain = getattr(self.gate_norm, "weight", None)
        if self.gate_init == "matched" and gain is not None:
            nn.init.constant_(gain, self.init_std * self.d_c**0.5)

    def cache_spec(self) -> LayerSpec:
        spec = super().cache_spec()
        if self.stats_width:
            spec["norm_stats"] = FieldSpec((self.stats_width,), min_dtype=torch.float32,
                                           auxiliary=True)
        return spec

    def cached_fields(self, x, token_ids, cos, sin, with_auxiliary):
        fields = super().cached_fields(x, token_ids, cos, sin, with_auxiliary)
        if with_auxiliary and self.stats_width:
            fields["norm_stats"] = self.norm_stats(fields["c"], token_ids)
        return fields

    def norm_stats(self, c: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """(B, T, d_c), (B, T) -> the gate norm's statistics of z = W_UKV c * g, (B, T, 1 or 2),
        in at least float32: [mu, inv_sigma] (LayerNorm, biased variance) or [inv_sigma] (RMS)."""
        z = self.wkv_b(c) * self.gate(token_ids, c)  # (B, T, H * D)
        z = z.to(torch.promote_types(z.dtype, torch.float32))
        eps = self.gate_norm.eps
        if self.gate_norm_kind == "rmsnorm":
            return torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps)
        var, mu = torch.var_mean(z, dim=-1, keepdim=True, correction=0)
        return torch.cat((mu, torch.rsqrt(var + eps)), dim=-1)

    def expand(self, c, key_ids):
        B, S, _ = c.shape
        kv = self.gate_norm(self.wkv_b(c) * self.gate(key_ids, c))  # (B, S, H * (n + d_v))
        kv = kv.view(B, S, self.n_kv, self.d_nope + self.d_v)  # (B, S, G, n + d_v)
        return kv.split([self.d_nope, self.d_v], dim=-1)

    # ---- the absorbed computation ------------------------------------------------------------

    def step_macs(self, T: int, S: int) -> dict[str, int]:
        """Multiply-accumulates of one attention step per layer and sequence, T queries over S
        keys, for both computations (the new tokens' statistics, common to both, excluded)."""
        H, n, v, r, C, E = self.n_heads, self.d_nope, self.d_v, self.d_rope, self.d_c, self.d_e
        E += self.gate_residual  # the absorbed form's constant column (see _absorbed)
        return {
            "rebuild": S * self.n_kv * (n + v) * (C + E) + T * S * H * (n + r + v),
            "absorbed": T * H * (n + v) * C * E + T * S * H * (2 * C * E + C + r),
        }

    def decode_cost(self, context: int, dtype: torch.dtype = torch.float32) -> dict[str, int]:
        absorbed = self._use_absorbed(1, context, cached=True)
        key = "absorbed" if absorbed else "rebuild"
        one, two = self.step_macs(1, 1)[key], self.step_macs(1, 2)[key]
        return {"macs_per_key": two - one, "macs_per_query": 2 * one - two,
                # the rebuild reads no statistics; every token's int32 id is read besides
                "cache_bytes_per_key": (self._cache_bytes_per_key(dtype, auxiliary=absorbed)
                                        + 4 * self.needs_token_ids),
                "lookup_bytes_per_key": self.d_e * dtype.itemsize * self.gate_reads_ids}

    def supports_absorbed(self) -> bool:
        return self.impl != "naive"

    def prefers_absorbed(self, T: int, S: int) -> bool:
        macs = self.step_macs(T, S)
        return macs["absorbed"] < macs["rebuild"]

    def _absorbed(self, q_nope, q_rope, fields, key_ids, positions, key_positions):
        # B batch, T queries, S keys, H heads, C = d_c, E = d_e (+1 with gate_residual: g =
        # 1 + W_UE e = [W_UE, 1] [e; 1], the same bilinear form)
        c, k_rope = fields["c"], fields["k_rope"]  # (B, S, C), (B, S, [Hr,] r)
        e = self.gate_rows(key_ids, c)  # (B, S, E): the keys' gate rows
        if self.gate_residual:
            e = torch.cat((e, e.new_ones(e.shape[:-1] + (1,))), dim=-1)
        m_q, q_mu, outputs = self._absorbed_query(q_nope)
        mu, inv_sigma = self._stats(fields, c.dtype)  # (B, S) each, or None

        scores = _bilinear(m_q, c, e)  # (B, T, H, S): c_j^T M_i e_j
        if mu is not None:
            scores = scores - q_mu.unsqueeze(-1) * mu[:, None, None, :]
        if inv_sigma is not None:
            scores = scores * inv_sigma[:, None, None, :]
        if k_rope.dim() == 3:  # one RoPE key shared by every head
            scores = scores + torch.einsum("bthr,bsr->bths", q_rope, k_rope)
        else:
            scores = scores + torch.einsum("bthr,bshr->bths", q_rope,
                                           self.key_rope(k_rope, self.n_heads))
        if key_positions is None:  # no cache: the keys are the queries' own tokens
            key_positions = positions.tensor
        visible = positions.causal_mask(key_positions).transpose(1, 2)  # (B or 1, T, 1, S)
        attn = (scores * self.scale).masked_fill(~visible, float("-inf")).softmax(-1)  # (B,T,H,S)

        weights = attn if inv_sigma is None else attn * inv_sigma[:, None, None, :]
        acc = _weighted_outer(weights, c, e)  # (B, T, H, C, E): A_i
        m = None if mu is None else (weights * mu[:, None, None, :]).sum(-1)  # (B, T, H): m_i
        return self._absorbed_output(acc, m, outputs)

    def _absorbed_in_place(self, cache, q_nope, q_rope, fields):
        """The absorbed computation with its per-key part (the scores, softmax, A_i and m_i)
        done by the cache in place (`fused_gated_attention`: a paged decode step reads the
        latents, statistics and token ids from its pools), where the step's longest row makes
        it the cheaper computation (`impl: auto`) and the gate's rows are the table's."""
        in_place = getattr(cache, "fused_gated_attention", None)
        if in_place is None or not self.gate_reads_ids or self.impl == "naive":
            return None
        if not self._use_absorbed(q_nope.shape[1], cache.key_positions.shape[1], cached=True):
            return None
        # the per-query side, computed once and only where the cache attends
        per_query = functools.cache(lambda: self._absorbed_query(q_nope))
        got = in_place(lambda: per_query()[:2], q_rope, fields, self.gate_table.weight,
                       self.gate_residual, self.scale)
        if got is None:
            return None
        acc, m = got
        has_mu = self.stats_width and self.gate_norm_kind != "rmsnorm"
        return self._absorbed_output(acc.to(q_nope.dtype), m.to(q_nope.dtype) if has_mu else None,
                                     per_query()[2])

    def _absorbed_query(self, q_nope: torch.Tensor):
        """The per-query side of the absorbed computation: each head's M_i (B, T, H, C, E'),
        its mu coefficient sum(q_i * gamma_K,i) (B, T, H), and what `_absorbed_output` needs."""
        G, n, v, C = self.n_kv, self.d_nope, self.d_v, self.d_c
        w_uk, w_uv = self.wkv_b.weight.view(G, n + v, C).split([n, v], dim=1)  # (G, n|v, C)
        w_e = self.w_gate.weight  # (G * (n + v), E)
        if self.gate_residual:
            w_e = torch.cat((w_e, w_e.new_ones(w_e.shape[0], 1)), dim=-1)
        we_k, we_v = w_e.view(G, n + v, -1).split([n, v], dim=1)  # (G, n|v, E)
        gamma_k, gamma_v, beta_v = self._norm_affine(q_nope)
        # per query head: each of the G KV heads' weights serves H / G query heads
        w_uk, w_uv, we_k, we_v, gamma_k, gamma_v = (
            self._per_query_head(t) for t in (w_uk, w_uv, we_k, we_v, gamma_k, gamma_v))
        beta_v = None if beta_v is None else self._per_query_head(beta_v)
        qg = q_nope * gamma_k  # (B, T, H, n)
        m_q = w_uk.transpose(1, 2) @ (qg.unsqueeze(-1) * we_k)  # (B, T, H, C, E): M_i per query
        return m_q, qg.sum(-1), (w_uv, we_v, gamma_v, beta_v)

    @staticmethod
    def _absorbed_output(acc: torch.Tensor, m: torch.Tensor | None, outputs) -> torch.Tensor:
        """Each head's output (B, T, H, d_v) from A_i (B, T, H, C, E') and m_i (B, T, H; None
        without LayerNorm's mean): gamma_V * (diag(W_UV,i A_i W_UE,V,i^T) - m_i) + beta_V."""
        w_uv, we_v, gamma_v, beta_v = outputs
        o = ((w_uv @ acc) * we_v).sum(-1)  # (B, T, H, v)
        if m is not None:
            o = o - m.unsqueeze(-1)
        o = o * gamma_v
        return o if beta_v is None else o + beta_v

    def _per_query_head(self, t: torch.Tensor) -> torch.Tensor:
        """A KV head's tensor (G, ...) -> each query head's (H, ...)."""
        return t if self.n_kv == self.n_heads else t.repeat_interleave(
            self.n_heads // self.n_kv, dim=0)

    def _norm_affine(self, like: torch.Tensor):
        """The gate norm's gamma split per KV head into K and V parts, (G, n), (G, v), and
        beta's V part (G, v); ones / None where the norm has none."""
        H, n, v = self.n_kv, self.d_nope, self.d_v
        norm = self.gate_norm
        weight = getattr(norm, "weight", None)
        if weight is None:
            weight = torch.ones(H * (n + v), dtype=like.dtype, device=like.device)
        gamma_k, gamma_v = weight.view(H, n + v).split([n, v], dim=1)
        bias = getattr(norm, "bias", None)  # LayerNorm's beta; RMSNorm and none have none
        beta_v = None if bias is None else bias.view(H, n + v)[:, n:]
        return gamma_k, gamma_v, beta_v

    def _stats(self, fields: dict[str, torch.Tensor], dtype: torch.dtype):
        """(mu, inv_sigma) of every key, (B, S) each in the compute dtype; None where absent."""
        if not self.stats_width:
            return None, None
        stats = fields["norm_stats"].to(dtype)  # (B, S, 1 or 2)
        if self.gate_norm_kind == "rmsnorm":
            return None, stats[..., 0]
        return stats[..., 0], stats[..., 1]


def _bilinear(m: torch.Tensor, c: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """c_j^T M e_j for every query matrix M (B, T, H, C, E) and key (c_j, e_j) (B, S, C|E)
    -> (B, T, H, S). The wider of C and E is contracted first, as one batched matmul, so the
    transient is (B, T, H, min(C, E), S)."""
    B, T, H, C, E = m.shape
    if E >= C:
        y = (m.reshape(B, T * H * C, E) @ e.transpose(1, 2)).view(B, T, H, C, -1)  # M e_j
        return torch.einsum("bthcs,bsc->bths", y, c)
    y = (m.transpose(-1, -2).reshape(B, T * H * E, C) @ c.transpose(1, 2)).view(B, T, H, E, -1)
    return torch.einsum("bthes,bse->bths", y, e)


def _weighted_outer(w: torch.Tensor, c: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """sum_j w_j c_j e_j^T for weights w (B, T, H, S) -> (B, T, H, C, E); the narrower of C and E
    is weighted, then one batched matmul over S."""
    B, T, H, S = w.shape
    C, E = c.shape[-1], e.shape[-1]
    if C <= E:
        wc = w.unsqueeze(-2) * c.transpose(1, 2)[:, None, None]  # (B, T, H, C, S)
        return (wc.reshape(B, T * H * C, S) @ e).view(B, T, H, C, E)
    we = w.unsqueeze(-2) * e.transpose(1, 2)[:, None, None]  # (B, T, H, E, S)
    return (we.reshape(B, T * H * E, S) @ c).view(B, T, H, E, C).transpose(-1, -2)

