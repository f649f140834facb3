"""egmla.kernels.place_weights: a model's weights moved onto huge-page-advised memory in its
order, with nothing else about the model changed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import dataclasses

from egmla import kernels
from egmla.kernels import placement
from egmla.presets import preset
from support import ROOT
from support.models import build

AVAILABLE = kernels.hugepages() is None


def tiny(tied: bool = True) -> torch.nn.Module:
    return build(dataclasses.replace(preset("tiny-gqa2"), tie_embeddings=tied), torch.float32)


def mapping_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    current = None
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(part, 16) for part in head.split("-"))
            current = lo <= address < hi
        elif head == "VmFlags:" and current:
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not AVAILABLE, reason=f"no transparent huge pages here: {kernels.hugepages()}")
def test_weights_move_in_model_order_with_their_values_and_identities():
    model = tiny()
    before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    moved = kernels.place_weights(model)
    assert moved >= sum(p.numel() * p.element_size() for p, _ in before.values())
    for name, p in model.named_parameters():
        assert p is before[name][0] and torch.equal(p, before[name][1]), name
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name]), name
    assert model.lm_head.weight is model.tok_emb.weight  # still tied
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert ptrs == sorted(ptrs) and all(ptr % placement.ALIGN == 0 for ptr in ptrs)
    assert ptrs[0] % placement.PAGE == 0  # the first weight starts a huge page
    assert ptrs[-1] - ptrs[0] < moved  # one mapping, packed
    assert "hg" in mapping_flags(ptrs[0])  # advised MADV_HUGEPAGE
    assert kernels.place_weights(model) == 0  # placed already


@pytest.mark.skipif(not AVAILABLE, reason=f"no transparent huge pages here: {kernels.hugepages()}")
def test_a_placed_model_computes_trains_and_saves_as_before():
    model, reference = tiny(tied=False), tiny(tied=False)
    kernels.place_weights(model)
    tokens = torch.randint(0, model.config.vocab_size, (2, 7))
    assert torch.equal(model(tokens), reference(tokens))
    for m in (model, reference):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        m(tokens).logsumexp(-1).mean().backward()
        optimizer.step()
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.skipif(not AVAILABLE, reason=f"no transparent huge pages here: {kernels.hugepages()}")
def test_tensors_that_share_memory_stay_together():
    """A view of a larger storage is not moved: moving it would part it from its neighbours."""
    model = torch.nn.Module()
    whole = torch.randn(8, 4)
    model.a = torch.nn.Parameter(whole[:4])
    model.b = torch.nn.Parameter(whole[4:])
    model.c = torch.nn.Parameter(torch.randn(3))
    kernels.place_weights(model)
    assert model.a.data_ptr() == whole.data_ptr() and model.b.data_ptr() == whole[4:].data_ptr()
    assert "hg" in mapping_flags(model.c.data_ptr())


def test_the_switch_and_an_unavailable_system_leave_the_model_alone(monkeypatch, tmp_path):
    model = tiny()
    ptrs = [p.data_ptr() for p in model.parameters()]
    monkeypatch.setenv("EGMLA_HUGEPAGES", "0")
    assert kernels.hugepages() == "turned off by EGMLA_HUGEPAGES"
    assert kernels.place_weights(model) == 0
    monkeypatch.delenv("EGMLA_HUGEPAGES")
    never = tmp_path / "enabled"
    never.write_text("always madvise [never]\n")
    monkeypatch.setattr(placement, "THP", never)
    assert "transparent huge pages are off" in kernels.hugepages()
    assert kernels.place_weights(model) == 0
    assert [p.data_ptr() for p in model.parameters()] == ptrs


@pytest.mark.skipif(not AVAILABLE, reason=f"no transparent huge pages here: {kernels.hugepages()}")
def test_the_engine_places_its_model_and_decodes_the_same_tokens():
    """The same greedy tokens with and without the placement, each in a process of its own."""
    code = ("import sys; sys.path.insert(0, 'tests'); from support.engine import tiny_llm_tokens; "
            "print(tiny_llm_tokens())")
    outs = []
    for flag in ("1", "0"):
        run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "EGMLA_HUGEPAGES": flag}, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        outs.append(run.stdout.strip().splitlines()[-1])  # "[not ]placed <tokens>"
    assert outs[0] == "placed " + outs[1].removeprefix("not placed ")


@pytest.mark.skipif(not AVAILABLE, reason=f"no transparent huge pages here: {kernels.hugepages()}")
def test_a_paged_caches_pools_are_zeros_on_huge_pages_each_its_own_size():
    """What the cache allocates is still what it measures (`nbytes`, per storage)."""
    from serve.paged_cache import PagedKVCache

    model = tiny()
    cache = PagedKVCache(model.cache_spec(), num_blocks=9, block_size=4, dtype=torch.bfloat16)
    pools = cache.tensors()
    assert all(not t.any() for t in pools)
    assert all("hg" in mapping_flags(t.data_ptr()) for t in pools)
    assert cache.nbytes() == sum(t.numel() * t.element_size() for t in pools)
    assert len({t.data_ptr() for t in pools}) == len(pools)  # no two share memory
    with torch.no_grad():
        pools[0].fill_(1.0)
    assert not pools[1].any()
