"""The model step: a step's plan (serve/scheduler.py) in, logits out, over the paged KV cache.

The executor owns what running the model takes on the serving side: the paged cache
(`PagedKVCache`, its attention backend chosen for the device, serve.attention), the decode
model (eager, or through torch.compile), the fused decode (`fused_decode`: on the CPU, a
decode step of a Llama-shaped model runs each block in one kernel call straight from the
paged pools, the executor asking each block for its weights), and how a step's rows are
grouped into ragged forwards (`forward_groups`; where the backend attends within each row of
a packed step, a step's prefill rows run in one forward of all their tokens, `Executor.packs`).
It reads only the plan's rows (their tokens, positions, block tables), never the engine's live
sequences.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from egmla import kernels
from egmla.models import Transformer
from egmla.models.attention.common import TOKEN_IDS_FIELD
from egmla.models.transformer import Block
from serve import attention
from serve.config import EngineConfig
from serve.paged_cache import PagedKVCache, PagedStep, _PagedLayer
from serve.scheduler import ScheduledRow

log = logging.getLogger("serve")


def compiled_decode(model: Transformer):
    """`model` through torch.compile for decode steps: dynamic shapes from the first call (the
    batch and the context change every step), the CPU kernels loaded first (their loading
    takes a lock, which a traced region cannot)."""
    from egmla import kernels

    kernels.load()
    return torch.compile(model, dynamic=True)


class Executor:
    """Runs `model` over a paged KV cache sized by `config` (num_blocks set), in `dtype`."""

    def __init__(self, model: Transformer, config: EngineConfig, dtype: torch.dtype) -> None:
        self.model, weight, spec = model, model.tok_emb.weight, model.cache_spec()
        self.device = weight.device
        if self.device.type == "cpu":  # a decode step streams the weights: from huge pages
            placed = kernels.place_weights(model)
            log.info("weights on huge pages: %s", f"{placed / 2**20:.0f} MiB moved" if placed
                     else kernels.hugepages() or "already")
        # The layers that declare plain RoPE attention over their cached k and v: the ones that
        # attend through the backend (serve.attention), with their head dims.
        kv = [i for i, block in enumerate(model.layers) if block.attn.rope_kv_attention() is not None]
        head_dims = {spec.layers[i]["k"].shape[-1] for i in kv}
        self._prepares = bool(kv)  # what the backend's layers share is built before a forward
        self._fuses = bool(kv) and len(kv) == len(model.layers)  # every block may run fused
        choice = attention.select(config.attention_backend, weight.device, dtype,
                                  config.block_size, head_dims)
        # whether prefill rows run packed (serve/paged_cache.py): the backend attends within each
        # row of a packed step, and every layer attends through it
        self.packs = self._fuses and choice.backend.packs
        self.attention_backend = choice.name  # what runs, and why (logged)
        log.info("attention backend: %s (%s)", choice.name, choice.reason)
        self.cache = PagedKVCache(spec, config.num_blocks, config.block_size, dtype=dtype,
                                  device=weight.device, attention=choice.backend)
        self.decode_model = model if config.enforce_eager else compiled_decode(model)

    def forward(self, rows: list[ScheduledRow], every: bool = False) -> torch.Tensor:
        """One ragged forward over the paged cache -> (rows, vocab) logits of each row's last
        new token, or (`every`) (rows, new tokens, vocab) at every position. Several prefill
        rows run as one row of all their tokens where the executor `packs`: no padding."""
        if self.packs and not every and len(rows) > 1 and all(r.num_new_tokens > 1 for r in rows):
            return self._packed(rows)
        T = max(r.num_new_tokens for r in rows)
        pad = [[0] * (T - r.num_new_tokens) for r in rows]  # padding queries sit at position 0
        tokens = torch.tensor([[*r.token_ids, *p] for r, p in zip(rows, pad)], dtype=torch.long)
        positions = torch.tensor([[*range(r.start, r.start + r.num_new_tokens), *p]
                                  for r, p in zip(rows, pad)], dtype=torch.long)
        step = self.cache.step([r.block_table for r in rows], [r.start for r in rows],
                               [r.num_new_tokens for r in rows])
        if self._prepares:  # (FlexAttention's mask, outside any compiled region)
            self.cache.attention.prepare(step)
        if T == 1 and not every and self._fuses and self.cache.attention.fuses_blocks:
            logits = self._fused(tokens.to(self.device), positions.to(self.device), step)
            if logits is not None:
                return logits
        model = self.decode_model if step.decode_only else self.model
        if T == 1 and not every:  # one token per row: its logits are the step's only ones
            return model(tokens.to(self.device), positions.to(self.device), cache=step)[:, 0]
        last = (None if every else
                torch.tensor([r.num_new_tokens - 1 for r in rows], device=self.device))
        return model(tokens.to(self.device), positions.to(self.device), cache=step,
                     logits_at=last)

    def _packed(self, rows: list[ScheduledRow]) -> torch.Tensor:
        """The rows' new tokens as one packed row (1, N): (rows, vocab) logits of each row's
        last new token."""
        lengths = [r.num_new_tokens for r in rows]
        tokens = torch.tensor([[t for r in rows for t in r.token_ids]], dtype=torch.long)
        positions = torch.cat([torch.arange(r.start, r.start + r.num_new_tokens) for r in rows])[None]
        step = self.cache.step([r.block_table for r in rows], [r.start for r in rows], lengths,
                               packed=True)
        if self._prepares:
            self.cache.attention.prepare(step)
        last = torch.tensor(lengths).cumsum(0)[None] - 1  # (1, rows)
        return self.model(tokens.to(self.device), positions.to(self.device), cache=step,
                          logits_at=last.to(self.device))[0]

    def _fused(self, tokens: torch.Tensor, positions: torch.Tensor, step: PagedStep
               ) -> torch.Tensor | None:
        """A decode step's (B, vocab) logits with every block in one kernel call
        (`fused_decode`), the model's embedding, final norm and LM head around them; None,
        with nothing written but the step's per-sequence fields, where a block cannot."""
        model = self.model
        step.begin({TOKEN_IDS_FIELD: tokens}, positions)
        x = model.tok_emb(tokens)  # (B, 1, d)
        x = fused_decode(model.layers, x, positions,
                         [step.layer(i) for i in range(len(model.layers))])
        if x is None:
            return None
        step.advance()
        return model.lm_head(model.norm(x))[:, 0]


