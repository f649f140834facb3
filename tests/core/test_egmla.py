"""EG-MLA: the gate's documented initialization, and the absorbed `kv` computation against the
rebuild (contiguous cache, paged engine), with its cached norm statistics."""

from __future__ import annotations

import pytest
import torch

from egmla.cache import ContiguousCache
from egmla.models import Transformer, cache_spec_for
from egmla.presets import preset
from serve.engine import EngineConfig, LLMEngine, SamplingParams
from serve.paged_cache import PagedKVCache
from support.engine import mixed_prompts, reference_greedy
from support.models import build, random_ids, with_attention

GROUPS = [1, 2, 4]  # small-egmla has 4 layers: one table per layer, per pair, for the whole depth


def small(position: str, group: int, **changes):
    name = "small-egmla" if position == "kv" else "small-egmla-latent"
    return with_attention(preset(name), gate_group_size=group, **changes)


def gate_norm_io(model: Transformer, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, output) of every layer's gate norm in a forward pass over `ids`."""
    seen = []
    hooks = [b.attn.gate_norm.register_forward_hook(lambda m, i, o: seen.append((i[0], o)))
             for b in model.layers]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("position", ["kv", "latent"])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("reinit", [False, True], ids=["fresh", "reinitialized"])
@pytest.mark.parametrize("gate_init", ["random", "matched", "small"])
def test_gate_has_its_documented_init(position, group, reinit, gate_init):
    """docs/attention.md, per `gate_init`: `random` and `matched` draw E ~ N(0, 1) and
    W_UE ~ N(0, 1/d_e), a gate of unit scale, so the gated vector sits far above the norm's eps;
    `random` hands on unit-scale K/V (or latent), `matched` K/V at MLA's init_std * sqrt(d_c)
    under `kv`; `small` draws both from N(0, init_std^2) and, under `kv`, leaves the gated vector
    below eps. Every group size, built fresh or re-initialized; shared tables stay one tensor."""
    cfg = small(position, group, gate_init=gate_init)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    if reinit:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(std=0.5)  # anything: reset_parameters must set every gate piece again
        model.reset_parameters()
    a, std, eps = cfg.attention, cfg.init_std, cfg.norm_eps
    tables = {id(b.attn.gate_table.weight): b.attn.gate_table.weight for b in model.layers}
    assert len(tables) == cfg.n_layers // group
    unit = gate_init != "small"
    for i, block in enumerate(model.layers):
        attn = block.attn
        assert attn.gate_table is model.layers[i - i % group].attn.gate_table
        assert attn.gate_table.weight.std().item() == pytest.approx(1.0 if unit else std, rel=0.05)
        assert attn.w_gate.weight.std().item() == pytest.approx(a.d_e**-0.5 if unit else std, rel=0.1)
        g = attn.gate(random_ids(cfg, 2, 64)).std().item()
        assert 1 / 3 < g < 3 if unit else g < 0.01
    for z, y in gate_norm_io(model, random_ids(cfg, 2, 64)):
        if unit:
            assert z.var(-1).min().item() > 100 * eps  # the gated vector, every token
        elif position == "kv":
            assert z.var(-1).max().item() < eps  # the regime `small` leaves the kv norm in
        if gate_init == "matched" and position == "kv":
            assert y.std().item() == pytest.approx(std * a.d_c**0.5, rel=0.2)  # MLA's K/V scale
        elif unit:
            assert 0.5 < y.std().item() < 2  # what the norm hands on: not crushed


def test_default_init_is_small_for_every_group_size():
    """The default the docs state (`gate_init: small`, the lowest loss in the recorded study):
    every table and W_UE at N(0, init_std^2), a table shared by a group included (before the fix
    a shared table escaped the generic pass and kept std 1)."""
    for position in ("kv", "latent"):
        for group in GROUPS:
            cfg = small(position, group)
            model = Transformer(cfg)
            for block in model.layers:
                for w in (block.attn.gate_table.weight, block.attn.w_gate.weight):
                    assert w.std().item() == pytest.approx(cfg.init_std, rel=0.05)


def test_init_is_not_left_to_module_order():
    """The bug this pins: the generic pass visited the gate's Embedding and Linear after the
    EG-MLA module and reset them to N(0, 0.02)."""
    for group in GROUPS:
        model = Transformer(small("kv", group, gate_init="random"))
        assert all(b.attn.gate_table.weight.std() > 0.5 for b in model.layers)


