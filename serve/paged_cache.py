"""The paged KV cache: fixed-size blocks of every cached field, shared by all sequences.

Every attention variant declares what it caches (`cache_spec()`); this module allocates, for each
layer and field, a pool of `num_blocks` blocks of `block_size` token slots, plus one pool per
per-sequence field (EG-MLA's token ids). One implementation serves MHA (k, v), MLA (c, k_rope)
and EG-MLA (c, k_rope + token ids) with no per-variant code.

A forward step over a ragged batch (rows of different lengths, new tokens of different counts)
goes through `PagedStep`, which implements the model's cache protocol (`egmla.cache.CacheStep`):

- `begin(sequence, positions)`: write the per-sequence fields of the new tokens;
- `layer(i).update(**fields)`: scatter the new tokens' fields into their slots, then gather each
  row's whole history into a padded (B, S_max, ...) tensor;
- `key_positions` (B, S_max): each history slot's position, padding set past any query so the
  causal mask hides it;
- `layer(i).fused_attention(...)`: MHA/GQA attention without the gathered copy, through the
  cache's attention backend (serve.attention: this project's kernels, FlexAttention over the
  pools, flash-attn's paged decode), where it applies.
- `layer(i).decode_slots()`: the pools and slot tables of a decode step, for the executor's
  fused decode (serve/executor.py: a whole block in one kernel call), under a backend that
  fuses blocks.

A `packed` step holds its rows' new tokens as one row, (1, N) in row order, so that the model's
linear layers run once over every row's tokens with no padding; the backend then attends each
row's tokens (`segments`) over that row's own keys, and the layers never gather (`update`
refuses).

Slot of position p in a sequence = block_table[p // block_size] * block_size + p % block_size.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from egmla import kernels
from egmla.cache import CacheSpec, CacheTensors, write_sequence_fields
from serve.attention import Native, PagedAttention

# Key position of padding slots: larger than any query position, so `key <= query` is false.
PAD_POSITION = 2**62


class DecodeSlots(NamedTuple):
    """Where a decode step (one new token per row) reads and writes one layer of the pools, for
    the kernels that work on them in place (`_PagedLayer.decode_slots`, serve.executor's fused
    decode)."""

    pools: Mapping[str, torch.Tensor]  # the layer's fields, each (slots, ...)
    new: torch.Tensor  # (B,) int64: the slot of each row's new token
    slots: torch.Tensor  # (B, S) int64: row b's keys in order are its first lengths[b]
    lengths: torch.Tensor  # (B,) int64: keys per row, the new token included (last)


class PagedKVCache(CacheTensors):
    """Block pools for every cached field; `nbytes()` measures what was allocated. `attention`:
    how MHA/GQA layers attend over it (serve.attention; default this project's kernels). On
    the CPU the pools live on transparent huge pages (egmla.kernels.huge_zeros) where the
    system has them."""

    def __init__(
        self,
        spec: CacheSpec,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        attention: PagedAttention | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        on_cpu = torch.device(device or "cpu").type == "cpu"
        # flat, block-major; on the CPU on huge pages, where a decode step reads it block by block
        super().__init__(spec, (num_blocks * block_size,), dtype, device,
                         allocate=kernels.huge_zeros if on_cpu else None)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.attention = attention or Native()

    def block_bytes(self) -> int:
        """Bytes of one block across every layer and field."""
        return self.nbytes() // self.num_blocks

    def populate(self) -> None:
        """Touch every page of the pools now (they stay zero), so that no step pays for the
        page faults of blocks it writes for the first time. On the CPU the pools are allocated
        untouched on huge pages, and a first write's fault may stall on the kernel compacting
        memory into a huge page: on a fresh 1 GiB pool, a 32-request workload spent 1.6 s of
        its 14.5 s in the cache writes of its prefills, 0.44 s once the pool was touched."""
        for t in self.tensors():
            t.zero_()

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: duplicate block `src` into `dst` in every pool."""
        s, d, n = src * self.block_size, dst * self.block_size, self.block_size
        for t in self.tensors():
            t[d : d + n] = t[s : s + n]

    def step(
        self,
        block_tables: Sequence[Sequence[int]],
        context_lens: Sequence[int],
        new_lens: Sequence[int],
        packed: bool = False,
    ) -> PagedStep:
        """A forward step: row b already has context_lens[b] cached tokens and adds new_lens[b]
        (`packed`: the rows' new tokens come as one row, see the module doc)."""
        return PagedStep(self, block_tables, context_lens, new_lens, packed)


class PagedStep:
    """One ragged forward step over the paged cache (the model's cache protocol)."""

    def __init__(
        self,
        cache: PagedKVCache,
        block_tables: Sequence[Sequence[int]],
        context_lens: Sequence[int],
        new_lens: Sequence[int],
        packed: bool = False,
    ) -> None:
        if not (len(block_tables) == len(context_lens) == len(new_lens)):
            raise ValueError("block_tables, context_lens and new_lens need one entry per row")
        self.cache, self.packed = cache, packed
        bs, device = cache.block_size, cache.device
        totals = [ctx + new for ctx, new in zip(context_lens, new_lens)]
        for b, (table, total) in enumerate(zip(block_tables, totals)):
            if total > len(table) * bs:
                raise ValueError(f"row {b}: {total} tokens do not fit {len(table)} blocks of {bs}")
        self._context_lens, self._new_lens = list(context_lens), list(new_lens)
        self.decode_only = all(n == 1 for n in new_lens)  # each row's query is its newest key
        # The slot tables, built with tensor ops over all rows at once (no per-row tensors).
        width = max(1, max(len(t) for t in block_tables))
        tables = torch.tensor([[*t, *[0] * (width - len(t))] for t in block_tables], dtype=torch.long)
        total = torch.tensor(totals, dtype=torch.long)
        S = max(totals)
        pos = torch.arange(S)
        self._held = pos < total[:, None]  # (B, S): positions each row has, the new ones included
        slots = (tables[:, (pos // bs).clamp(max=width - 1)] * bs + pos % bs).where(self._held, 0)
        if self.decode_only:  # a row's one new token is its last: its slot, read off its table
            new_slots = torch.tensor([[t[(n - 1) // bs] * bs + (n - 1) % bs]
                                      for t, n in zip(block_tables, totals)], dtype=torch.long)
        else:  # (B, T): where new tokens go, -1 for padding
            new_pos = torch.tensor(context_lens, dtype=torch.long)[:, None] + torch.arange(max(new_lens))
            new_slots = slots.gather(1, new_pos.clamp(max=S - 1)).where(new_pos < total[:, None], -1)
        self.slots, self.new_slots = slots.to(device), new_slots.to(device)
        self._tables = tables
        self.flex_mask = None  # the FlexAttention backend's block mask (its `prepare`)
        self.lengths = total.to(device)
        # the real new tokens' slots, in the flattened (B * T) order (a decode step has no padding)
        self._targets = (self.new_slots.flatten() if self.decode_only
                         else self.new_slots.flatten().index_select(0, self._rows))

    @functools.cached_property
    def segments(self) -> list[tuple[int, int, int]]:
        """Each row's [start, end) in a packed step's one row of tokens, and its context
        length (the cached tokens before them)."""
        ends = list(itertools.accumulate(self._new_lens))
        return list(zip([0, *ends[:-1]], ends, self._context_lens))

    @functools.cached_property
    def fresh(self) -> bool:
        """Whether no row has history: every row's new tokens are its first (a prefill of new
        prompts without cached prefixes), so each row's keys are exactly its new tokens."""
        return not any(self._context_lens)

    @functools.cached_property
    def _rows(self) -> torch.Tensor:
        """The real new tokens' indices in the flattened (B * T) new tokens (the rest is padding)."""
        return (self.new_slots >= 0).flatten().nonzero().squeeze(1)

    @functools.cached_property
    def flat_slots(self) -> torch.Tensor:
        return self.slots.flatten()

    @functools.cached_property
    def key_positions(self) -> torch.Tensor:
        """(B, S): each history slot's position, padding past any query (see the module doc)."""
        B, S = self.slots.shape
        pos = torch.arange(S).expand(B, S).where(self._held, PAD_POSITION)
        return pos.to(self.cache.device)

    @functools.cached_property
    def flash_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(lengths, block tables) as int32 on the cache's device, built once per step for
        every layer: keys per row, and row b's physical blocks in order (padded with 0)."""
        device = self.cache.device
        return self.lengths.to(torch.int32), self._tables.to(device=device, dtype=torch.int32)

    def build_flex_mask(self, create_block_mask, compiled: bool = False):
        """FlexAttention's block mask for this step over the pools' used prefix (shared by every
        layer, built before the forward): batch b is row b, query t its t-th new token, key i
        the pools' slot i, seen where slot i's block is one of row b's at a logical position
        <= the query's."""
        bs, device = self.cache.block_size, self.cache.device
        context, added = (torch.tensor(n, dtype=torch.long) for n in (self._context_lens, self._new_lens))
        tables, total = self._tables, context + added
        B, T = len(total), int(added.max())
        held = torch.arange(tables.shape[1]) < ((total + bs - 1) // bs)[:, None]
        used = int(tables.where(held, 0).max()) + 1  # blocks 0..used-1 cover every row
        logical = torch.full((B, used + 1), -1, dtype=torch.long)  # column `used`: padding
        order = torch.arange(tables.shape[1]).expand(B, -1)
        logical.scatter_(1, tables.where(held, used), order)
        logical = logical[:, :used].to(device)  # (B, physical block) -> logical, or -1
        t = torch.arange(T)
        query_pos = (context[:, None] + t).where(t < added[:, None], -1).to(device)

        def mask_mod(b, h, q, k):
            block = logical[b, k // bs]
            return (block >= 0) & (block * bs + k % bs <= query_pos[b, q])

        return create_block_mask(mask_mod, B, None, T, used * bs, device=device, _compile=compiled)

    def write_fields(self, pools: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]
                     ) -> None:
        """Write a layer's new tokens' fields into its pools (what `update` writes)."""
        for name, values in new.items():
            self._write(pools[name], values)

    def _write(self, pool: torch.Tensor, values: torch.Tensor) -> None:
        rows = values.flatten(0, 1)
        # a decode step has no padding (every row's one token is new), nor has a packed one
        if not self.decode_only and not self.packed:
            rows = rows.index_select(0, self._rows)
        pool.index_copy_(0, self._targets, rows.to(pool.dtype))

    def begin(self, sequence: Mapping[str, torch.Tensor], positions: torch.Tensor | None = None
              ) -> None:
        shape = (1, len(self._targets)) if self.packed else tuple(self.new_slots.shape)
        for name, values in sequence.items():
            if tuple(values.shape[:2]) != shape:
                raise ValueError(f"{name} {tuple(values.shape)} != step {shape}")
        write_sequence_fields(self.cache.spec, sequence,
                              lambda name, values: self._write(self.cache.sequence[name], values))

    def advance(self) -> None:
        """Nothing to commit: the engine's block manager tracks lengths."""

    def layer(self, index: int) -> _PagedLayer:
        return _PagedLayer(self, index)

    def next_positions(self, T: int) -> torch.Tensor:
        raise ValueError("a paged step has ragged rows: the caller passes their positions")

    def sequence_field(self, name: str) -> torch.Tensor:
        pool = self.cache.sequence[name]
        return pool.index_select(0, self.flat_slots).view(*self.slots.shape, *pool.shape[1:])


class _PagedLayer:
    def __init__(self, step: PagedStep, index: int) -> None:
        self._step, self._pools = step, step.cache.layers[index]

    def update(self, **new: torch.Tensor) -> dict[str, torch.Tensor]:
        if set(new) != set(self._pools):
            raise KeyError(f"cached {sorted(new)}, spec says {sorted(self._pools)}")
        if self._step.packed:
            raise RuntimeError("a packed step's layers attend through the backend; none gathers")
        self._step.write_fields(self._pools, new)
        out = {}
        for name, values in new.items():
            pool = self._pools[name]
            history = pool.index_select(0, self._step.flat_slots)  # 5x faster than pool[slots]
            out[name] = history.view(*self._step.slots.shape, *pool.shape[1:]).to(values.dtype)
        return out

    @property
    def key_positions(self) -> torch.Tensor:
        return self._step.key_positions

    def sequence_field(self, name: str) -> torch.Tensor:
        return self._step.sequence_field(name)

    def decode_slots(self) -> DecodeSlots | None:
        """The pools and slot tables of a decode step, for the native block kernel; None for
        other steps and under a backend that attends by itself."""
        step = self._step
        if not (step.decode_only and step.cache.attention.fuses_blocks):
            return None
        return DecodeSlots(self._pools, step._targets, step.slots, step.lengths)

    def fused_latent_attention(self, q: torch.Tensor, new: Mapping[str, torch.Tensor],
                               scale: float) -> torch.Tensor | None:
        """MLA's absorbed attention through the cache's backend (serve.attention), read from
        the pools in place: q (B, T, H, C + r) -> (B, T, H, C). None, with nothing written,
        where it does not apply."""
        if set(new) != set(self._pools):
            return None
        return self._step.cache.attention.attend_latent(self._step, self._pools, q, dict(new),
                                                        scale)

    def fused_gated_attention(self, query, q_rope: torch.Tensor, new: Mapping[str, torch.Tensor],
                              table: torch.Tensor, residual: bool, scale: float
                              ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """EG-MLA `kv`'s absorbed attention through the cache's backend (serve.attention), read
        from the pools and the token ids in place (egmla.cache.AttendsInPlace). None, with
        nothing written, where it does not apply."""
        if set(new) != set(self._pools):
            return None
        return self._step.cache.attention.attend_gated(self._step, self._pools, query, q_rope,
                                                       dict(new), table, residual, scale)

    def fused_attention(self, q: torch.Tensor, new: Mapping[str, torch.Tensor], key: str,
                        value: str, scale: float) -> torch.Tensor | None:
        """Attention through the cache's backend (serve.attention), read from the pools in
        place: no padded history copy. None, with nothing written, where it does not apply."""
        if set(new) != set(self._pools):
            return None
        return self._step.cache.attention.attend(self._step, self._pools, q, dict(new), key,
                                                 value, scale)
