"""The study's control arms (docs/study.md): variants that keep one part of EG-MLA and drop
another, so that a gain can be traced to token identity, to gating, or to neither.

- `egmla_const_gate` (EGMLAConstGate; EGMLALatentConstGate under `gate_position: latent`): EG-MLA
  with one gate row for every token: gating without token identity (the control for
  `gate_position: kv`);
- `egmla_hidden_gate` (EGMLAHiddenGate): the latent gated by sigmoid(W_G h) from the hidden state
  (the control for `gate_position: latent`);
- `mla_value_embed` (MLAValueEmbed): MLA with a token-id embedding added to the values: token
  identity without multiplication;
- `mla_kv_embed` (MLAKVEmbed): the embedding added to the keys and the values (where EG-MLA
  `kv` multiplies), and `egmla_v_gate` (EGMLAValueGate): the gate multiplying the values only
  (where `mla_value_embed` adds): together they separate adding from multiplying at either
  placement.
"""

from __future__ import annotations

import torch
from torch import nn

from egmla.config import (EGMLAConstGateConfig, EGMLAHiddenGateConfig, EGMLAValueGateConfig,
                          MLAKVEmbedConfig, MLAValueEmbedConfig, ModelConfig)
from egmla.models.attention.common import attend
from egmla.models.attention.egmla import EGMLA, EGMLALatent
from egmla.models.attention.mla import MLA
from egmla.models.layers import Linear, make_norm


class OneGateRow:
    """The const-gate control's gate (mixed into EGMLA and EGMLALatent): every token reads the
    layer's one gate row, so the gate is one learned vector g = W_UE e (same computation, init
    and norm as the token gate, no token identity)."""

    gate_reads_ids = False

    @classmethod
    def gate_tables(cls, config: ModelConfig) -> list[nn.Embedding]:
        return [nn.Embedding(1, config.attention.d_e) for _ in range(config.n_layers)]

    def lookup_tables(self) -> list[nn.Parameter]:
        return []  # one row, not a per-token table: an ordinary parameter

    def gate_rows(self, token_ids: torch.Tensor | None,
                  like: torch.Tensor | None = None) -> torch.Tensor:
        shape = like.shape[:-1] if like is not None else token_ids.shape
        return self.gate_table.weight[0].expand(*shape, -1)


class EGMLALatentConstGate(OneGateRow, EGMLALatent):
    """`egmla_const_gate` with `gate_position: latent`: the latent gated by the one row."""


class EGMLAConstGate(OneGateRow, EGMLA):
    """`egmla_const_gate` (the control for `gate_position: kv`); a `latent` config builds
    EGMLALatentConstGate's layers."""

    config_class = EGMLAConstGateConfig
    latent_form = EGMLALatentConstGate


class EGMLAHiddenGate(MLA):
    """`egmla_hidden_gate`: the latent gated from the hidden state, c' = Norm(c * sigmoid(W_G h)),
    then cached; attention is MLA's over c' (absorbed decode included)."""

    config_class = EGMLAHiddenGateConfig

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        a = config.attention
        self.w_gate = Linear(config.d_model, a.d_c, bias=False)  # W_G
        self.gate_norm = make_norm(a.gate_norm, a.d_c, config.norm_eps)

    def cached_fields(self, x, token_ids, cos, sin, with_auxiliary):
        fields = super().cached_fields(x, token_ids, cos, sin, with_auxiliary)
        fields["c"] = self.gate_norm(fields["c"] * torch.sigmoid(self.w_gate(x)))
        return fields


