"""What the attention variants share: the layer's base class and scaled dot-product attention
with the causal mask from positions."""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from egmla.config import AttentionConfig, ModelConfig
from egmla.models.layers import Rotary
from egmla.models.positions import Positions

# The per-sequence cache field holding every token's id (EG-MLA `kv` reads its keys' ids).
TOKEN_IDS_FIELD = "token_ids"


class RopeKV(NamedTuple):
    """softmax(rope(x wq) . rope(x wk) * scale) (x wv) wo, K/V heads shared by query heads."""

    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    rope: Rotary
    scale: float


class AttentionLayer(nn.Module):
    """Base of the attention modules. Besides `forward(x, positions, cache=None, token_ids=None)`
    and `cache_spec()`, a variant owns how its layers are built (`build_layers`: one module per
    layer, with whatever they share), initialized beyond the model's generic pass
    (`reset_parameters`) and counted (`lookup_tables`), so the model never asks which it is."""

    # The config class (egmla.config) whose models this module computes; the module of a config
    # is found by it (egmla.models.attention.attention_module). None: a base, or a form that
    # another class's `build_layers` chooses.
    config_class: ClassVar[type[AttentionConfig] | None] = None
    needs_token_ids = False  # whether the model must cache every token's id for this layer

    @classmethod
    def build_layers(cls, config: ModelConfig) -> list[AttentionLayer]:
        """The model's `n_layers` attention modules (independent ones by default)."""
        return [cls(config) for _ in range(config.n_layers)]

    def reset_parameters(self) -> None:
        """Init beyond the model's default N(0, init_std) (`Transformer.reset_parameters`): none."""

    def rope_kv_attention(self) -> RopeKV | None:
        """This layer's weights when it is plain RoPE attention over cached fields `k` and `v`
        (MHA, GQA), which a fused decode block (egmla.kernels.decode_block) may run in place of
        `forward`; None (the default) when its computation is anything else."""
        return None

    def lookup_tables(self) -> list[nn.Parameter]:
        """Per-token lookup tables (EG-MLA's gate tables), which parameter counts may leave out."""
        return []

    def decode_cost(self, context: int, dtype: torch.dtype = torch.float32) -> dict[str, int]:
        """Analytic cost of one decode step of this layer (one query over `context` cached keys),
        for the computation it runs then: multiply-accumulates per cached key and per query (the
        part that does not grow with the context), the cache bytes it reads per key, and the
        bytes of lookup-table rows it reads per key (weights, not cache)."""
        raise NotImplementedError

    def _cache_bytes_per_key(self, dtype: torch.dtype, auxiliary: bool = True) -> int:
        return sum(f.nbytes(dtype) for f in self.cache_spec().values() if auxiliary or not f.auxiliary)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    positions: Positions | torch.Tensor,
    key_positions: torch.Tensor | None,
) -> torch.Tensor:
    """Causal attention; K/V may have fewer heads than Q (GQA/MQA, and MLA's absorbed decode).

    q (B, T, H, Dk), k (B, S, Hkv, Dk), v (B, S, Hkv, Dv) -> (B, T, H, Dv).
    Without `key_positions` the keys are the queries' own tokens in order (training, or a
    prefill with no cache), so the plain causal mask applies. Otherwise query at position p
    sees every cached key at position <= p. `key_positions` is (S,) when all rows share them
    (contiguous cache) or (B, S) for ragged rows (paged cache), whose padding slots carry a
    position larger than any query's, so the mask hides them. The layers of a forward given one
    `Positions` share one mask.
    """
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T or S, D)
    B, H, T, _ = q.shape
    G = k.shape[1]
    if key_positions is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=G != H)
        return out.transpose(1, 2)  # (B, T, H, Dv)
    # GQA/MQA with a mask: fold the R = H / G query heads that share a K/V head into the query
    # axis, (B, G, R * T, D), so SDPA sees plain MHA over G heads. Same function as
    # enable_gqa=True, which on CPU takes a slow path when a mask is given (20x at decode).
    R = H // G
    q = q.reshape(B, G, R * T, q.shape[-1])
    mask = Positions.of(positions).causal_mask(key_positions, R)  # (B or 1, 1, R * T, S)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # (B, G, R*T, Dv)
    # reshape, not view: CUDA's SDPA kernels may return (B, G, R*T, Dv) laid out as
    # (B, R*T, G, Dv) in memory, which no view can split (it failed a step on an H200)
    return out.reshape(B, H, T, -1).transpose(1, 2)  # (B, T, H, Dv)

