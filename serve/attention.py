"""How a paged step's MHA/GQA layers attend: the backends, and which one a machine gets.

Every backend computes the same function, softmax(q . k * scale) . v over the keys each query
may see (its own row's history, causally), straight from or through the paged pools:

- `native`: this project's C++ kernels (egmla.kernels) on a CPU: a decode step's whole block,
  or its attention, read in place through the slot tables. A prefill of new prompts (no row
  with history) attends causally over its own tokens (SDPA's causal path, which skips the
  masked half); anything else they do not take (a prefill over history, a GPU) gathers each
  row's history into a padded copy and runs SDPA with a mask.
- `sdpa`: always the gather + SDPA path (PyTorch's SDPA picks flash, memory-efficient or math
  kernels on a GPU). The reference the others are tested against.
- `flex`: PyTorch's FlexAttention over the pools in place, prefill and decode. The pools are one
  long key sequence; a block mask built from the step's block tables lets each row see only its
  own blocks, causally (a physical block -> logical block map per row, so blocks shared by
  prefix caching are seen by every row that holds them). Compiled on a GPU (a fused kernel that
  skips the blocks the mask rules out); eager elsewhere (correct, but it materializes scores).
- `flash_attn`: the `flash-attn` package's `flash_attn_with_kvcache` with its block table, for
  decode steps (one new token per row) on a CUDA device in fp16/bf16 with a block size that is
  a multiple of 256 (its paged layout); prefill steps take the gather + SDPA path.

`auto` picks `native` on a CPU, and on a GPU `flash_attn` where it is installed and applies,
else `flex`. MLA and EG-MLA layers attend over their own latent fields (absorbed or naive, see
egmla.models.attention). Under `native`, a decode step of an MLA or EG-MLA `latent` layer
(absorbed: an MQA over [c, k_rope] with value c) reads the pools in place
(`attend_latent`, egmla.kernels.paged_latent_attention), and so does an absorbed decode step of
an EG-MLA `kv` layer (`attend_gated`, egmla.kernels.paged_gated_attention: the cached latents,
norm statistics and token ids, the gate rows looked up per key); every other latent step, and
every latent step under the other backends, gathers the history and runs PyTorch.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from egmla import kernels
from egmla.models.attention import common

log = logging.getLogger("serve")

BACKENDS = ("auto", "native", "sdpa", "flex", "flash_attn")
FLASH_ATTN_BLOCK = 256  # flash-attn's paged KV takes blocks of a multiple of this many tokens
FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)
FLASH_ATTN_MAX_HEAD_DIM = 256


class PagedAttention:
    """A backend: `attend` returns the attention of a step's queries (`step`: the
    serve.paged_cache.PagedStep, which this module does not import: it imports us), with the
    layer's new fields written, or None (nothing written) where it does not apply, and the
    layer gathers."""

    name = "sdpa"
    fuses_blocks = False  # whether decode steps may run a whole block in one native kernel
    packs = False  # whether `attend` takes packed steps (serve.paged_cache: every row's tokens as one)

    def prepare(self, step) -> None:
        """Build what every layer of `step` shares, before the forward (outside any compiled
        region: host-side work with data-dependent shapes). The executor calls it for a model
        with layers that attend through the backend; `attend` builds it itself otherwise."""

    def attend(self, step, pools: dict[str, torch.Tensor], q: torch.Tensor,
               new: dict[str, torch.Tensor], key: str, value: str, scale: float
               ) -> torch.Tensor | None:
        return None

    def attend_latent(self, step, pools: dict[str, torch.Tensor], q: torch.Tensor,
                      new: dict[str, torch.Tensor], scale: float) -> torch.Tensor | None:
        """MLA's absorbed attention (egmla.kernels.paged_latent_attention's function) of a
        step's queries q (B, T, H, C + r) over the pools `c` and `k_rope`, with the layer's
        new fields written: (B, T, H, C); or None (nothing written) where it does not apply."""
        return None

    def attend_gated(self, step, pools: dict[str, torch.Tensor], query, q_rope: torch.Tensor,
                     new: dict[str, torch.Tensor], table: torch.Tensor, residual: bool,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """EG-MLA `kv`'s absorbed attention (egmla.kernels.paged_gated_attention's function;
        egmla.cache.AttendsInPlace.fused_gated_attention: `query()` gives (M, q_mu)), with the
        layer's new fields written: (A (B, T, H, C, E'), m (B, T, H)); or None (nothing
        written, `query` not called)."""
        return None


class Native(PagedAttention):
    name, fuses_blocks, packs = "native", True, True

    def attend(self, step, pools, q, new, key, value, scale):
        if step.packed:
            return self._attend_packed(step, pools, q, new, key, value, scale)
        if not step.decode_only and step.fresh:  # new prompts: causal over their own tokens
            step.write_fields(pools, new)
            # SDPA's causal path skips the blocks above the diagonal, which a mask cannot (at
            # 2,048 tokens, 9 heads over 3, it took 41 ms a layer against 86 with the mask); the
            # keys as the pools hold them (a cache in another dtype rounds them), so the result
            # is the gather path's. Padding follows each row's tokens, so a real query's causal
            # window holds only its row's real keys.
            k, v = (new[name].to(pools[name].dtype).to(q.dtype) for name in (key, value))
            return common.attend(q, k, v, scale, None, None)
        if not step.decode_only or not kernels.paged_attention_runs(q, pools[key], pools[value]):
            return None
        step.write_fields(pools, new)
        out = kernels.paged_attention(q[:, 0], pools[key], pools[value], step.slots,
                                      step.lengths, scale)
        return out[:, None]  # (B, 1, H, Dv)

    @staticmethod
    def _attend_packed(step, pools, q, new, key, value, scale):
        """A packed step (serve.paged_cache): each row's tokens over its own keys; a new prompt
        causal over its new tokens (SDPA's causal path), a row with history over the keys
        gathered from the pools (its new ones written first)."""
        step.write_fields(pools, new)
        k_new, v_new = (new[name].to(pools[name].dtype).to(q.dtype) for name in (key, value))
        outs = []
        for b, (start, end, context) in enumerate(step.segments):
            if context == 0:
                outs.append(common.attend(q[:, start:end], k_new[:, start:end], v_new[:, start:end],
                                          scale, None, None))
                continue
            slots = step.slots[b, :context + end - start]
            k, v = (pools[name].index_select(0, slots)[None].to(q.dtype) for name in (key, value))
            positions = torch.arange(context, context + end - start, device=q.device)[None]
            outs.append(common.attend(q[:, start:end], k, v, scale, positions,
                                      torch.arange(len(slots), device=q.device)))
        return torch.cat(outs, dim=1)

    def attend_latent(self, step, pools, q, new, scale):
        if (not step.decode_only or set(pools) != {"c", "k_rope"}
                or not kernels.paged_latent_attention_runs(q, pools["c"], pools["k_rope"])):
            return None
        step.write_fields(pools, new)
        out = kernels.paged_latent_attention(q[:, 0], pools["c"], pools["k_rope"], step.slots,
                                             step.lengths, scale)
        return out[:, None]  # (B, 1, H, C)

    def attend_gated(self, step, pools, query, q_rope, new, table, residual, scale):
        stats = pools.get("norm_stats")
        ids = step.cache.sequence.get(common.TOKEN_IDS_FIELD)
        if (not step.decode_only or set(pools) - {"c", "k_rope", "norm_stats"} or ids is None
                or not kernels.paged_gated_attention_runs(pools["c"], pools["k_rope"], table,
                                                          stats, q_rope)):
            return None
        m, q_mu = query()
        step.write_fields(pools, new)
        a, msum = kernels.paged_gated_attention(m[:, 0], q_mu[:, 0], q_rope[:, 0], pools["c"],
                                                pools["k_rope"], stats, ids, table, residual,
                                                step.slots, step.lengths, scale)
        return a[:, None], msum[:, None]  # (B, 1, H, C, E'), (B, 1, H)


class Flex(PagedAttention):
    """FlexAttention over the pools in place (module docstring). `compiled`: through
    torch.compile (a fused kernel; the first call of each shape compiles)."""

    name = "flex"

    def __init__(self, compiled: bool = False) -> None:
        from torch.nn.attention import flex_attention as flex

        self.compiled = compiled
        # eager: kept eager inside a compiled decode step too (inductor's CPU template for it
        # fails to build under dynamic shapes in torch 2.13)
        self._flex = (torch.compile(flex.flex_attention) if compiled
                      else torch.compiler.disable(flex.flex_attention))
        self._block_mask = flex.create_block_mask

    def prepare(self, step) -> None:
        step.flex_mask = step.build_flex_mask(self._block_mask, compiled=self.compiled)

    def attend(self, step, pools, q, new, key, value, scale):
        k_pool, v_pool = pools[key], pools[value]
        if k_pool.dtype != q.dtype or v_pool.dtype != q.dtype or k_pool.dim() != 3:
            return None  # a cache in another dtype than the queries: the gather path casts
        if step.flex_mask is None:  # not prepared by an executor: built here, eagerly
            self.prepare(step)
        step.write_fields(pools, new)
        mask = step.flex_mask
        B, keys = q.shape[0], mask.shape[-1]  # the pools' used prefix: views, nothing copied
        # (B, G, KV, D), every row the same pools (a stride-0 batch: older compiled kernels
        # do not broadcast a batch of 1)
        k = k_pool[:keys].transpose(0, 1).expand(B, -1, -1, -1)
        v = v_pool[:keys].transpose(0, 1).expand(B, -1, -1, -1)
        out = self._flex(q.transpose(1, 2), k, v, block_mask=mask, scale=scale,
                         enable_gqa=q.shape[2] != k.shape[1])
        return out.transpose(1, 2)  # (B, T, H, Dv); padding queries see no key and give 0


class FlashAttn(PagedAttention):
    """flash-attn's paged decode (module docstring). `kernel`: flash_attn_with_kvcache."""

    name = "flash_attn"

    def __init__(self, kernel: Callable | None = None) -> None:
        self._kernel = kernel  # None: imported on first use (selection only checks it exists)

    def attend(self, step, pools, q, new, key, value, scale):
        k_pool, v_pool = pools[key], pools[value]
        if not step.decode_only or k_pool.dtype != q.dtype or k_pool.dim() != 3:
            return None
        step.write_fields(pools, new)
        bs = step.cache.block_size
        k = k_pool.view(-1, bs, *k_pool.shape[1:])  # (blocks, block_size, G, D): a view
        v = v_pool.view(-1, bs, *v_pool.shape[1:])
        if self._kernel is None:
            from flash_attn import flash_attn_with_kvcache

            self._kernel = flash_attn_with_kvcache
        lengths, tables = step.flash_tables  # built once per step, shared by the layers
        return self._kernel(q, k, v, cache_seqlens=lengths, block_table=tables,
                            softmax_scale=scale, causal=True)  # (B, 1, H, Dv)


@dataclass(frozen=True)
class Choice:
    backend: PagedAttention
    reason: str

    @property
    def name(self) -> str:
        return self.backend.name


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def flex_available() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def flash_attn_fits(device: torch.device, dtype: torch.dtype, block_size: int,
                    head_dims: set[int]) -> str | None:
    """Why flash-attn's paged decode cannot serve this engine, or None where it can."""
    if device.type != "cuda":
        return f"it needs a CUDA device (this engine is on {device})"
    if dtype not in FLASH_ATTN_DTYPES:
        return f"it takes float16 or bfloat16 caches (this one is {dtype})"
    if block_size % FLASH_ATTN_BLOCK:
        return f"its paged cache needs block_size a multiple of {FLASH_ATTN_BLOCK} (got {block_size})"
    if any(d > FLASH_ATTN_MAX_HEAD_DIM or d % 8 for d in head_dims):
        return f"head dims {sorted(head_dims)}: it takes multiples of 8 up to {FLASH_ATTN_MAX_HEAD_DIM}"
    return None


def select(requested: str, device: torch.device, dtype: torch.dtype, block_size: int,
           head_dims: set[int], flash_installed: bool | None = None) -> Choice:
    """The backend for an engine on `device` with a `dtype` cache of `block_size` blocks whose
    MHA/GQA layers have `head_dims`, and why. An explicit request that cannot run here is a
    ValueError saying why; `auto` falls back and says what it passed over."""
    if requested not in BACKENDS:
        raise ValueError(f"attention_backend={requested!r}: expected one of {', '.join(BACKENDS)}")
    installed = flash_attn_installed() if flash_installed is None else flash_installed
    gpu = device.type == "cuda"
    if requested == "auto":
        if gpu and not head_dims:
            return Choice(PagedAttention(), "auto: no MHA/GQA layers (MLA and EG-MLA layers "
                                            "gather their latents under every backend)")
        if not gpu:
            return Choice(Native(), f"auto on {device}: this project's kernels, SDPA where "
                                    "they do not apply")
        if not installed:
            why = "flash-attn is not installed"
        elif (why := flash_attn_fits(device, dtype, block_size, head_dims)) is None:
            return Choice(FlashAttn(), "auto on a GPU: flash-attn is installed and fits")
        if flex_available():
            return Choice(Flex(compiled=True), f"auto on a GPU: FlexAttention, compiled ({why})")
        return Choice(PagedAttention(), f"auto on a GPU: SDPA ({why}; no FlexAttention)")
    if requested == "flash_attn":
        if not installed:
            raise ValueError("attention_backend='flash_attn': the flash-attn package is not "
                             "installed (pip install flash-attn, on a CUDA machine)")
        if (why := flash_attn_fits(device, dtype, block_size, head_dims)) is not None:
            raise ValueError(f"attention_backend='flash_attn': {why}")
        return Choice(FlashAttn(), "requested")
    if requested == "flex":
        if not flex_available():
            raise ValueError(f"attention_backend='flex': this torch ({torch.__version__}) has "
                             "no FlexAttention")
        return Choice(Flex(compiled=gpu), "requested" + ("" if gpu else " (eager off a GPU)"))
    return Choice(Native() if requested == "native" else PagedAttention(), "requested")
