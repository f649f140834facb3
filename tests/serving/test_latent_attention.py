"""MLA's absorbed decode attention in a native kernel straight from the paged pools
(egmla.kernels.paged_latent_attention, the `native` backend's `attend_latent`): equal to a
float64 softmax over ragged rows, and in the engine equal to the PyTorch path it replaces, for
MLA and EG-MLA `latent` in the forms a converted model uses, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from egmla import kernels
from serve import attention
from serve.paged_cache import _PagedLayer
from support import torch_threads
from support.engine import assert_ragged_native_equals_full_forward, greedy_by_backend
from support.models import VARIANTS, build

SUPPORTED = kernels.unsupported() is None
pytestmark = pytest.mark.skipif(not SUPPORTED, reason="the kernels need x86-64 with AVX2 and FMA")


def reference(q, c_pool, r_pool, slots, lengths, scale):
    """softmax((q_c . c + q_r . k_rope) * scale) . c in float64 over each row's first
    lengths[b] slots; query head h reads RoPE key h // (H / Hr)."""
    B, H, _ = q.shape
    C = c_pool.shape[-1]
    rope = r_pool if r_pool.dim() == 3 else r_pool[:, None]
    R = H // rope.shape[1]
    out = torch.empty(B, H, C, dtype=torch.float64)
    for b in range(B):
        keys = slots[b, : lengths[b]]
        c = c_pool[keys].double()
        for h in range(H):
            scores = c @ q[b, h, :C].double() + rope[keys, h // R].double() @ q[b, h, C:].double()
            out[b, h] = torch.softmax(scores * scale, 0) @ c
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lengths, H, Hr, C, r", [
    ([300], 16, 1, 64, 16),  # MLA: one RoPE key; several chunks of one row over two threads
    ([5, 700, 129, 1], 6, 2, 40, 8),  # ragged; RoPE keys per group (a converted model); C % 8
    ([3, 2], 5, 1, 12, 4),  # H not a multiple of four heads, C and r below a vector's tail
    ([50, 260], 9, 3, 24, 8),  # SmolLM2's 9 heads in 3 x 4 blocks, each block one RoPE group
    ([129, 17], 7, 1, 256, 64),  # 7 heads: a 4-head block and a 3-head one; the paper's widths
    ([40, 90], 10, 5, 32, 8),  # 4-head blocks across RoPE groups of 2 heads, a 2-head block last
])
def test_the_kernel_equals_a_float64_softmax(lengths, H, Hr, C, r, pool_dtype, threads):
    torch.manual_seed(len(lengths) + H)
    B, slots_n = len(lengths), 2048
    c_pool = (torch.randn(slots_n, C)).to(pool_dtype)
    r_pool = (torch.randn(slots_n, Hr, r) * 2).to(pool_dtype)
    if Hr == 1:
        r_pool = r_pool[:, 0].contiguous()  # MLA's (slots, r) layout
    S = max(lengths)
    slots = torch.stack([torch.randperm(slots_n)[:S] for _ in range(B)])  # scattered slots
    q = torch.randn(B, H, C + r) * 0.5
    with torch_threads(threads):
        out = kernels.paged_latent_attention(q, c_pool, r_pool, slots, torch.tensor(lengths), 0.3)
    exact = reference(q, c_pool, r_pool, slots, torch.tensor(lengths), 0.3)
    assert out.shape == (B, H, C) and out.dtype == torch.float32
    assert (out.double() - exact).abs().max().item() < 2e-5


def test_inconsistent_inputs_are_refused_with_a_message():
    c, r = torch.randn(16, 32), torch.randn(16, 8)
    slots, lengths = torch.arange(4)[None], torch.tensor([4])
    with pytest.raises(RuntimeError, match="shapes do not agree"):
        kernels.paged_latent_attention(torch.randn(1, 4, 33), c, r, slots, lengths, 1.0)
    with pytest.raises(RuntimeError, match="pools float32 or bfloat16, of one dtype"):
        kernels.paged_latent_attention(torch.randn(1, 4, 40), c, r.bfloat16(), slots, lengths, 1.0)


# the absorbed latent forms: MLA (the paper's, grouped and converted, no d_nope), EG-MLA latent
LATENT = ["mla-absorbed", "mla-converted-absorbed", "mla-nope0-absorbed",
          "mla-more-rope-heads-absorbed", "egmla-latent-absorbed", "egmla-latent-converted"]


@pytest.fixture
def counted(monkeypatch):
    """Calls of the kernel through the native backend, and a guard: a latent decode step under
    it may not gather its history."""
    calls, real, update = [], kernels.paged_latent_attention, _PagedLayer.update

    def kernel(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    def guarded(self, **new):
        step = self._step
        native = isinstance(step.cache.attention, attention.Native)
        assert not (native and step.decode_only and set(new) == {"c", "k_rope"}), \
            "a latent decode step gathered its history under the native backend"
        return update(self, **new)

    monkeypatch.setattr(attention.kernels, "paged_latent_attention", kernel)
    monkeypatch.setattr(_PagedLayer, "update", guarded)
    return calls


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 0.06)],
                         ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", LATENT)
def test_ragged_paged_decode_equals_the_full_forward(name, dtype, tolerance, counted):
    """Ragged chunked steps through scattered blocks; the decode steps run the kernel. Against
    the same model's full forward in its dtype (bf16: both round, differently)."""
    assert_ragged_native_equals_full_forward(build(VARIANTS[name], dtype), dtype, tolerance)
    assert counted, "no decode step ran the latent kernel"


@pytest.mark.parametrize("name", ["mla-converted-absorbed", "egmla-latent-absorbed"])
def test_the_engine_decodes_the_same_tokens_as_the_pytorch_path(name, counted):
    """Continuous batching with prefix caching (rows sharing a prompt's blocks), float32: the
    native backend's greedy tokens equal the gather path's (`sdpa`)."""
    outs, cached = greedy_by_backend(build(VARIANTS[name], torch.float32))
    assert cached["native"] > 0 and counted
    assert outs["native"] == outs["sdpa"]
