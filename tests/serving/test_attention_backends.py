"""The paged attention backends (serve.attention): each computes what the full forward computes,
over ragged chunked steps, scattered blocks and blocks shared between rows; `auto` picks what a
machine has and says why; a request that cannot run is refused naming the reason."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from egmla.cache import CacheSpec, FieldSpec
from egmla.models.attention.common import attend
from serve import LLM, SamplingParams, attention
from serve.engine import EngineConfig, LLMEngine
from serve.paged_cache import PagedKVCache, _PagedLayer
from support.engine import mixed_prompts, reference_greedy, run_ragged
from support.models import VARIANTS, build

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

IN_PLACE = {"flex": attention.Flex}  # backends that attend over the pools without gathering


@pytest.fixture
def no_gather(monkeypatch):
    """MHA/GQA layers may not gather their history (they must attend in place); the latent
    layers of MLA and EG-MLA still do."""
    update = _PagedLayer.update

    def guarded(self, **new):
        assert set(new) != {"k", "v"}, "an MHA/GQA layer gathered its history"
        return update(self, **new)

    monkeypatch.setattr(_PagedLayer, "update", guarded)


# Every MHA-family variant, and one MLA and one EG-MLA (their latent layers gather under every
# backend: the choice must leave them alone)
@pytest.mark.parametrize("name", ["mha", "gqa", "mqa", "gqa-reglu", "mha-relu2", "mla-absorbed",
                                  "egmla-kv"])
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_ragged_paged_steps_equal_full_forward_under_every_backend(backend, name, request):
    if backend in IN_PLACE:
        request.getfixturevalue("no_gather")
    cfg = VARIANTS[name]
    model = build(cfg)
    g = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (5, 13, 9, 17, 1)]
    chosen = attention.select(backend, torch.device("cpu"), torch.float64, 4, set()).backend
    for seed in range(2):
        got = run_ragged(model, sequences, block_size=4, seed=seed, attention=chosen)
        for s, logits in zip(sequences, got):
            with torch.no_grad():
                expected = model(s[None])[0]
            assert (logits - expected).abs().max().item() < 1e-9


def pools_with_history(spec: CacheSpec, backend, dtype=torch.float64) -> PagedKVCache:
    cache = PagedKVCache(spec, num_blocks=12, block_size=4, dtype=dtype, attention=backend)
    for name, pool in cache.layers[0].items():
        pool.copy_(torch.randn(pool.shape, generator=torch.Generator().manual_seed(len(name))))
    return cache


def gathered_attention(cache: PagedKVCache, tables, context, new_lens, q, new, scale):
    """The reference: update (gather each row's history) + SDPA with the causal mask."""
    step = cache.step(tables, context, new_lens)
    view = step.layer(0)
    history = view.update(**new)
    positions = torch.tensor(context)[:, None] + torch.arange(q.shape[1])
    return attend(q, history["k"], history["v"], scale, positions, view.key_positions)


GQA = CacheSpec(layers=({"k": FieldSpec((2, 8)), "v": FieldSpec((2, 8))},))


def test_flex_sees_blocks_shared_by_rows_of_one_step():
    """Prefix caching hands two rows the same physical blocks: each row sees them (a block is
    not owned by one row), and nothing past its own length. Decode and a ragged prefill."""
    torch.manual_seed(0)
    tables = [[5, 2, 9], [5, 2, 7], [5, 11]]  # blocks 5 and 2 shared
    for context, new_lens in (([9, 10, 5], [1, 1, 1]), ([8, 8, 4], [3, 1, 2])):
        T = max(new_lens)
        q = torch.randn(3, T, 6, 8, dtype=torch.float64)
        new = {n: torch.randn(3, T, 2, 8, dtype=torch.float64) for n in ("k", "v")}
        flex = pools_with_history(GQA, attention.Flex())
        got = flex.step(tables, context, new_lens).layer(0).fused_attention(q, new, "k", "v", 0.3)
        expected = gathered_attention(pools_with_history(GQA, None), tables, context, new_lens,
                                      q, new, 0.3)
        for b, n in enumerate(new_lens):  # padding queries are nobody's
            assert torch.allclose(got[b, :n], expected[b, :n], atol=1e-12)


def reference_flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table,
                                      softmax_scale, causal):
    """flash-attn's documented paged interface, written out: k_cache (num_blocks, block, G, D),
    row b's keys the first cache_seqlens[b] slots of its blocks in block_table[b] order; the
    queries are the last of them (causal, aligned at the end); GQA head h reads h // (H / G)."""
    assert q.dtype == k_cache.dtype and cache_seqlens.dtype == block_table.dtype == torch.int32
    assert k_cache.shape[1] % attention.FLASH_ATTN_BLOCK == 0
    B, Tq, H, _ = q.shape
    out = []
    for b in range(B):
        n = int(cache_seqlens[b])
        k = k_cache[block_table[b].long()].flatten(0, 1)[:n]  # (n, G, D)
        v = v_cache[block_table[b].long()].flatten(0, 1)[:n]
        rep = H // k.shape[1]
        k, v = k.repeat_interleave(rep, 1).transpose(0, 1), v.repeat_interleave(rep, 1).transpose(0, 1)
        mask = torch.arange(n) <= (n - Tq + torch.arange(Tq))[:, None] if causal else None
        o = F.scaled_dot_product_attention(q[b].transpose(0, 1), k, v, attn_mask=mask,
                                           scale=softmax_scale)
        out.append(o.transpose(0, 1))
    return torch.stack(out)


