"""EG-MLA `kv`'s absorbed decode attention in a native kernel straight from the paged pools
(egmla.kernels.paged_gated_attention, the `native` backend's `attend_gated`): equal to a
float64 computation written from the equations of docs/attention.md over ragged rows, and in the
engine equal to the model's full forward and to the PyTorch path it replaces, for every
absorbed `kv` form (LayerNorm, RMSNorm, no norm, grouped tables, the converted model's residual
gate, KV heads and RoPE keys per group), float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from egmla import kernels
from serve import attention
from serve.paged_cache import _PagedLayer
from support import torch_threads
from support.engine import assert_ragged_native_equals_full_forward, greedy_by_backend
from support.models import VARIANTS, build, with_attention

SUPPORTED = kernels.unsupported() is None
pytestmark = pytest.mark.skipif(not SUPPORTED, reason="the kernels need x86-64 with AVX2 and FMA")


def reference(m, q_mu, q_rope, c_pool, r_pool, stats, ids, table, residual, slots, lengths, scale):
    """The kernel's function in float64, key by key: with e_j = [table[id_j]; 1 if residual],
    s_ij = (inv_j (c_j^T M_i e_j - mu_j q_mu_i) + q_rope_i . k_rope_j) * scale, a = softmax_j,
    A_i = sum_j a_ij inv_j c_j e_j^T, m_i = sum_j a_ij inv_j mu_j (mu 0, inv 1 where absent)."""
    B, H, C, E1 = m.shape
    rope = r_pool if r_pool.dim() == 3 else r_pool[:, None]
    R = H // rope.shape[1]
    width = 0 if stats is None else stats.shape[1]
    A = torch.zeros(B, H, C, E1, dtype=torch.float64)
    msum = torch.zeros(B, H, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            scores, terms = [], []
            for s in range(int(lengths[b])):
                slot = int(slots[b, s])
                c = c_pool[slot].double()
                e = table[int(ids[slot])].double()
                if residual:
                    e = torch.cat((e, torch.ones(1, dtype=torch.float64)))
                mu = float(stats[slot, 0]) if width == 2 else 0.0
                inv = float(stats[slot, width - 1]) if width else 1.0
                bilinear = c @ m[b, h].double() @ e
                rot = rope[slot, h // R].double() @ q_rope[b, h].double()
                scores.append((inv * (bilinear - mu * float(q_mu[b, h])) + rot) * scale)
                terms.append((c, e, mu, inv))
            a = torch.tensor(scores, dtype=torch.float64).softmax(0)
            for weight, (c, e, mu, inv) in zip(a.tolist(), terms):
                A[b, h] += weight * inv * torch.outer(c, e)
                msum[b, h] += weight * inv * mu
    return A, msum


def pools(lengths, H, Hr, C, E, r, width, residual, pool_dtype, table_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    B, slots_n, vocab = len(lengths), 512, 40
    c_pool = torch.randn(slots_n, C, generator=g).to(pool_dtype)
    r_pool = torch.randn(slots_n, Hr, r, generator=g).to(pool_dtype)
    if Hr == 1:
        r_pool = r_pool[:, 0].contiguous()  # MLA's (slots, r) layout
    stats = torch.rand(slots_n, width, generator=g) + 0.5 if width else None
    ids = torch.randint(0, vocab, (slots_n,), generator=g, dtype=torch.int32)
    table = torch.randn(vocab, E, generator=g).to(table_dtype)
    S = max(lengths)
    slots = torch.stack([torch.randperm(slots_n, generator=g)[:S] for _ in range(B)])
    m = torch.randn(B, H, C, E + residual, generator=g) * 0.1
    q_mu = torch.randn(B, H, generator=g)
    q_rope = torch.randn(B, H, r, generator=g) * 0.5
    return (m, q_mu, q_rope, c_pool, r_pool, stats, ids, table, residual, slots,
            torch.tensor(lengths))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("pool_dtype, table_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)], ids=str)
@pytest.mark.parametrize("lengths, H, Hr, C, E, r, width, residual", [
    ([150], 4, 1, 16, 32, 8, 2, False),  # LayerNorm statistics; three tiles of keys
    ([5, 70, 1], 6, 3, 20, 33, 6, 1, True),  # RMSNorm; ragged; RoPE key per group; E' = 34
    ([9, 4], 2, 2, 7, 5, 3, 0, True),  # no norm; C and E below a vector, C % 4 != 0
])
def test_the_kernel_equals_the_equations_in_float64(lengths, H, Hr, C, E, r, width, residual,
                                                     pool_dtype, table_dtype, threads):
    args = pools(lengths, H, Hr, C, E, r, width, residual, pool_dtype, table_dtype, seed=H)
    with torch_threads(threads):
        A, msum = kernels.paged_gated_attention(*args, scale=0.3)
    A_exact, m_exact = reference(*args, scale=0.3)
    assert A.shape == A_exact.shape and A.dtype == torch.float32
    assert (A.double() - A_exact).abs().max().item() < 2e-5 * A_exact.abs().max().item()
    assert (msum.double() - m_exact).abs().max().item() < 2e-5


def test_bad_inputs_are_refused_with_a_message():
    args = list(pools([4], 2, 1, 8, 16, 4, 2, False, torch.float32, torch.float32, seed=0))
    ids = args[6]
    ids[args[9][0, 2]] = 40  # a key's token id past the table's 40 rows
    with pytest.raises(RuntimeError, match="has token id 40, outside the table's 40 rows"):
        kernels.paged_gated_attention(*args, scale=1.0)
    args[6] = ids.long()
    with pytest.raises(RuntimeError, match="id_pool .* int32"):
        kernels.paged_gated_attention(*args, scale=1.0)
    args = list(pools([4], 2, 1, 8, 16, 4, 2, False, torch.float32, torch.float32, seed=0))
    args[0] = args[0][..., :-1].contiguous()  # M one column short of the table's width
    with pytest.raises(RuntimeError, match="shapes do not agree"):
        kernels.paged_gated_attention(*args, scale=1.0)


# every absorbed `kv` form; "egmla-kv" (impl auto) decodes absorbed once the rows are long
KV = ["egmla-kv-absorbed", "egmla-kv-absorbed-rmsnorm-grouped", "egmla-kv-absorbed-nonorm",
      "egmla-kv-converted-absorbed", "egmla-kv-grouped-layernorm-absorbed"]


@pytest.fixture
def calls(monkeypatch):
    """Calls of the kernel through the native backend (each call's batch size)."""
    made, real = [], kernels.paged_gated_attention

    def kernel(*args, **kwargs):
        made.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(attention.kernels, "paged_gated_attention", kernel)
    return made


@pytest.fixture
def counted(calls, monkeypatch):
    """`calls`, and a guard: a decode step of an absorbed `kv` layer under the native backend
    may not gather its history."""
    update = _PagedLayer.update

    def guarded(self, **new):
        step = self._step
        native = isinstance(step.cache.attention, attention.Native)
        assert not (native and step.decode_only and "c" in new), \
            "an absorbed kv decode step gathered its history under the native backend"
        return update(self, **new)

    monkeypatch.setattr(_PagedLayer, "update", guarded)
    return calls


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 0.06)],
                         ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", KV)
