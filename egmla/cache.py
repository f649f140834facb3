"""What a model caches per token, a contiguous cache, and KV bytes analytic and measured.

Every attention layer declares its cached per-token tensors with `cache_spec()`, a mapping
name -> `FieldSpec(trailing shape, dtype)`. The model adds per-sequence fields stored once, not
per layer (EG-MLA's token ids). From that spec alone:

- `CacheSpec.bytes_per_token(dtype)` is the analytic KV cost, and
- `ContiguousCache(spec, ...)` allocates exactly those tensors; `nbytes()` measures them.

The two numbers must agree; tests check them against a hand-written formula per variant.

Worked example, the paper's 12-layer d=768 EG-MLA with d_c=64, d_rope=64 under `gate_position: kv`:
each layer caches c (64) and k_rope (64), so 12 * 128 = 1,536 elements per token; in bf16 that is
3,072 bytes, plus 12 * 8 bytes for the gate norm's float32 statistics (an auxiliary field: bytes,
not elements) and 4 bytes for the int32 token id stored once per token of the sequence: 3,172.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class FieldSpec:
    """One cached per-token tensor: trailing shape and dtype.

    `dtype` None: the cache's float dtype. `min_dtype`: stored in the wider of the cache's dtype
    and this one (EG-MLA's norm statistics: float32 in a bf16 or float32 cache, float64 in a
    float64 one). An `auxiliary` field is not K/V: its bytes count in the cache's bytes per
    token, but not in the paper's cached elements, and reports show it on a line of its own.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype | None = None
    min_dtype: torch.dtype | None = None
    auxiliary: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def resolve(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype this field is stored in within a cache of float dtype `dtype`."""
        if self.dtype is not None:
            return self.dtype
        if self.min_dtype is None or dtype.itemsize > self.min_dtype.itemsize:
            return dtype
        return self.min_dtype  # (torch.promote_types refuses float8)

    def nbytes(self, dtype: torch.dtype) -> int:
        return self.numel * self.resolve(dtype).itemsize


LayerSpec = dict[str, FieldSpec]

# Token ids stored once per sequence position (EG-MLA `kv` rebuilds K/V from them at decode).
TOKEN_IDS = FieldSpec((), torch.int32)


@dataclass(frozen=True)
class CacheSpec:
    """Per-layer cached fields plus per-sequence fields (stored once, shared by all layers)."""

    layers: tuple[LayerSpec, ...]
    sequence: LayerSpec = field(default_factory=dict)

    def _layer_fields(self, auxiliary: bool) -> list[FieldSpec]:
        return [f for layer in self.layers for f in layer.values() if f.auxiliary == auxiliary]

    def elements_per_token(self) -> int:
        """K/V elements cached per token over all layers (the paper's unit; ids and auxiliary
        fields such as norm statistics excluded)."""
        return sum(f.numel for f in self._layer_fields(auxiliary=False) if f.dtype is None)

    def layer_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of the per-layer K/V fields (auxiliary fields excluded)."""
        return sum(f.nbytes(dtype) for f in self._layer_fields(auxiliary=False))

    def auxiliary_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of the per-layer auxiliary fields (EG-MLA's cached norm statistics)."""
        return sum(f.nbytes(dtype) for f in self._layer_fields(auxiliary=True))

    def sequence_bytes_per_token(self, dtype: torch.dtype) -> int:
        return sum(f.nbytes(dtype) for f in self.sequence.values())

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Analytic KV-cache bytes per token: every cached tensor, every layer."""
        return (self.layer_bytes_per_token(dtype) + self.auxiliary_bytes_per_token(dtype)
                + self.sequence_bytes_per_token(dtype))


# --------------------------------------------------------------------------------------------
# The cache contract: what a model's forward does with the cache it is passed. ContiguousCache
# (below) and serve's PagedStep implement it; the models are written against these alone.


@runtime_checkable
class LayerView(Protocol):
    """One layer's part of a cache step: what an attention layer sees."""

    def update(self, **new: torch.Tensor) -> dict[str, torch.Tensor]:
        """Write the step's new tokens' fields (exactly the layer's spec); return each field for
        every key the step's queries may see, (B, S, ...)."""
        ...

    @property
    def key_positions(self) -> torch.Tensor:
        """Positions of those keys: (S,) shared by all rows, or (B, S) for ragged rows (padding
        past any query position)."""
        ...

    def sequence_field(self, name: str) -> torch.Tensor:
        """A per-sequence field (`CacheSpec.sequence`) for those keys, (B, S, ...)."""
        ...


@runtime_checkable
class AttendsInPlace(Protocol):
    """What a layer's cache view MAY also offer (a paged decode step does, serve/paged_cache.py;
    the contiguous cache does not): attention computed by the cache where it can do better than
    `update` and SDPA, reading its pools in place. A layer that can use it looks for the
    method (`getattr(cache, "fused_attention", None)`, `"fused_latent_attention"`,
    `"fused_gated_attention"`: an
    isinstance check on a Protocol costs
    microseconds per layer and step)."""

    def fused_attention(self, q: torch.Tensor, new: Mapping[str, torch.Tensor], key: str,
                        value: str, scale: float) -> torch.Tensor | None:
        """Attention computed by the cache where it can do better than `update` and SDPA (a
        paged decode step reads its pools in place): write `new` (exactly the layer's fields,
        as `update` would) and return softmax(q . k * scale) . v over every key each query may
        see, q (B, T, H, D) -> (B, T, H, Dv), with the fields named `key` and `value` as K and
        V (K/V heads shared by H / G query heads). None, with nothing written, where it cannot;
        the layer then calls `update` and attends itself."""
        ...

    def fused_latent_attention(self, q: torch.Tensor, new: Mapping[str, torch.Tensor],
                               scale: float) -> torch.Tensor | None:
        """MLA's absorbed attention computed by the cache (an MQA whose one key is the cached
        [c, k_rope] and value c): write `new` (exactly the layer's fields, `c` and `k_rope`)
        and return softmax((q[..., :C] . c + q[..., C:] . k_rope) * scale) . c over every key
        each query may see, q (B, T, H, C + r) -> (B, T, H, C), query head h reading RoPE key
        h // (H / Hr). None, with nothing written, where it cannot."""
        ...

    def fused_gated_attention(self, query: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                              q_rope: torch.Tensor, new: Mapping[str, torch.Tensor],
                              table: torch.Tensor, residual: bool, scale: float
                              ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """EG-MLA `kv`'s absorbed attention computed by the cache (docs/attention.md, "The
        absorbed kv computation"): write `new` (exactly the layer's fields: `c`, `k_rope` and
        `norm_stats` where cached) and return (A, m), A_i = sum_j a_ij inv_j c_j e_j^T and
        m_i = sum_j a_ij inv_j mu_j, where a_ij = softmax_j((inv_j (c_j^T M_i e_j - mu_j
        q_mu_i) + q_rope_i . k_rope_j) * scale) over every key each query may see, e_j =
        table[token id of key j] (then a constant 1 when `residual`) and (mu_j, inv_j) the
        key's norm statistics (0 and 1 where none are cached). `query()` returns the per-query
        side, (M (B, T, H, C, E'), q_mu (B, T, H)), called only where the cache attends (M
        costs H C E' d_nope MACs a token); q_rope (B, T, H, r) -> (B, T, H, C, E'), (B, T, H).
        None, with nothing written (and `query` not called), where it cannot."""
        ...


@runtime_checkable
class CacheStep(Protocol):
    """A cache as a model's forward uses it, once per step:

        cache.begin({"token_ids": ids}, positions)  # the step's per-sequence values
        view = cache.layer(i)                       # each layer writes and reads through its view
        cache.advance()                             # commit the step
    """

    def begin(self, sequence: Mapping[str, torch.Tensor], positions: torch.Tensor) -> None:
        """Start a step: check room, and write every per-sequence field the spec lists from
        `sequence` (a field the spec lists and `sequence` lacks is an error)."""
        ...

    def layer(self, index: int) -> LayerView: ...

    def advance(self) -> None: ...

    def next_positions(self, T: int) -> torch.Tensor:
        """The positions of a step of T tokens when the caller gives none."""
        ...


def write_sequence_fields(spec: CacheSpec, sequence: Mapping[str, torch.Tensor], write) -> None:
    """Call `write(name, values)` for every per-sequence field of `spec`, from `sequence`."""
    for name in spec.sequence:
        if name not in sequence:
            raise KeyError(f"the cache holds the per-sequence field {name!r}; the step gave "
                           f"{sorted(sequence)}")
        write(name, sequence[name])


# allocate(layout) -> zero tensors of those (shape, dtype) in order, or None for torch.zeros
Allocator = Callable[[list[tuple[tuple[int, ...], torch.dtype]]], "list[torch.Tensor] | None"]


class CacheTensors:
    """Every tensor a cache allocates for `spec`: per layer and field, and per-sequence fields,
    each of shape (*leading, *field.shape), zero-filled by `allocate` (None: torch.zeros on
    `device`). `nbytes()` measures the storage actually allocated. Shared by the contiguous
    cache (leading = batch, positions) and the paged one (slots)."""

    def __init__(self, spec: CacheSpec, leading: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device | str | None, allocate: Allocator | None = None) -> None:
        groups = [*spec.layers, spec.sequence]  # each layer's fields, then the sequence's
        layout = [((*leading, *f.shape), f.resolve(dtype)) for group in groups for f in group.values()]
        made = allocate(layout) if allocate is not None else None
        if made is None:
            made = [torch.zeros(shape, dtype=dt, device=device) for shape, dt in layout]
        tensors = iter(made)
        filled = [{name: next(tensors) for name in group} for group in groups]
        self.spec, self.dtype, self.device = spec, dtype, device
        self.layers, self.sequence = filled[:-1], filled[-1]

    def tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in layer.values()] + list(self.sequence.values())

    def nbytes(self) -> int:
        """Bytes of every tensor allocated (measured, not computed from the spec)."""
        return sum(t.untyped_storage().nbytes() for t in self.tensors())


class LayerCache:
    """One layer's window onto a `ContiguousCache` for the current forward step.

    `update(**fields)` writes the step's new tokens at the cache's current length and returns
    every cached token so far; `key_positions` are those tokens' positions.
    """

    def __init__(self, cache: ContiguousCache, index: int) -> None:
        self._cache, self._index = cache, index

    def update(self, **new: torch.Tensor) -> dict[str, torch.Tensor]:
        buffers = self._cache.layers[self._index]
        if set(new) != set(buffers):
            raise KeyError(f"layer {self._index} cached {sorted(new)}, spec says {sorted(buffers)}")
        start = self._cache.length
        out = {}
        for name, value in new.items():
            end = start + value.shape[1]
            buffers[name][:, start:end] = value
            out[name] = buffers[name][:, :end]
        return out

    @property
    def key_positions(self) -> torch.Tensor:
        return self._cache.key_positions

    def sequence_field(self, name: str) -> torch.Tensor:
        return self._cache.sequence_field(name)


class ContiguousCache(CacheTensors):
    """A preallocated cache of `max_len` positions for a batch of equal-length sequences.

    Per step the model calls `begin(token_ids, positions)` (per-sequence fields), each layer
    writes its fields through `layer(i).update`, then the model calls `advance()`.
    """

    def __init__(
        self,
        spec: CacheSpec,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if batch_size < 1 or max_len < 1:
            raise ValueError(f"batch_size={batch_size} and max_len={max_len} must be >= 1")
        super().__init__(spec, (batch_size, max_len), dtype, device)
        self.batch_size, self.max_len = batch_size, max_len
        self.length = 0
        self._step = 0  # tokens in the step being written (set by `begin`)
        self._keys: torch.Tensor | None = None  # key_positions, made once per step

    def begin(self, sequence: Mapping[str, torch.Tensor], positions: torch.Tensor | None = None
              ) -> None:
        """Start a step of T tokens: check space, write the per-sequence fields (B, T).

        `sequence` holds the step's per-sequence values ({"token_ids": ids} from the model; at
        least one, which gives B and T). `positions` must be the cache's next T positions (rows
        of equal length); a paged cache uses them to place ragged rows.
        """
        if not sequence:
            raise ValueError("begin needs the step's per-sequence values (its token ids)")
        B, T = next(iter(sequence.values())).shape[:2]
        if B != self.batch_size:
            raise ValueError(f"batch of {B} sequences for a cache of batch_size={self.batch_size}")
        if self.length + T > self.max_len:
            raise ValueError(
                f"cache full: {self.length} cached + {T} new tokens > max_len={self.max_len}"
            )
        if positions is not None:
            expected = torch.arange(self.length, self.length + T, device=positions.device)
            if not bool((positions == expected).all()):
                raise ValueError(
                    f"positions must continue the contiguous cache at {self.length}; "
                    f"got {positions.flatten()[:4].tolist()}..."
                )
        self._step = T

        def write(name: str, values: torch.Tensor) -> None:
            self.sequence[name][:, self.length : self.length + T] = values

        write_sequence_fields(self.spec, sequence, write)

    def advance(self) -> None:
        """Commit the step begun with `begin`."""
        self.length += self._step
        self._step = 0

    def repeat(self, times: int) -> ContiguousCache:
        """A new cache holding every row `times` times (row b -> rows b*times ... b*times +
        times - 1): one prefill of a shared context, then several continuations from it."""
        if times < 1:
            raise ValueError(f"times={times} must be >= 1")
        out = ContiguousCache(self.spec, self.batch_size * times, self.max_len, self.dtype,
                              self.device)
        for src, dst in zip(self.tensors(), out.tensors()):
            dst.copy_(src.repeat_interleave(times, dim=0))
        out.length = self.length
        return out

    def layer(self, index: int) -> LayerCache:
        return LayerCache(self, index)

    @property
    def key_positions(self) -> torch.Tensor:
        """0 .. every cached and new token, (S,): the same tensor for every layer of a step, so
        the layers share one causal mask (egmla.models.positions.Positions.causal_mask)."""
        S = self.length + self._step
        if self._keys is None or self._keys.shape[0] != S:
            self._keys = torch.arange(S, device=self.device)
        return self._keys

    def sequence_field(self, name: str) -> torch.Tensor:
        return self.sequence[name][:, : self.length + self._step]

    def next_positions(self, T: int) -> torch.Tensor:
        return torch.arange(self.length, self.length + T, device=self.device)