def fused_decode(blocks: Sequence[Block], x: torch.Tensor, positions: torch.Tensor,
                 views: Sequence[_PagedLayer]) -> torch.Tensor | None:
    """`blocks` applied in turn to x (B, 1, D) for a decode step over the paged cache (`views`,
    one per block), one kernel call each (egmla.kernels.decode_blocks), where every block
    declares plain RoPE attention over its cached `k` and `v` (`Block.kernel_weights`, from the
    layer's `rope_kv_attention()`) and an MLP the kernel computes (dense, or sparse as
    attached); else None, with nothing run or written."""
    rows = x.shape[0] * x.shape[1]
    plan, pools, cos, sin, angles, where = [], [], [], [], {}, None
    for block, view in zip(blocks, views):
        where = view.decode_slots()
        found = None if where is None else block.kernel_weights(x)
        if found is None:  # not a decode step the kernel serves, or not a RoPE K/V block
            return None
        weights, rope = found
        sparse = None
        if block.mlp.decodes_sparse(rows):
            sparse = block.mlp.sparse.kernel()
            if sparse is None:  # a dense pass decides (the oracle): the modules run
                return None
        if rope not in angles:  # the step's RoPE angles, computed once for the blocks sharing it
            angles[rope] = [t.view(x.shape[0], -1) for t in rope.cos_sin(positions, torch.float32)]
        plan.append((weights, sparse))
        pools.append((where.pools["k"], where.pools["v"]))
        cos.append(angles[rope][0])
        sin.append(angles[rope][1])
    if where is None:
        return None
    done = kernels.decode_blocks(x, plan, cos, sin, pools, where.new, where.slots, where.lengths)
    if done is None:
        return None
    out, computed = done
    for block, (_, sparse), n in zip(blocks, plan, computed):
        if sparse is not None:
            block.mlp.sparse.record(rows, n)
    return out


def forward_groups(lengths: list[int], max_padding: float = 0.25, pack: bool = False
                   ) -> list[list[int]]:
    """Split a step's rows (new-token counts) into forwards that waste little on padding: all
    decodes (1 token) together (the fused block kernel's step); with `pack`, every prefill
    chunk in one packed forward (no padding); else the prefill chunks grouped longest first
    while the padded size stays within (1 + max_padding) x their real tokens. A (B, T)
    forward computes B * T tokens, so one 512-token chunk padded with 30 decodes would
    otherwise cost 31x. (Decodes packed beside the chunks made a mixed workload slower, 12.9
    against 11.9 s: each row's attention over its history is a gather and an SDPA call of its
    own there, one kernel call for all rows in the decode step.)"""
    decodes = [i for i, n in enumerate(lengths) if n == 1]
    chunks = [i for i, n in enumerate(lengths) if n > 1]
    if pack:
        return [g for g in (decodes, chunks) if g]
    groups = [decodes] if decodes else []
    group: list[int] = []
    for i in sorted(chunks, key=lambda i: -lengths[i]):
        real = sum(lengths[j] for j in group) + lengths[i]
        if group and (len(group) + 1) * lengths[group[0]] > (1 + max_padding) * real:
            groups.append(group)
            group = []
        group.append(i)
    return groups + ([group] if group else [])
