"""Weights placed for streaming: a decode step reads every weight once, and on this machine it
reads them faster from 2 MiB pages than from 4 KiB ones (a hardware prefetcher stops at a page's
edge, and every 4 KiB page costs a TLB entry). PyTorch's allocator asks for huge pages only for
single tensors of 2 MiB and more, and only with THP_MEM_ALLOC_ENABLE set; most of a small
model's matrices are smaller. `place_weights(model)` moves a model's weights into one anonymous
mapping advised for transparent huge pages, in the model's order (a decode step's reading
order). Interleaved in one process, a decode step's matrix products over SmolLM2's weights
read 9-25% faster from it; end to end see benchmarks/decode_speed.py's `-smallpages` systems.

    moved = place_weights(model)   # bytes moved; 0 where it does nothing (see its doc)

Each Parameter stays the same object (only its `.data` changes) and each buffer keeps its
name, so optimizers, tied weights and state dicts see no difference; each tensor is a storage
of its own size inside the mapping, which lives as long as any of them. `huge_zeros` allocates
new tensors the same way (the paged KV cache's pools). EGMLA_HUGEPAGES=0 turns both off (the
A/B switch)."""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import torch

PAGE = 2 << 20  # a transparent huge page
ALIGN = 64  # each tensor starts on a cache line
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def hugepages() -> str | None:
    """Why weights are not placed here, or None when they are."""
    if os.environ.get("EGMLA_HUGEPAGES", "1").strip().lower() in ("0", "off", "false", "no"):
        return "turned off by EGMLA_HUGEPAGES"
    if sys.platform != "linux" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return f"transparent huge pages are Linux's, not {sys.platform}'s"
    try:
        mode = THP.read_text()
    except OSError:
        return f"{THP} is unreadable: no transparent huge pages"
    if "[always]" not in mode and "[madvise]" not in mode:
        return f"transparent huge pages are off ({THP}: {mode.strip()})"
    return None


def _movable(t: torch.Tensor) -> bool:
    """A CPU tensor that is its storage's only tenant, whole and contiguous: moving it cannot
    part it from a view that shares its memory."""
    return (t.device.type == "cpu" and t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.numel() > 0)


def _area(layout: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
    """Tensors of these shapes and dtypes, zero-filled, one after another (each on a cache
    line) in one anonymous mapping advised for transparent huge pages, the first on a page.
    Each is a storage of its own size (torch.frombuffer), and each keeps the mapping alive."""
    offsets, total = [], 0
    for shape, dtype in layout:
        offsets.append(total)
        total += -(-shape.numel() * dtype.itemsize // ALIGN) * ALIGN
    area = mmap.mmap(-1, -(-max(total, 1) // PAGE) * PAGE + PAGE,
                     flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        area.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # refused: the tensors still live here, on small pages
        pass
    start = -torch.frombuffer(area, dtype=torch.uint8, count=1).data_ptr() % PAGE
    return [torch.frombuffer(area, dtype=dtype, count=shape.numel(), offset=start + at).view(shape)
            for (shape, dtype), at in zip(layout, offsets)]


def huge_zeros(layout: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor] | None:
    """New zero tensors of these shapes and dtypes on huge pages, in one mapping (a paged KV
    cache's pools: a decode step reads its keys block by block), or None where `hugepages()`
    says why not (the caller then allocates as usual)."""
    if hugepages() is not None:
        return None
    return _area([(torch.Size(shape), dtype) for shape, dtype in layout])


def place_weights(model: torch.nn.Module) -> int:
    """Move `model`'s parameters and buffers (each once; see `_movable` for which) into one
    huge-page-advised anonymous mapping, in `model.modules()` order, and return the bytes
    moved: 0 where `hugepages()` says why not, or where the weights already sit in one mapping
    of ours. A model that keeps kernel weights (`weights_replaced`) is told."""
    if hugepages() is not None:
        return 0
    tensors: list[tuple[dict, str, torch.Tensor]] = []  # (the owner's dict, name, tensor)
    seen: set[int] = set()
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or id(t) in seen or not _movable(t):
                    continue
                seen.add(id(t))
                tensors.append((table, name, t))
    if not tensors or getattr(model, "_egmla_placed", None) == _where(tensors):
        return 0
    placed = _area([(t.shape, t.dtype) for _, _, t in tensors])
    with torch.no_grad():
        for (table, name, t), new in zip(tensors, placed):
            new.copy_(t)
            if isinstance(t, torch.nn.Parameter):
                t.data = new
            else:
                table[name] = new
    model._egmla_placed = _where(tensors)
    if hasattr(model, "weights_replaced"):
        model.weights_replaced()
    return sum(t.numel() * t.element_size() for t in placed)


def _where(tensors: list[tuple[dict, str, torch.Tensor]]) -> tuple[int, ...]:
    """Where each named tensor's data is now (unchanged while the weights stay placed)."""
    return tuple(table[name].data_ptr() for table, name, _ in tensors)
