"""The model step: a step's plan (serve/scheduler.py) in, logits out, over the paged KV cache.

The executor owns what running the model takes on the serving side: the paged cache
(`PagedKVCache`, its attention backend chosen for the device, serve.attention), the decode
model (eager, or through torch.compile), and how a step's rows are grouped into ragged forwards
(`forward_groups`). It reads only the plan's rows (their tokens, positions, block tables),
never the engine's live sequences.
"""

from __future__ import annotations

import logging

import torch

from egmla.models import Transformer
from serve import attention
from serve.config import EngineConfig
from serve.paged_cache import PagedKVCache
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
        head_dims = {f["k"].shape[-1] for f in spec.layers if set(f) == {"k", "v"}}
        choice = attention.select(config.attention_backend, weight.device, dtype,
                                  config.block_size, head_dims)
        self.attention_backend = choice.name  # what runs, and why (logged)
        log.info("attention backend: %s (%s)", choice.name, choice.reason)
        self.cache = PagedKVCache(spec, config.num_blocks, config.block_size, dtype=dtype,
                                  device=weight.device, attention=choice.backend)
        self.decode_model = model if config.enforce_eager else compiled_decode(model)

    def forward(self, rows: list[ScheduledRow], every: bool = False) -> torch.Tensor:
        """One ragged forward over the paged cache -> (rows, vocab) logits of each row's last
        new token, or (`every`) (rows, new tokens, vocab) at every position."""
        T = max(r.num_new_tokens for r in rows)
        pad = [[0] * (T - r.num_new_tokens) for r in rows]  # padding queries sit at position 0
        tokens = torch.tensor([[*r.token_ids, *p] for r, p in zip(rows, pad)], dtype=torch.long)
        positions = torch.tensor([[*range(r.start, r.start + r.num_new_tokens), *p]
                                  for r, p in zip(rows, pad)], dtype=torch.long)
        step = self.cache.step([r.block_table for r in rows], [r.start for r in rows],
                               [r.num_new_tokens for r in rows])
        model = self.decode_model if step.decode_only else self.model
        if T == 1 and not every:  # one token per row: its logits are the step's only ones
            return model(tokens.to(self.device), positions.to(self.device), cache=step)[:, 0]
        last = (None if every else
                torch.tensor([r.num_new_tokens - 1 for r in rows], device=self.device))
        return model(tokens.to(self.device), positions.to(self.device), cache=step,
                     logits_at=last)


def forward_groups(lengths: list[int], max_padding: float = 0.25) -> list[list[int]]:
    """Split a step's rows (new-token counts) into forwards that waste little on padding: all
    decodes (1 token) together, prefill chunks grouped longest first while the padded size stays
    within (1 + max_padding) x their real tokens. A (B, T) forward computes B * T tokens, so one
    512-token chunk padded with 30 decodes would otherwise cost 31x."""
    decodes = [i for i, n in enumerate(lengths) if n == 1]
    groups = [decodes] if decodes else []
    group: list[int] = []
    for i in sorted((i for i, n in enumerate(lengths) if n > 1), key=lambda i: -lengths[i]):
        real = sum(lengths[j] for j in group) + lengths[i]
        if group and (len(group) + 1) * lengths[group[0]] > (1 + max_padding) * real:
            groups.append(group)
            group = []
        group.append(i)
    return groups + ([group] if group else [])