def test_flash_attn_decode_passes_flash_attns_paged_layout():
    """The flash-attn backend hands flash_attn_with_kvcache the pools as (blocks, block, G, D)
    views, int32 lengths and block tables: against its documented semantics, a decode step
    equals the gathered reference and a prefill step declines (nothing written)."""
    torch.manual_seed(0)
    bs = attention.FLASH_ATTN_BLOCK
    backend = attention.FlashAttn(kernel=reference_flash_attn_with_kvcache)
    spec = GQA
    tables, context = [[3, 1], [0], [2, 4]], [300, 17, 511]
    q = torch.randn(3, 1, 6, 8, dtype=torch.float64)
    new = {n: torch.randn(3, 1, 2, 8, dtype=torch.float64) for n in ("k", "v")}

    def pools(chosen):
        cache = PagedKVCache(spec, num_blocks=5, block_size=bs, dtype=torch.float64,
                             attention=chosen)
        for name, pool in cache.layers[0].items():
            pool.copy_(torch.randn(pool.shape, generator=torch.Generator().manual_seed(len(name))))
        return cache

    flash = pools(backend)
    got = flash.step(tables, context, [1, 1, 1]).layer(0).fused_attention(q, new, "k", "v", 0.3)
    plain = pools(None)
    expected = gathered_attention(plain, tables, context, [1, 1, 1], q, new, 0.3)
    assert torch.allclose(got, expected, atol=1e-12)
    assert all(torch.equal(flash.layers[0][n], plain.layers[0][n]) for n in ("k", "v"))
    before = flash.layers[0]["k"].clone()
    prefill = flash.step([[3]], [0], [2]).layer(0)
    two = {n: torch.randn(1, 2, 2, 8, dtype=torch.float64) for n in ("k", "v")}
    assert prefill.fused_attention(q[:1].expand(1, 2, 6, 8), two, "k", "v", 0.3) is None
    assert torch.equal(flash.layers[0]["k"], before)


CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("device,dtype,block,installed,name,why", [
    (CPU, torch.float32, 16, True, "native", "auto on cpu"),
    (CUDA, torch.bfloat16, 256, True, "flash_attn", "flash-attn is installed and fits"),
    (CUDA, torch.bfloat16, 16, True, "flex", "multiple of 256 (got 16)"),
    (CUDA, torch.float32, 256, True, "flex", "float16 or bfloat16"),
    (CUDA, torch.bfloat16, 256, False, "flex", "flash-attn is not installed"),
])
def test_auto_picks_by_machine_and_says_why(device, dtype, block, installed, name, why):
    choice = attention.select("auto", device, dtype, block, {64}, flash_installed=installed)
    assert choice.name == name and why in choice.reason
    if name == "flex":
        assert choice.backend.compiled  # eager FlexAttention would materialize the scores


