"""transformers implementation of egmla's decoder: MHA, MLA or EG-MLA attention.

This file is copied into every directory written by `python -m egmla.export --format hf` and
loaded by `AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)`. It needs
only transformers (5.x) and torch, not egmla, and computes the same function as egmla's model
(`egmla/models/`), which the export tests check on the same weights.

The cache stores what the variant caches in egmla, nothing decompressed:

    mha     per layer: K (after RoPE) and V               2 * n_kv_heads * head_dim per token
    mla     per layer: the latent c, the RoPE key(s)      d_c + rope_heads * d_rope per token
    egmla   as mla; with gate_position="kv" also the token ids, once for all layers

MLA and EG-MLA rebuild K/V from the cached latent at every step (egmla's "naive" form): the
same function as the absorbed form egmla's engine uses at decode, with more arithmetic and
less code. Attention runs through transformers' attention interface (sdpa by default).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

try:  # transformers 5.x: initializers that leave weights loaded from the checkpoint alone
    from transformers import initialization as init
except ImportError:  # 4.x
    from torch.nn import init

from .configuration_egmla import EgmlaConfig

# -----------------------------------------------------------------------------------------------
# Building blocks (the same arithmetic as egmla/models/layers.py)


class EgmlaRMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in at least float32, then cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    return {"layernorm": lambda: nn.LayerNorm(dim, eps=eps),
            "rmsnorm": lambda: EgmlaRMSNorm(dim, eps),
            "none": nn.Identity}[kind]()


def rotary(positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype,
           freqs: list[list[int]] | None = None, spectrum: int | None = None):
    """positions (B, T) -> cos, sin (B, 1, T, dim): the half-split ("rotate_half") layout, pair
    i = dims (i, i + dim/2) at theta^(-2i / dim).

    With `freqs` (one list of dim/2 indices j per RoPE key, a converted model's choice from the
    spectrum of a wider head), pair i of key h rotates at theta^(-2 freqs[h][i] / spectrum):
    cos, sin (B, keys, T, dim). Example: spectrum 24, freqs [[0, 3, 5, 11]] turns an 8-wide
    key's pairs at the frequencies of a 24-wide head's pairs 0, 3, 5 and 11.
    """
    work = torch.promote_types(dtype, torch.float32)
    if freqs is None:
        exponent = torch.arange(0, dim, 2, device=positions.device, dtype=torch.int64).to(work)
        inv_freq = 1.0 / (theta ** (exponent / dim))  # (dim / 2,)
    else:
        exponent = 2 * torch.tensor(freqs, device=positions.device, dtype=torch.int64)
        inv_freq = 1.0 / (theta ** (exponent.to(work) / spectrum))  # (keys, dim / 2)
    inv_freq = inv_freq.view(-1, 1, dim // 2)  # (1 or keys, 1, dim / 2)
    angles = positions.to(work)[:, None, :, None] * inv_freq  # (B, 1 or keys, T, dim / 2)
    angles = torch.cat((angles, angles), dim=-1)  # (B, 1 or keys, T, dim)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, D) by cos/sin (B, 1 or keys, T, D), each key's angles shared by
    heads / keys consecutive heads of x: pairs (i, i + D/2) rotate by one angle."""
    if cos.shape[1] not in (1, x.shape[1]):
        repeat = x.shape[1] // cos.shape[1]
        cos, sin = cos.repeat_interleave(repeat, dim=1), sin.repeat_interleave(repeat, dim=1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class EgmlaMLP(nn.Module):
    """down_proj of the hidden activations `config.ffn` names (configuration_egmla.py)."""

    def __init__(self, config: EgmlaConfig) -> None:
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.ffn = getattr(config, "ffn", "swiglu")
        self.gate_proj = None if self.ffn == "relu2" else nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.down_proj.init_as = "residual"  # see EgmlaPreTrainedModel._init_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.up_proj(x)
        if self.ffn == "relu2":
            return self.down_proj(F.relu(up).square())
        gate = self.gate_proj(x)
        if self.ffn == "swiglu":
            hidden = F.silu(gate) * up
        elif self.ffn == "reglu":
            hidden = F.relu(gate) * up
        else:  # drelu
            hidden = F.relu(gate) * F.relu(up)
        return self.down_proj(hidden)


def eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Plain attention for `attn_implementation="eager"`: q (B, H, T, D), k/v (B, G, S, .)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights, value)  # (B, H, T, Dv)
    return out.transpose(1, 2).contiguous(), weights


# -----------------------------------------------------------------------------------------------
# The cache