class MLAValueEmbed(MLA):
    """`mla_value_embed`: v_j = W_UV c_j + W_VE E[id_j], one table E (vocab x d_e) per layer.
    Absorbed, the attended embedding sum_j a_j e_j rides along with the attended latent (one
    value of width d_c + d_e) and is up-projected once per query."""

    config_class = MLAValueEmbedConfig
    needs_token_ids = True

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        a = config.attention
        self.d_e = a.d_e
        self.value_table = nn.Embedding(config.vocab_size, a.d_e)  # E
        self.w_value = Linear(a.d_e, config.n_heads * a.d_v, bias=False)  # W_VE

    def lookup_tables(self) -> list[nn.Parameter]:
        return [self.value_table.weight]

    def _key_rows(self, key_ids: torch.Tensor | None) -> torch.Tensor:
        if key_ids is None:
            raise ValueError("mla_value_embed needs the token ids: pass token_ids to forward")
        return self.value_table(key_ids)  # (B, S, d_e)

    def expand(self, c, key_ids):
        k_nope, v = super().expand(c, key_ids)
        B, S, _ = c.shape
        return k_nope, v + self.w_value(self._key_rows(key_ids)).view(B, S, self.n_heads, self.d_v)

    def _absorbed_scores(self, q_nope, q_rope, c, e, k_rope, w_uk):
        """The absorbed query and key: [W_UK^T q, q_rope] against [c, k_rope] (the keys carry no
        token identity here), (B, T, H, .) and (B, S, 1, .)."""
        q = torch.cat((torch.einsum("bthn,hnc->bthc", q_nope, w_uk), q_rope), dim=-1)
        return q, torch.cat((c, k_rope), dim=-1)[:, :, None]

    def _absorbed(self, q_nope, q_rope, fields, key_ids, positions, key_positions):
        c, k_rope, e = fields["c"], fields["k_rope"], self._key_rows(key_ids).to(fields["c"].dtype)
        H, n, v, C = self.n_heads, self.d_nope, self.d_v, self.d_c
        w_uk, w_uv = self.wkv_b.weight.view(H, n + v, C).split([n, v], dim=1)
        q, k = self._absorbed_scores(q_nope, q_rope, c, e, k_rope, w_uk)
        value = torch.cat((c, e), dim=-1)[:, :, None]  # (B, S, 1, C + E)
        o_c, o_e = attend(q, k, value, self.scale, positions, key_positions).split([C, self.d_e], -1)
        w_ve = self.w_value.weight.view(H, v, self.d_e)
        return (torch.einsum("bthc,hvc->bthv", o_c, w_uv)
                + torch.einsum("bthe,hve->bthv", o_e, w_ve))

    def decode_cost(self, context: int, dtype: torch.dtype = torch.float32) -> dict[str, int]:
        cost = super().decode_cost(context, dtype)
        H, E, v = self.n_heads, self.d_e, self.d_v
        absorbed = self._use_absorbed(1, context, cached=True)
        return {**cost,
                "macs_per_key": cost["macs_per_key"] + (H * E if absorbed else H * v * E),
                "macs_per_query": cost["macs_per_query"] + (H * v * E if absorbed else 0),
                "cache_bytes_per_key": cost["cache_bytes_per_key"] + 4,  # the int32 id
                "lookup_bytes_per_key": E * dtype.itemsize}


class MLAKVEmbed(MLAValueEmbed):
    """`mla_kv_embed`: k_j = W_UK c_j + W_KE E[id_j] and v_j = W_UV c_j + W_VE E[id_j], one table
    E per layer. Absorbed, the key is [c_j, e_j, k_rope_j] against the query [W_UK^T q, W_KE^T q,
    q_rope] (`_absorbed_scores`), and the value [c_j, e_j] as for `mla_value_embed`."""

    config_class = MLAKVEmbedConfig

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        self.w_key = Linear(self.d_e, config.n_heads * self.d_nope, bias=False)  # W_KE

    def expand(self, c, key_ids):
        k_nope, v = super().expand(c, key_ids)
        B, S, _ = c.shape
        added = self.w_key(self._key_rows(key_ids)).view(B, S, self.n_heads, self.d_nope)
        return k_nope + added, v

    def _absorbed_scores(self, q_nope, q_rope, c, e, k_rope, w_uk):
        """[W_UK^T q, W_KE^T q, q_rope] against [c, e, k_rope]."""
        w_ke = self.w_key.weight.view(self.n_heads, self.d_nope, self.d_e)
        q = torch.cat((torch.einsum("bthn,hnc->bthc", q_nope, w_uk),
                       torch.einsum("bthn,hne->bthe", q_nope, w_ke), q_rope), dim=-1)
        return q, torch.cat((c, e, k_rope), dim=-1)[:, :, None]  # (B, S, 1, C + E + r)

    def decode_cost(self, context: int, dtype: torch.dtype = torch.float32) -> dict[str, int]:
        cost = super().decode_cost(context, dtype)
        H, E, n = self.n_heads, self.d_e, self.d_nope
        absorbed = self._use_absorbed(1, context, cached=True)
        return {**cost,  # the keys' embedding: scored per key absorbed, expanded per key naive
                "macs_per_key": cost["macs_per_key"] + (H * E if absorbed else H * n * E),
                "macs_per_query": cost["macs_per_query"] + (H * n * E if absorbed else 0)}


class EGMLAValueGate(EGMLA):
    """`egmla_v_gate`: the token-id gate and its norm on the values only, v_j = Norm(W_UV c_j *
    g_j), the keys MLA's (W_UK c_j). The rebuild only (`impl: naive`)."""

    config_class = EGMLAValueGateConfig

    def expand(self, c, key_ids):
        B, S, _ = c.shape
        u = self.wkv_b(c).view(B, S, self.n_kv, self.d_nope + self.d_v)
        k_nope, v = u.split([self.d_nope, self.d_v], dim=-1)
        gated = self.gate_norm(v.reshape(B, S, -1) * self.gate(key_ids, c))
        return k_nope, gated.view(B, S, self.n_kv, self.d_v)

    def step_macs(self, T: int, S: int) -> dict[str, int]:
        G, H, n, v, r, C, E = (self.n_kv, self.n_heads, self.d_nope, self.d_v, self.d_rope,
                               self.d_c, self.d_e + self.gate_residual)
        rebuild = S * G * ((n + v) * C + v * E) + T * S * H * (n + r + v)
        return {"rebuild": rebuild, "absorbed": rebuild}  # no absorbed form: never preferred