def test_a_model_without_mha_layers_builds_no_flex_mask(monkeypatch):
    """MLA and EG-MLA layers never use the backend: auto on a GPU takes the plain path for
    them, and an explicit flex builds no block mask for a model without layers that declare
    RoPE K/V attention; a GQA model's step builds one, before its forward."""
    assert attention.select("auto", CUDA, torch.bfloat16, 16, set()).name == "sdpa"
    built = []
    prepare = attention.Flex.prepare
    monkeypatch.setattr(attention.Flex, "prepare",
                        lambda self, step: (built.append(step), prepare(self, step)))
    for name, masks in (("mla-absorbed", 0), ("gqa", 1)):
        engine = LLMEngine(build(VARIANTS[name]), EngineConfig(num_blocks=8, block_size=4,
                                                               attention_backend="flex"))
        engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=1))
        built.clear()
        engine.step()
        assert len(built) == masks, name


@pytest.mark.parametrize("requested,device,installed,message", [
    ("flash_attn", CPU, True, "needs a CUDA device"),
    ("flash_attn", CUDA, False, "not installed"),
    ("magic", CPU, True, "expected one of auto, native, sdpa, flex, flash_attn"),
])
def test_a_backend_that_cannot_run_is_refused_saying_why(requested, device, installed, message):
    with pytest.raises(ValueError, match=message):
        attention.select(requested, device, torch.bfloat16, 256, {64}, flash_installed=installed)


def test_flash_attn_head_dims_are_checked():
    assert "head dims [320]" in attention.flash_attn_fits(CUDA, torch.bfloat16, 256, {320})
    assert attention.flash_attn_fits(CUDA, torch.float16, 512, {64, 128}) is None


def test_the_engine_logs_its_backend_and_greedy_decoding_is_unchanged(caplog):
    """An engine under flex, with prefix-cache hits and continuous batching, decodes what the
    full recompute decodes, and says which backend it runs."""
    cfg = VARIANTS["gqa"]
    model = build(cfg, dtype=torch.float32)
    prompts = mixed_prompts(cfg.vocab_size, count=6)
    with caplog.at_level(logging.INFO, logger="serve"):
        engine = LLMEngine(model, EngineConfig(attention_backend="flex", block_size=4,
                                               num_blocks=64, max_num_batched_tokens=32))
    assert engine.attention_backend == "flex"
    assert "attention backend: flex (requested (eager off a GPU))" in caplog.text
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    for prompt, out in zip(prompts, outputs):
        assert out == reference_greedy(model, prompt, 6)
    assert engine.stats.cached_prompt_tokens > 0  # rows shared prefix blocks


def test_a_bad_backend_is_refused_before_the_model_loads(tmp_path):
    with pytest.raises(ValueError, match="attention_backend='fastest'"):
        LLM(str(tmp_path / "no-such-model"), attention_backend="fastest")


def test_the_servers_flags_list_the_backends_and_take_enforce_eager():
    from serve.__main__ import ATTENTION_BACKENDS, build_parser

    assert ATTENTION_BACKENDS == attention.BACKENDS
    args = build_parser().parse_args(["--model", "m", "--attention-backend", "flex",
                                      "--no-enforce-eager"])
    assert args.attention_backend == "flex" and args.enforce_eager is False
    assert build_parser().parse_args(["--model", "m"]).enforce_eager is True


@pytest.mark.slow
@pytest.mark.parametrize("backend,name", [("native", "gqa"), ("sdpa", "gqa"), ("flex", "gqa"),
                                          ("native", "mla-absorbed"), ("sdpa", "egmla-kv")])
def test_a_compiled_decode_step_decodes_what_the_eager_one_does(backend, name):
    """enforce_eager=False: decode steps through torch.compile (dynamic shapes) give the full
    recompute's greedy tokens, with continuous batching and prefix-cache hits."""
    model = build(VARIANTS[name], dtype=torch.float32)
    prompts = mixed_prompts(model.config.vocab_size, count=6)
    engine = LLMEngine(model, EngineConfig(attention_backend=backend, enforce_eager=False,
                                           block_size=4, num_blocks=64, max_num_batched_tokens=32))
    assert engine.executor.decode_model is not model  # the compiled wrapper
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    for prompt, out in zip(prompts, outputs):
        assert out == reference_greedy(model, prompt, 6)


@pytest.mark.parametrize("bad,message", [({"enforce_eager": "no"}, "enforce_eager='no'"),
                                         ({"attention_backend": None}, "attention_backend=None")])
def test_bad_engine_switches_are_refused_naming_them(bad, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_args(**bad)