def test_ragged_paged_decode_equals_the_full_forward(name, dtype, tolerance, counted):
    """Ragged chunked steps through scattered blocks; the decode steps run the kernel. Against
    the same model's full forward in its dtype (bf16: both round, differently)."""
    assert_ragged_native_equals_full_forward(build(VARIANTS[name], dtype), dtype, tolerance)
    assert counted, "no decode step ran the gated kernel"


def test_auto_decodes_in_place_where_absorbed_is_cheaper(calls):
    """`impl: auto` picks the absorbed form per step by its MAC count over the longest row: at
    d_c 4 the rebuild below 4 keys, the kernel from 4 on."""
    cfg = with_attention(VARIANTS["egmla-kv"], d_c=4)
    model = build(cfg, torch.float32)
    attn = model.layers[0].attn
    assert not attn.prefers_absorbed(1, 3) and attn.prefers_absorbed(1, 4)
    assert_ragged_native_equals_full_forward(model, torch.float32, 2e-5)
    assert calls, "no decode step ran the gated kernel"


@pytest.mark.parametrize("name", ["egmla-kv-absorbed", "egmla-kv-converted-absorbed"])
def test_the_engine_decodes_the_same_tokens_as_the_pytorch_path(name, counted):
    """Continuous batching with prefix caching (rows sharing a prompt's blocks), float32: the
    native backend's greedy tokens equal the gather path's (`sdpa`)."""
    outs, cached = greedy_by_backend(build(VARIANTS[name], torch.float32))
    assert cached["native"] > 0 and counted
    assert outs["native"] == outs["sdpa"]
