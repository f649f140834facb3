"""The decoder-only backbone: token embedding, pre-norm blocks, final norm, LM head.

    logits = model(token_ids)                          # training: whole sequences, causal
    logits = model(token_ids, cache=cache)             # prefill or decode: cache passed in

The attention variant is chosen by `config.attention.type`; every variant implements
`forward(x, positions, cache=None, token_ids=None)` and `cache_spec()`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from egmla import kernels
from egmla.cache import TOKEN_IDS, CacheSpec, CacheStep, ContiguousCache, LayerView
from egmla.config import ModelConfig
from egmla.models.attention import build_attention
from egmla.models.attention.common import TOKEN_IDS_FIELD
from egmla.models.layers import FeedForward, Linear, RMSNorm, Rotary
from egmla.models.positions import Positions


class Block(nn.Module):
    def __init__(self, config: ModelConfig, attention: nn.Module) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = attention
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = FeedForward(config.d_model, config.d_ff, config.ffn)
        self._kernel: tuple | None = None  # (x's dtype and device, what kernel_weights returns)

    def forward(self, x: torch.Tensor, positions: Positions | torch.Tensor,
                cache: LayerView | None = None, token_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions, cache, token_ids)
        return x + self.mlp(self.mlp_norm(x))

    def kernel_weights(self, x: torch.Tensor) -> tuple[kernels.BlockWeights, Rotary] | None:
        """This block's weights as egmla.kernels.decode_blocks takes them, with its RoPE, for
        steps on x's dtype and device; None where the kernel cannot compute the block (its
        attention is not plain RoPE attention over K and V, or its weights do not suit).

        Checked once and kept, and checked again when x's dtype or device changes. The kept
        weights are the parameters themselves, so an in-place edit (`copy_`, `load_state_dict`,
        `model.to`) shows at the next step; a parameter or submodule assigned anew is seen only
        after `forget_kernel_weights()` (`Transformer.weights_replaced()` for every block)."""
        key = (x.dtype, x.device)
        if self._kernel is None or self._kernel[0] != key:
            attn = self.attn.rope_kv_attention()
            weights = None if attn is None else kernels.block_weights(
                (self.attn_norm, self.mlp_norm), (attn.wq, attn.wk, attn.wv, attn.wo),
                self.mlp.dense_kernel(), attn.scale)
            self._kernel = (key, None if weights is None else (weights, attn.rope))
        return self._kernel[1]

    def forget_kernel_weights(self) -> None:
        """Drop the weights `kernel_weights` kept: the next decode step reads the block again."""
        self._kernel = None


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(
            Block(config, attention) for attention in build_attention(config)
        )
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, init_std) weights and unit norms; residual outputs scaled by 1/sqrt(2 L); then each
        attention layer's own init (EG-MLA: its gate's, by `gate_init`), applied last so the
        generic pass can never overwrite it, whatever order `named_modules()` visits shared
        modules in. The HF export's modeling code draws a fresh model the same way."""
        if self.tok_emb.weight.is_meta:
            return  # built for its shapes only (e.g. cache_spec_for): nothing to initialize
        std = self.config.init_std
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
            if name.endswith(("attn.wo", "mlp.w_down")):
                nn.init.normal_(module.weight, std=std / math.sqrt(2 * self.config.n_layers))
            if isinstance(module, (RMSNorm, nn.LayerNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        for block in self.layers:
            block.attn.reset_parameters()

    @classmethod
    def from_state_dict(cls, config: ModelConfig, weights: Mapping[str, torch.Tensor]) -> Transformer:
        """A model of `config` holding a copy of `weights` (as `state_dict()` names them; each
        keeps its dtype and device, and the model owns its memory: not a view of the caller's
        tensors nor of a file's mapped pages), built without drawing the random init that loading
        would overwrite (most of the time it took to load a 135M model). A parameter shared by
        several modules (tied embeddings, a gate table shared by layers) stays one parameter,
        found under any one of its names. ValueError names a missing, unexpected or mis-shaped
        tensor."""
        with torch.device("meta"):
            model = cls(config)
        groups: dict[int, list[str]] = {}  # one parameter -> every name it has
        for name, param in model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(param), []).append(name)
        missing = [names[0] for names in groups.values() if not any(n in weights for n in names)]
        unexpected = sorted(set(weights) - {n for names in groups.values() for n in names})
        if missing or unexpected:
            raise ValueError(f"missing tensors {missing[:4]}" if missing
                             else f"unexpected tensors {unexpected[:4]}")
        state = {}
        for names in groups.values():
            given = next(weights[n] for n in names if n in weights)
            shared = nn.Parameter(given.detach().clone(memory_format=torch.contiguous_format))
            state.update(dict.fromkeys(names, shared))  # one object: assigned, it stays shared
        try:
            model.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as err:  # a shape that does not match the config
            raise ValueError(" ".join(str(err).split())) from None
        return model

    def weights_replaced(self) -> None:
        """Call after assigning parameters or submodules anew (`block.mlp.w_up.weight =
        nn.Parameter(...)`, a swapped module): the decode kernel's kept weights
        (`Block.kernel_weights`) are read again at the next step. Edits in place need no call."""
        for block in self.layers:
            block.forget_kernel_weights()

    def cache_spec(self) -> CacheSpec:
        layers = tuple(block.attn.cache_spec() for block in self.layers)
        needs_ids = any(block.attn.needs_token_ids for block in self.layers)
        return CacheSpec(layers=layers, sequence={TOKEN_IDS_FIELD: TOKEN_IDS} if needs_ids else {})

    def new_cache(
        self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None
    ) -> ContiguousCache:
        """A contiguous cache for this model, in its parameters' dtype and device by default."""
        weight = self.tok_emb.weight
        return ContiguousCache(
            self.cache_spec(),
            batch_size,
            max_len or self.config.max_seq_len,
            dtype=dtype or weight.dtype,
            device=weight.device,
        )

    def num_params(self, include_gate_tables: bool = True) -> int:
        """Parameters of the built module (shared and tied tensors counted once)."""
        total = sum(p.numel() for p in self.parameters())
        if not include_gate_tables:
            tables = {id(t): t for b in self.layers for t in b.attn.lookup_tables()}
            total -= sum(w.numel() for w in tables.values())
        return total

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: CacheStep | None = None,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """token_ids (B, T) -> logits (B, T, vocab), or only at the indices in `logits_at`.

        `positions` (B, T), (1, T) or (T,) default to the next T positions: 0..T-1 without a cache,
        after the cached tokens with one. `logits_at` (B,) picks one index per row (the last real
        token of a prefill chunk) -> (B, vocab); (B, K) picks K per row (the continuation of a
        scored pair) -> (B, K, vocab). The LM head then runs on B or B * K tokens, not B * T.
        """
        B, T = token_ids.shape
        if positions is None:  # a paged (ragged) step always passes its positions
            positions = (cache.next_positions(T) if cache is not None
                         else torch.arange(T, device=token_ids.device))
        positions = positions[None] if positions.dim() == 1 else positions  # (1, T) broadcasts
        if cache is not None:
            cache.begin({TOKEN_IDS_FIELD: token_ids}, positions)
        x = self.tok_emb(token_ids)  # (B, T, d)
        views = [cache.layer(i) for i in range(len(self.layers))] if cache is not None else None
        # this forward's RoPE angles and masks, computed once and shared by the layers
        shared = Positions(positions)
        for i, block in enumerate(self.layers):
            x = block(x, shared, views[i] if views is not None else None, token_ids)
        if cache is not None:
            cache.advance()
        if logits_at is not None:
            rows = torch.arange(B, device=x.device)
            x = x[rows if logits_at.dim() == 1 else rows[:, None], logits_at]  # (B, d) or (B, K, d)
        return self.lm_head(self.norm(x))


def cache_spec_for(config: ModelConfig) -> CacheSpec:
    """The cache spec of a config, read from the real layers built on the meta device (no memory)."""
    with torch.device("meta"):
        return Transformer(config).cache_spec()
