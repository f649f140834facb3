"""The paged cache: allocated bytes equal the analytic spec, and ragged chunked steps over
scattered blocks reproduce the full forward of every sequence, for every variant."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from egmla.models import Transformer, cache_spec_for
from egmla.presets import PRESETS, preset
from serve.executor import fused_decode
from serve.paged_cache import PagedKVCache
from support.engine import run_ragged
from support.models import VARIANTS, build, exact_predictor

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_bytes_equal_analytic(name, dtype):
    spec = cache_spec_for(preset(name))
    cache = PagedKVCache(spec, num_blocks=3, block_size=16, dtype=dtype, device="meta")
    assert cache.nbytes() == 3 * 16 * spec.bytes_per_token(dtype)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_ragged_paged_steps_equal_full_forward(name):
    cfg = VARIANTS[name]
    model = build(cfg)
    g = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (5, 13, 9, 17, 1)]
    for seed in range(3):
        got = run_ragged(model, sequences, block_size=4, seed=seed)
        for s, logits in zip(sequences, got):
            with torch.no_grad():
                expected = model(s[None])[0]
            assert (logits - expected).abs().max().item() < 1e-9


@pytest.mark.parametrize("name", ["mha", "gqa"])
def test_packed_steps_equal_each_rows_full_forward(name):
    # Every row's new tokens as one row (the engine's packed forward): new prompts, then their
    # next chunks and single decode tokens over what the first step wrote. Each row's logits
    # are its own full forward's.
    model = build(VARIANTS[name])
    g = torch.Generator().manual_seed(5)
    sequences = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (9, 14, 3, 11)]
    cache = PagedKVCache(model.cache_spec(), num_blocks=16, block_size=4, dtype=torch.float64)
    tables = [[7, 2, 5], [0, 9, 4, 11], [3], [15, 1, 8]]  # scattered blocks
    done = [0] * len(sequences)
    for new in ([5, 13, 2, 4], [4, 1, 1, 7]):  # prompts, then chunks and decodes with history
        step = cache.step(tables, done, new, packed=True)
        tokens = torch.cat([s[d:d + n] for s, d, n in zip(sequences, done, new)])[None]
        positions = torch.cat([torch.arange(d, d + n) for d, n in zip(done, new)])[None]
        with torch.no_grad():
            packed = model(tokens, positions, cache=step)[0]  # (N, V)
            for (start, end, context), s, d, n in zip(step.segments, sequences, done, new):
                assert (start, end - start, context) == (start, n, d)
                expected = model(s[None, :d + n])[0, d:]
                assert (packed[start:end] - expected).abs().max().item() < 1e-9
        done = [d + n for d, n in zip(done, new)]


def test_a_packed_step_never_gathers():
    model = build(VARIANTS["gqa"])
    cache = PagedKVCache(model.cache_spec(), num_blocks=4, block_size=4, dtype=torch.float64)
    step = cache.step([[0], [1, 2]], [0, 3], [2, 3], packed=True)
    assert step.segments == [(0, 2, 0), (2, 5, 3)]
    fields = {name: torch.zeros(1, 5, *field.shape) for name, field in
              model.cache_spec().layers[0].items()}
    with pytest.raises(RuntimeError, match="none gathers"):
        step.layer(0).update(**fields)


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads resident memory from procfs")
def test_populate_touches_every_page_of_the_pools_and_leaves_them_zero():
    # What `python -m serve` does at start (docs/serving.md): the pool's pages resident before
    # any step writes them, its contents unchanged.
    def resident() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    cache = PagedKVCache(cache_spec_for(preset("paper-mha")), num_blocks=32, block_size=16)
    assert cache.nbytes() >= 32 << 20
    before = resident()
    cache.populate()
    assert resident() - before >= 0.9 * cache.nbytes()
    assert all(t.count_nonzero().item() == 0 for t in cache.tensors())


def test_copy_block_duplicates_every_field():
    spec = cache_spec_for(preset("tiny-egmla"))
    cache = PagedKVCache(spec, num_blocks=4, block_size=2)
    for t in [t for layer in cache.layers for t in layer.values()] + list(cache.sequence.values()):
        t[2:4] = 7
    cache.copy_block(1, 3)
    for t in [t for layer in cache.layers for t in layer.values()] + list(cache.sequence.values()):
        assert (t[6:8] == 7).all() and (t[0:2] == 0).all()


def test_too_many_tokens_for_the_blocks_is_an_error():
    cache = PagedKVCache(cache_spec_for(preset("tiny-mha")), num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="do not fit"):
        cache.step([[0, 1]], [6], [3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_attention_read_in_place_equals_gather_and_sdpa(dtype):
    """A decode step's fused attention (egmla.kernels.paged_attention, where the CPU runs it)
    writes what `update` writes and returns what SDPA over the gathered history returns, GQA
    heads included; so does a prefill of new prompts (causal over their own tokens, ragged rows
    padded); a prefill over history declines and writes nothing."""
    from egmla import kernels
    from egmla.cache import CacheSpec, FieldSpec
    from egmla.models.attention.common import attend

    torch.manual_seed(0)
    G, H, D = 2, 6, 16
    spec = CacheSpec(layers=({"k": FieldSpec((G, D)), "v": FieldSpec((G, D))},))
    caches = [PagedKVCache(spec, num_blocks=12, block_size=4, dtype=dtype) for _ in range(2)]
    for cache in caches:  # the same history in both
        for name, pool in cache.layers[0].items():
            torch.manual_seed(len(name))
            pool.copy_(torch.randn(pool.shape))
    tables, context = [[5, 2, 9], [0, 7], [11]], [9, 6, 0]
    q = torch.randn(3, 1, H, D)
    new = {"k": torch.randn(3, 1, G, D), "v": torch.randn(3, 1, G, D)}
    fused_step, plain_step = (c.step(tables, context, [1, 1, 1]) for c in caches)
    with torch.no_grad():
        fused = fused_step.layer(0).fused_attention(q, new, key="k", value="v", scale=D**-0.5)
        view = plain_step.layer(0)
        history = view.update(**new)
        positions = torch.tensor(context)[:, None]
        plain = attend(q, history["k"].float(), history["v"].float(), D**-0.5, positions,
                       view.key_positions)
    if not kernels.paged_attention_runs(q, caches[0].layers[0]["k"], caches[0].layers[0]["v"]):
        assert fused is None and kernels.unsupported() is not None
        return
    assert fused.shape == (3, 1, H, D)
    assert torch.allclose(fused.float(), plain, atol=1e-5)
    for name in ("k", "v"):
        assert torch.equal(caches[0].layers[0][name], caches[1].layers[0][name])  # same writes
    prefill = caches[0].step([[3, 4]], [2], [2])  # two new tokens after two cached
    before = caches[0].layers[0]["k"].clone()
    two = {"k": torch.randn(1, 2, G, D), "v": torch.randn(1, 2, G, D)}
    assert prefill.layer(0).fused_attention(q[:1].expand(1, 2, H, D), two, key="k", value="v",
                                            scale=1.0) is None
    assert torch.equal(caches[0].layers[0]["k"], before)
    # new prompts of 5 and 3 tokens, the second padded to 5
    fresh_steps = [c.step([[3, 4], [6]], [0, 0], [5, 3]) for c in caches]
    q5 = torch.randn(2, 5, H, D)
    five = {"k": torch.randn(2, 5, G, D), "v": torch.randn(2, 5, G, D)}
    with torch.no_grad():
        fused = fresh_steps[0].layer(0).fused_attention(q5, five, key="k", value="v", scale=0.3)
        view = fresh_steps[1].layer(0)
        history = view.update(**five)
        positions = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 0, 0]])
        plain = attend(q5, history["k"].float(), history["v"].float(), 0.3, positions,
                       view.key_positions)
    assert torch.allclose(fused[0].float(), plain[0], atol=1e-5)
    assert torch.allclose(fused[1, :3].float(), plain[1, :3], atol=1e-5)  # its real queries
    for name in ("k", "v"):
        assert torch.equal(caches[0].layers[0][name], caches[1].layers[0][name])


def block_by_modules(block, x, positions, view, threshold: float = 0.0):
    """The pre-norm block's definition, module by module (the reference for the fused block);
    its MLP dense, with SwiGLU's firing threshold applied by hand where there is one (sparse
    decoding in "gate" mode, or with an exact predictor, computes exactly this)."""
    h = x + block.attn(block.attn_norm(x), positions, view)
    n, mlp = block.mlp_norm(h), block.mlp
    hidden = mlp.hidden(n)
    if threshold:
        hidden = hidden * (F.silu(mlp.w_gate(n)).abs() > threshold)
    return h + mlp.w_down(hidden)


DENSE = [(ffn, None) for ffn in ("swiglu", "reglu", "drelu", "relu2")]
SPARSE = [("swiglu", "gate"), ("reglu", "gate"), ("relu2", "gate"), ("drelu", "predicted"),
          ("relu2", "predicted")]  # (an exact predictor of g > 0 is not one for |silu(g)| > t)


@pytest.mark.parametrize("dtype,cache_dtype,ffn,sparse", [
    *[(torch.float32, torch.float32, *case) for case in DENSE + SPARSE],
    *[(torch.float32, torch.bfloat16, *case) for case in DENSE[:1] + SPARSE[:1]],
    *[(torch.bfloat16, torch.bfloat16, *case) for case in DENSE]], ids=str)
def test_a_decode_block_in_one_kernel_call_equals_its_modules(dtype, cache_dtype, ffn, sparse):
    """A decode step's block in one call (fused_decode, egmla.kernels.decode_blocks) computes
    what the block's modules compute and writes the same K/V into the pools, for a GQA model
    over ragged rows, with each MLP activation, dense or sparse (SwiGLU thresholded at 0.05; the
    ReLU family with an exact predictor and a hot block); a prefill step declines and writes
    nothing. fp32: equal to
    1e-5 (measured 1e-7); a bf16 model: within one bf16 ulp of the largest output (measured a
    quarter of one: the fused block keeps its activations in fp32 where the modules round each
    to bf16)."""
    from egmla import kernels
    from egmla.models.sparse_ffn import attach

    torch.manual_seed(0)
    model = Transformer(preset("tiny-gqa2", ffn=ffn)).eval()
    with torch.no_grad():  # norms off their init, so a norm weight left out would show
        for block in model.layers:
            for norm in (block.attn_norm, block.mlp_norm):
                norm.weight.uniform_(0.5, 1.5)
    model = model.to(dtype)
    block = model.layers[1]
    threshold = 0.05 if ffn == "swiglu" and sparse else 0.0
    if sparse:
        attached = attach(block.mlp, sparse, threshold, hot=4 if sparse == "predicted" else 0,
                          predictor=exact_predictor(block.mlp) if sparse == "predicted" else None)
    spec = model.cache_spec()
    caches = [PagedKVCache(spec, num_blocks=12, block_size=4, dtype=cache_dtype) for _ in range(2)]
    for cache in caches:  # the same history in both
        torch.manual_seed(1)
        for pool in cache.tensors():
            pool.copy_(torch.randn(pool.shape))
    tables, context = [[5, 2, 9], [0, 7], [11]], [9, 6, 0]
    x = torch.randn(3, 1, model.config.d_model).to(dtype)
    positions = torch.tensor(context)[:, None]
    fused_step, plain_step = (c.step(tables, context, [1, 1, 1]) for c in caches)
    with torch.no_grad():
        fused = fused_decode([block], x, positions, [fused_step.layer(1)])
        plain = block_by_modules(block, x, positions, plain_step.layer(1), threshold)
    if kernels.unsupported() is not None:
        assert fused is None
        return
    if sparse:  # it ran sparse: fewer neurons than the MLP has, counted
        assert 0 < attached.stats["active"] < attached.stats["neurons"]
    assert fused is not None and fused.shape == x.shape and fused.dtype == dtype
    if dtype == torch.float32:
        assert torch.allclose(fused, plain, atol=1e-5)
        for name in ("k", "v"):
            assert torch.allclose(caches[0].layers[1][name].float(), caches[1].layers[1][name].float(),
                                  atol=1e-6 if cache_dtype == torch.float32 else 1e-2)
    else:
        assert (fused.float() - plain.float()).abs().max() <= 2**-7 * plain.float().abs().max()
    prefill = caches[0].step([[3]], [0], [2])
    before = [t.clone() for t in caches[0].tensors()]
    two = torch.randn(1, 2, model.config.d_model).to(dtype)
    with torch.no_grad():
        assert fused_decode([block], two, torch.arange(2)[None], [prefill.layer(1)]) is None
    assert all(torch.equal(a, b) for a, b in zip(caches[0].tensors(), before))


def test_the_fused_decode_follows_changes_to_the_model_between_steps():
    """A block's weights are checked for the kernel once and kept (Block.kernel_weights), yet
    every change a user can make between steps shows at the next one: weights edited in place,
    a parameter assigned anew (then `model.weights_replaced()`), sparse decoding attached and
    then detached, and the model cast to another dtype. After each, the fused step equals the block's modules (fp32 to 1e-5; bf16
    within one bf16 ulp of the largest output)."""
    from egmla import kernels
    from egmla.models.sparse_ffn import attach, detach

    torch.manual_seed(0)
    model = Transformer(preset("tiny-gqa2", ffn="reglu")).eval()
    block = model.layers[0]
    tables, context = [[5, 2, 9], [0, 7]], [9, 6]
    positions = torch.tensor(context)[:, None]
    supported = kernels.unsupported() is None

    def fused_and_modules(dtype=torch.float32):
        caches = [PagedKVCache(model.cache_spec(), num_blocks=12, block_size=4, dtype=dtype)
                  for _ in range(2)]
        for cache in caches:
            torch.manual_seed(1)
            for pool in cache.tensors():
                pool.copy_(torch.randn(pool.shape))
        x = torch.randn(2, 1, model.config.d_model, generator=torch.Generator().manual_seed(2))
        x = x.to(dtype)
        fused_step, plain_step = (c.step(tables, context, [1, 1]) for c in caches)
        with torch.no_grad():
            fused = fused_decode([block], x, positions, [fused_step.layer(0)])
            plain = block_by_modules(block, x, positions, plain_step.layer(0))
        assert (fused is not None) == supported
        return (fused if supported else plain).float(), plain.float()

    def check(dtype=torch.float32):
        fused, plain = fused_and_modules(dtype)
        tolerance = 1e-5 if dtype == torch.float32 else 2**-7 * plain.abs().max()
        assert (fused - plain).abs().max() <= tolerance
        return fused

    before = check()
    with torch.no_grad():
        block.attn.wq.weight.mul_(1.5)  # in place: the kept weights are the same tensors
    edited = check()
    block.mlp.w_up.weight = torch.nn.Parameter(torch.randn_like(block.mlp.w_up.weight) * 0.05)
    model.weights_replaced()  # a parameter assigned anew: the kept kernel weights are re-read
    assigned = check()
    assert (edited - before).abs().max() > 1e-3 and (assigned - edited).abs().max() > 1e-3
    attached = attach(block.mlp, "gate")  # exact for ReGLU: the same output, fewer neurons
    check()
    assert not supported or 0 < attached.stats["active"] < attached.stats["neurons"]
    detach(block.mlp)
    check()
    assert attached.stats["steps"] == supported  # the dense step after detaching counted nothing
    model.to(torch.bfloat16)
    check(torch.bfloat16)


def test_an_engine_decode_step_runs_one_kernel_call_per_mha_block():
    """Decoding through the paged engine takes the fused block for MHA/GQA with any MLP (and
    not the per-op path); MLA's blocks, which it cannot express, take their modules."""
    from egmla import kernels
    from serve.engine import EngineConfig, LLMEngine, SamplingParams

    supported = kernels.unsupported() is None
    cases = (("tiny-gqa2", "swiglu", supported), ("tiny-mla", "swiglu", False),
             ("tiny-gqa2", "reglu", supported), ("tiny-gqa2", "relu2", supported))
    for name, ffn, fused in cases:
        torch.manual_seed(0)
        model = Transformer(preset(name, ffn=ffn)).eval()
        engine = LLMEngine(model, EngineConfig(num_blocks=8, block_size=4))
        engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=3))
        engine.step()  # prefill
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.step()  # one decode step
        calls = {e.key: e.count for e in prof.key_averages()}
        assert calls.get("egmla::decode_block", 0) == (model.config.n_layers if fused else 0), (name, ffn)