def randomize_norms(model: Transformer, seed: int = 0) -> Transformer:
    """Gate norms with non-trivial gamma and beta, so the absorbed affine terms are exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.layers:
            for p in block.attn.gate_norm.parameters():
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def rebuilt_and_absorbed(norm: str, group: int, tiny: bool = True):
    base = with_attention(preset("tiny-egmla" if tiny else "small-egmla"), gate_norm=norm,
                          gate_group_size=group)
    rebuilt = randomize_norms(build(with_attention(base, impl="naive")))
    absorbed = Transformer(with_attention(base, impl="absorbed")).double().eval()
    absorbed.load_state_dict(rebuilt.state_dict())
    return rebuilt, absorbed


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm", "none"])
@pytest.mark.parametrize("group", [1, 2])
def test_absorbed_equals_rebuilt_decode(norm, group):
    """Float64: a prefill then 12 decode steps, and the full forward, agree to < 1e-9."""
    rebuilt, absorbed = rebuilt_and_absorbed(norm, group)
    ids = random_ids(rebuilt.config, 3, 30)
    with torch.no_grad():
        assert (rebuilt(ids) - absorbed(ids)).abs().max().item() < 1e-9
        caches = [m.new_cache(3, 30) for m in (rebuilt, absorbed)]
        outs = []
        for model, cache in zip((rebuilt, absorbed), caches):
            steps = [model(ids[:, :18], cache=cache)]
            steps += [model(ids[:, t : t + 1], cache=cache) for t in range(18, 30)]
            outs.append(torch.cat(steps, dim=1))
    assert (outs[0] - outs[1]).abs().max().item() < 1e-9
    assert "norm_stats" not in caches[0].layers[0]
    assert ("norm_stats" in caches[1].layers[0]) == (norm != "none")


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm", "none"])
@pytest.mark.parametrize("group", [1, 2])
def test_absorbed_engine_equals_rebuilt_greedy(norm, group):
    """The paged engine (chunked prefill, prefix caching, ragged batches) serving the absorbed
    model gives the rebuilt model's greedy tokens."""
    rebuilt, absorbed = rebuilt_and_absorbed(norm, group)
    prompts = mixed_prompts(rebuilt.config.vocab_size, count=8)
    config = EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=32)
    outputs = LLMEngine(absorbed, config).generate(prompts, SamplingParams(temperature=0, max_tokens=10))
    for prompt, out in zip(prompts, outputs):
        assert out == reference_greedy(rebuilt, prompt, 10)


@pytest.mark.parametrize("impl", ["naive", "absorbed", "auto"])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_norm_stats_bytes_analytic_equal_allocated(impl, norm, dtype):
    """The statistics field is there whenever absorbed may run (float32 at least, one per
    statistic and layer), counted in the bytes but not in the paper's K/V elements."""
    cfg = with_attention(preset("small-egmla"), impl=impl, gate_norm=norm)
    spec = cache_spec_for(cfg)
    a, L = cfg.attention, cfg.n_layers
    stats = 0 if impl == "naive" else {"layernorm": 2, "rmsnorm": 1, "none": 0}[norm]
    stat_bytes = L * stats * torch.promote_types(dtype, torch.float32).itemsize
    assert spec.auxiliary_bytes_per_token(dtype) == stat_bytes
    assert spec.elements_per_token() == L * (a.d_c + a.d_rope)
    expected = L * (a.d_c + a.d_rope) * dtype.itemsize + stat_bytes + 4  # + the int32 id
    assert spec.bytes_per_token(dtype) == expected
    assert ContiguousCache(spec, 2, 24, dtype=dtype).nbytes() == 2 * 24 * expected
    assert PagedKVCache(spec, 5, 8, dtype=dtype).nbytes() == 5 * 8 * expected


def test_cached_stats_are_the_norms_statistics():
    """What a prefill writes into the statistics field is the LayerNorm's mean and 1/sigma of
    each token's gated vector (the same numbers torch's layer_norm divides by)."""
    model = randomize_norms(build(preset("tiny-egmla")))
    ids = random_ids(model.config, 2, 9)
    cache = model.new_cache(2, 9)
    with torch.no_grad():
        model(ids, cache=cache)
    for i, (z, _) in enumerate(gate_norm_io(model, ids)):
        stats = cache.layers[i]["norm_stats"]
        eps = model.layers[i].attn.gate_norm.eps
        assert torch.allclose(stats[..., 0], z.mean(-1), atol=1e-12)
        assert torch.allclose(stats[..., 1], (z.var(-1, correction=0) + eps).rsqrt(), rtol=1e-12)


def test_auto_picks_the_cheaper_computation_per_step():
    """Absorbed where it does fewer MACs (decode over a long context at a narrow latent), the
    rebuild for long prefill chunks and where d_c * d_e is large (d_c 256)."""
    with torch.device("meta"):
        kv16 = Transformer(preset("paper-egmla-kv16")).layers[0].attn
        kv256 = Transformer(preset("paper-egmla-kv256")).layers[0].attn
    assert kv16._use_absorbed(1, 4096, cached=True)
    assert not kv16._use_absorbed(512, 4096, cached=True)
    assert not kv16._use_absorbed(1, 4096, cached=False)  # training: always the rebuild
    assert not kv256._use_absorbed(1, 4096, cached=True)
    macs = kv16.step_macs(1, 4096)
    assert macs["rebuild"] / macs["absorbed"] > 3


def test_the_latent_gate_is_its_own_class_with_the_same_weight_names():
    """`type: egmla, gate_position: latent` builds EGMLALatent (MLA's computation over the gated
    latent; no statistics, no token ids), named as EG-MLA's weights always were."""
    from egmla.models.attention import EGMLA, EGMLALatent, MLA

    latent, kv = (Transformer(preset(name)) for name in ("tiny-egmla-latent", "tiny-egmla"))
    attn = latent.layers[0].attn
    assert type(attn) is EGMLALatent and type(kv.layers[0].attn) is EGMLA
    for method in ("expand", "decode_cost", "supports_absorbed", "prefers_absorbed", "_absorbed"):
        assert getattr(EGMLALatent, method) is getattr(MLA, method)  # MLA's, not a branch
    assert set(attn.cache_spec()) == {"c", "k_rope"} and not attn.needs_token_ids
    names = {k for k in latent.state_dict() if k.startswith("layers.0.attn.")}
    assert names == {k for k in kv.state_dict() if k.startswith("layers.0.attn.")}
    assert {"layers.0.attn.gate_table.weight", "layers.0.attn.w_gate.weight"} <= names