class EgmlaCache(Cache):
    """Per layer, the two per-token tensors the variant caches (K, V for MHA; c, k_rope for MLA
    and EG-MLA, k_rope's rope_heads keys side by side), grown by concatenation so storage
    equals what is cached; plus, for EG-MLA with gate_position="kv", the token ids (int32),
    stored once for all layers."""

    def __init__(self, config: EgmlaConfig) -> None:
        super().__init__(layers=[DynamicLayer() for _ in range(config.num_hidden_layers)])
        self.token_ids: torch.Tensor | None = None  # (B, S) int32

    def append_token_ids(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Cache the step's ids (B, T); return every id so far (B, S) as int64."""
        new = token_ids.to(torch.int32)
        self.token_ids = new if self.token_ids is None else torch.cat((self.token_ids, new), 1)
        return self.token_ids.long()

    def nbytes(self) -> int:
        """Bytes of every cached tensor (the storage actually allocated)."""
        tensors = [t for layer in self.layers if layer.is_initialized
                   for t in (layer.keys, layer.values)]
        if self.token_ids is not None:
            tensors.append(self.token_ids)
        return sum(t.untyped_storage().nbytes() for t in tensors)

    # Operations `generate` applies to every cached tensor (beam search, contrastive search...)
    # must move the ids with the layers.
    def reset(self) -> None:
        super().reset()
        self.token_ids = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.token_ids is not None:
            self.token_ids = self.token_ids.index_select(0, beam_idx.to(self.token_ids.device))

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self.token_ids is not None:
            self.token_ids = self.token_ids[:, : self.get_seq_length()]

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.token_ids is not None:
            self.token_ids = self.token_ids.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.token_ids is not None:
            self.token_ids = self.token_ids[indices]


# -----------------------------------------------------------------------------------------------
# Attention variants: forward(x, cos_sin, mask, cache, token_ids, key_ids) -> (B, T, d)


def _attention_function(config: EgmlaConfig) -> Callable:
    name = config._attn_implementation or "sdpa"
    return eager_attention if name == "eager" else ALL_ATTENTION_FUNCTIONS[name]


class EgmlaMHA(nn.Module):
    """Multi-head attention with grouped K/V heads (MHA, GQA, MQA)."""

    def __init__(self, config: EgmlaConfig, layer_idx: int) -> None:
        super().__init__()
        a, d, H = config.attention, config.hidden_size, config.num_attention_heads
        self.config, self.layer_idx, self.is_causal = config, layer_idx, True
        self.n_heads = H
        self.n_kv = a.get("n_kv_heads") or H
        self.head_dim = a.get("head_dim") or d // H
        self.num_key_value_groups = H // self.n_kv
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(d, H * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(H * self.head_dim, d, bias=False)
        self.o_proj.init_as = "residual"

    def forward(self, x, positions, mask, cache, key_ids, **kwargs):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = rotary(positions, self.head_dim, self.config.rope_theta, x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # (B, G, S, D)
        out, _ = _attention_function(self.config)(
            self, q, k, v, mask, scaling=self.scaling, dropout=0.0, **kwargs
        )
        return self.o_proj(out.reshape(B, T, -1))


class EgmlaMLA(nn.Module):
    """Multi-head latent attention; with `gate_embeddings`, EG-MLA's token-id gate.

    c = RMSNorm(W_DKV x) and k_rope = RoPE(W_KR x) are cached; K/V are rebuilt from c:
    [k_nope; v] = W_UKV c (MLA), Norm(W_UKV c * g) (EG-MLA, gate_position="kv"), or W_UKV c'
    with c' = Norm(c * g) cached instead of c (gate_position="latent"); g = W_UE E[token id],
    or g = 1 + W_UE E[token id] with `gate_residual`.

    A model converted from GQA (egmla.upcycle) may take more general forms, each off by default
    (DeepSeek's MLA): no norm on c (`latent_norm` false); G = `n_kv_heads` K/V heads
    up-projected from c, query head i reading head i // (H / G); Hr = `rope_heads` RoPE keys per
    token, query head i reading key i // (H / Hr), each key and its query heads rotating at the
    key's own frequencies (`rope_freqs`, per layer); `d_nope` 0. Attention then runs over
    lcm(G, Hr) K/V heads, grouped like GQA.
    """

    def __init__(self, config: EgmlaConfig, layer_idx: int) -> None:
        super().__init__()
        a, d, H = config.attention, config.hidden_size, config.num_attention_heads
        self.config, self.layer_idx, self.is_causal = config, layer_idx, True
        self.d_c, self.d_q = a["d_c"], a.get("d_q")
        self.d_nope, self.d_rope, self.d_v = a["d_nope"], a["d_rope"], a["d_v"]
        self.n_heads, self.n_kv, self.rope_heads = H, a.get("n_kv_heads") or H, a.get("rope_heads", 1)
        self.attn_heads = math.lcm(self.n_kv, self.rope_heads)  # K/V heads attended (H by default)
        self.num_key_value_groups = H // self.attn_heads
        freqs = a.get("rope_freqs")
        self.rope_freqs = None if freqs is None else freqs[layer_idx]  # per RoPE key
        self.scaling = (self.d_nope + self.d_rope) ** -0.5
        q_width = H * (self.d_nope + self.d_rope)
        # The latent norms' eps: latent_norm_eps where set (absent or null: rms_norm_eps)
        latent_eps = a.get("latent_norm_eps") or config.rms_norm_eps
        if self.d_q is None:
            self.q_proj = nn.Linear(d, q_width, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, self.d_q, bias=False)
            self.q_a_layernorm = EgmlaRMSNorm(self.d_q, latent_eps)
            self.q_b_proj = nn.Linear(self.d_q, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.d_c + self.rope_heads * self.d_rope, bias=False)
        self.kv_a_layernorm = (EgmlaRMSNorm(self.d_c, latent_eps)
                               if a.get("latent_norm", True) else nn.Identity())
        kv_width = self.n_kv * (self.d_nope + self.d_v)
        self.kv_b_proj = nn.Linear(self.d_c, kv_width, bias=False)
        self.o_proj = nn.Linear(H * self.d_v, d, bias=False)
        self.o_proj.init_as = "residual"
        self.gate_position = a.get("gate_position") if a["type"] == "egmla" else None
        if self.gate_position is not None:
            gated = kv_width if self.gate_position == "kv" else self.d_c
            self.gate_embed_proj = nn.Linear(a["d_e"], gated, bias=False)  # W_UE
            self.gate_embed_proj.init_as = "gate_proj"
            self.gate_norm = make_norm(a["gate_norm"], gated, config.rms_norm_eps)
            if self.gate_position == "kv":
                self.gate_norm.init_as = "kv_gate_norm"
            self.gate_residual = a.get("gate_residual", False)

    def gate(self, gate_table: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        """g = W_UE E[id] (or 1 + W_UE E[id]) for the ids (B, S): (B, S, gated width)."""
        g = self.gate_embed_proj(gate_table(ids))
        return g + 1 if self.gate_residual else g

    def forward(self, x, positions, mask, cache, key_ids, gate_table=None, token_ids=None,
                **kwargs):
        # H query heads, G K/V heads, Hr RoPE keys, A = lcm(G, Hr) heads attended
        B, T, _ = x.shape
        H, G, Hr, A = self.n_heads, self.n_kv, self.rope_heads, self.attn_heads
        n, r, dv = self.d_nope, self.d_rope, self.d_v
        q = self.q_proj(x) if self.d_q is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(B, T, H, n + r).transpose(1, 2).split([n, r], dim=-1)
        cos, sin = rotary(positions, r, self.config.rope_theta, x.dtype, self.rope_freqs, n + r)
        q_rope = apply_rope(q_rope, cos, sin)  # (B, H, T, r)

        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.d_c, Hr * r], dim=-1)
        c = self.kv_a_layernorm(c)  # (B, T, d_c)
        if self.gate_position == "latent":
            c = self.gate_norm(c * self.gate(gate_table, token_ids))
        k_rope = apply_rope(k_rope.view(B, T, Hr, r).transpose(1, 2), cos, sin)  # (B, Hr, T, r)
        k_rope = k_rope.transpose(1, 2).reshape(B, T, Hr * r)  # cached flat: tokens on dim -2
        if cache is not None:
            c, k_rope = cache.update(c, k_rope, self.layer_idx)  # (B, S, d_c), (B, S, Hr * r)
        S = c.shape[1]

        kv = self.kv_b_proj(c)  # (B, S, G * (n + d_v))
        if self.gate_position == "kv":
            kv = self.gate_norm(kv * self.gate(gate_table, key_ids))
        k_nope, v = kv.view(B, S, G, n + dv).transpose(1, 2).split([n, dv], dim=-1)  # (B, G, S, .)
        k_rope = k_rope.view(B, S, Hr, r).transpose(1, 2)  # (B, Hr, S, r)
        if A != G:
            k_nope, v = k_nope.repeat_interleave(A // G, dim=1), v.repeat_interleave(A // G, dim=1)
        k_rope = k_rope.expand(B, A, S, r) if Hr == 1 else k_rope.repeat_interleave(A // Hr, dim=1)
        k = torch.cat((k_nope, k_rope), dim=-1)  # (B, A, S, n + r)
        query = torch.cat((q_nope, q_rope), dim=-1)  # (B, H, T, n + r)
        out, _ = _attention_function(self.config)(
            self, query, k, v, mask, scaling=self.scaling, dropout=0.0, **kwargs
        )
        return self.o_proj(out.reshape(B, T, -1))


class EgmlaDecoderLayer(nn.Module):
    def __init__(self, config: EgmlaConfig, layer_idx: int) -> None:
        super().__init__()
        attention = EgmlaMHA if config.attention["type"] == "mha" else EgmlaMLA
        self.input_layernorm = EgmlaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention(config, layer_idx)
        self.post_attention_layernorm = EgmlaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = EgmlaMLP(config)

    def forward(self, x, positions, mask, cache, key_ids, **kwargs) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, mask, cache, key_ids, **kwargs)
        return x + self.mlp(self.post_attention_layernorm(x))


# -----------------------------------------------------------------------------------------------
# Models


class EgmlaPreTrainedModel(PreTrainedModel):
    config_class = EgmlaConfig
    base_model_prefix = "model"
    _no_split_modules: ClassVar[list[str]] = ["EgmlaDecoderLayer"]
    _supports_sdpa = True
    _supports_attention_backend = True

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model makes its own EgmlaCache (latents, not K/V, for MLA)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """egmla's initialization (egmla.models.transformer.Transformer.reset_parameters, then
        the gate's by the attention's `gate_init`): weights N(0, initializer_range^2), the
        residual outputs (o_proj, down_proj) N(0, initializer_range^2 / (2 layers)), norms at
        one; the gate `small` as every weight, `random` E ~ N(0, 1) and W_UE ~ N(0, 1 / d_e),
        `matched` that with the `kv` gate norm's gain at initializer_range * sqrt(d_c),
        `identity` E ~ N(0, 1) and W_UE = 0. transformers skips a remote-code module with no
        parameters of its own (an attention block), so each weight's module carries its role
        (`init_as`, set where it is built)."""
        std, role = self.config.initializer_range, getattr(module, "init_as", None)
        gate_init = self.config.attention.get("gate_init", "small")
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, 0.0, std)
            if role == "residual":
                init.normal_(module.weight, 0.0, std / math.sqrt(2 * self.config.num_hidden_layers))
            elif role == "gate_table" and gate_init != "small":
                init.normal_(module.weight, 0.0, 1.0)
            elif role == "gate_proj" and gate_init == "identity":
                init.zeros_(module.weight)
            elif role == "gate_proj" and gate_init != "small":
                init.normal_(module.weight, 0.0, module.in_features**-0.5)
        if isinstance(module, (EgmlaRMSNorm, nn.LayerNorm)):
            init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
            if role == "kv_gate_norm" and gate_init == "matched":
                init.constant_(module.weight, std * self.config.attention["d_c"] ** 0.5)


class EgmlaModel(EgmlaPreTrainedModel):
    def __init__(self, config: EgmlaConfig) -> None:
        super().__init__(config)
        a = config.attention
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            EgmlaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = EgmlaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gate_embeddings = None
        if a["type"] == "egmla":  # one table per group of `gate_group_size` consecutive layers
            self.gate_group_size = a["gate_group_size"]
            tables = config.num_hidden_layers // self.gate_group_size
            self.gate_embeddings = nn.ModuleList(
                nn.Embedding(config.vocab_size, a["d_e"]) for _ in range(tables)
            )
            for table in self.gate_embeddings:
                table.init_as = "gate_table"
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,  # the name before transformers 5.x's `cache`
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if self.gate_embeddings is not None and input_ids is None:
            raise ValueError("EG-MLA gates on token ids: pass input_ids, not inputs_embeds")
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = EgmlaCache(self.config)
        if cache is not None and not isinstance(cache, EgmlaCache):
            raise TypeError(f"egmla models use EgmlaCache, got {type(cache).__name__}")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T, _ = x.shape
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=x.device)[None].expand(B, T)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=x, attention_mask=attention_mask, cache=cache,
            position_ids=position_ids,
        )
        key_ids = input_ids
        needs_ids = self.gate_embeddings is not None and self.config.attention["gate_position"] == "kv"
        if needs_ids and cache is not None:
            key_ids = cache.append_token_ids(input_ids)  # every cached id plus this step's
        for i, layer in enumerate(self.layers):
            extra = {}
            if self.gate_embeddings is not None:
                extra = {"gate_table": self.gate_embeddings[i // self.gate_group_size],
                         "token_ids": input_ids}
            x = layer(x, position_ids, mask, cache, key_ids, **extra, **kwargs)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(x), **{_CACHE_FIELD: cache})


_CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


class EgmlaForCausalLM(EgmlaPreTrainedModel, GenerationMixin):
    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: EgmlaConfig) -> None:
        super().__init__(config)
        self.model = EgmlaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Cache | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            cache=cache if cache is not None else past_key_values, inputs_embeds=inputs_embeds,
            use_cache=use_cache, **kwargs,
        )
        hidden = out.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep])
        loss = None
        if labels is not None:  # next-token loss; -100 ignored, as in transformers' models
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits,
                                      **{_CACHE_FIELD: getattr(out, _CACHE_FIELD)})
