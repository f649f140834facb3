"""Backbone correctness against references: causality, prefill+decode == full forward,
absorbed == naive, parameter counts, and the building blocks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from egmla.config import MLAConfig, ModelConfig
from egmla.models import RMSNorm, Rotary, Transformer, apply_rope
from egmla.models.positions import Positions
from egmla.presets import PRESETS, preset
from support.models import VARIANTS, build, random_ids, with_attention


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_causality(name):
    """Changing token t changes no output before t, and does change the output at t."""
    cfg = VARIANTS[name]
    model, ids = build(cfg), random_ids(cfg, 2, 16)
    t = 9
    changed = ids.clone()
    changed[:, t] = (changed[:, t] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.equal(a[:, :t], b[:, :t])
    assert (a[:, t] - b[:, t]).abs().max() > 1e-6


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("k", [1, 5])
def test_prefill_then_decode_equals_full_forward(name, k):
    cfg = VARIANTS[name]
    model, ids = build(cfg), random_ids(cfg, 3, 20)
    T = ids.shape[1]
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(batch_size=3, max_len=T)
        steps = [model(ids[:, : T - k], cache=cache)]
        steps += [model(ids[:, t : t + 1], cache=cache) for t in range(T - k, T)]
    assert cache.length == T
    assert (torch.cat(steps, dim=1) - full).abs().max().item() < 1e-9


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_chunked_prefill_equals_full_forward(name):
    cfg = VARIANTS[name]
    model, ids = build(cfg), random_ids(cfg, 2, 17)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 17)
        chunks = [model(ids[:, s : s + 6], cache=cache) for s in range(0, 17, 6)]
    assert (torch.cat(chunks, dim=1) - full).abs().max().item() < 1e-9


def test_logits_at_picks_one_position_per_row():
    cfg = VARIANTS["egmla-kv"]
    model, ids = build(cfg), random_ids(cfg, 3, 11)
    at = torch.tensor([10, 0, 4])
    with torch.no_grad():
        full, picked = model(ids), model(ids, logits_at=at)
    assert picked.shape == (3, cfg.vocab_size)
    assert (picked - full[torch.arange(3), at]).abs().max().item() < 1e-12


@pytest.mark.parametrize("name", list(VARIANTS))
def test_repeated_cache_continues_each_copy_like_a_full_forward(name):
    """One prefill of a shared context, `cache.repeat(3)`, three continuations == three full
    forwards (how the lm-eval adapter scores the choices of one question)."""
    cfg = VARIANTS[name]
    model, context, tails = build(cfg), random_ids(cfg, 1, 7), random_ids(cfg, 3, 4)
    with torch.no_grad():
        cache = model.new_cache(1, 11)
        model(context, cache=cache)
        continued = model(tails, cache=cache.repeat(3))
        full = model(torch.cat([context.expand(3, -1), tails], dim=1))[:, 7:]
    assert cache.length == 7
    assert (continued - full).abs().max().item() < 1e-5


def test_logits_at_picks_several_positions_per_row():
    cfg = VARIANTS["mla-absorbed"]
    model, ids = build(cfg), random_ids(cfg, 2, 9)
    at = torch.tensor([[6, 7, 8], [0, 3, 3]])  # (B, K), repeats allowed (padding of short rows)
    with torch.no_grad():
        full, picked = model(ids), model(ids, logits_at=at)
    assert picked.shape == (2, 3, cfg.vocab_size)
    for b in range(2):
        assert (picked[b] - full[b, at[b]]).abs().max().item() < 1e-12


@pytest.mark.parametrize("base", ["tiny-mla", "tiny-egmla-latent", "tiny-egmla-const-gate",
                                  "tiny-egmla-hidden-gate", "tiny-mla-value-embed"])
def test_absorbed_equals_naive(base):
    """Same weights, two computations: full forward and cached decode agree in float64."""
    check_absorbed_equals_naive(preset(base))


LATENT_VARIANTS = sorted(n for n, c in VARIANTS.items() if isinstance(c.attention, MLAConfig))


@pytest.mark.parametrize("name", LATENT_VARIANTS)
def test_every_latent_variant_absorbed_equals_naive(name):
    """The converted forms too (grouped K/V, RoPE keys per KV head at chosen frequencies, no
    latent norm, d_nope 0, the residual gate): naive == absorbed."""
    check_absorbed_equals_naive(VARIANTS[name])


def check_absorbed_equals_naive(cfg):
    naive_cfg = with_attention(cfg, impl="naive")
    absorbed_cfg = with_attention(cfg, impl="absorbed")
    naive, absorbed = build(naive_cfg), Transformer(absorbed_cfg).double().eval()
    absorbed.load_state_dict(naive.state_dict())
    ids = random_ids(naive_cfg, 2, 12)
    with torch.no_grad():
        assert (naive(ids) - absorbed(ids)).abs().max().item() < 1e-12
        caches = [m.new_cache(2, 12) for m in (naive, absorbed)]
        for m, c in zip((naive, absorbed), caches):
            m(ids[:, :11], cache=c)
        step_naive = naive(ids[:, 11:], cache=caches[0])
        step_absorbed = absorbed(ids[:, 11:], cache=caches[1])
    assert (step_naive - step_absorbed).abs().max().item() < 1e-12


def test_auto_impl_uses_absorbed_for_decode_only():
    attn = build(preset("tiny-mla")).layers[0].attn
    assert attn._use_absorbed(1, 40, cached=True) and not attn._use_absorbed(4, 40, cached=True)
    assert not attn._use_absorbed(1, 40, cached=False)


def test_egmla_gate_changes_with_token_id_only():
    """The gate is a function of the token id: the kv-gated model differs from plain MLA
    with the same remaining weights, and equal ids give equal gates."""
    model = build(preset("tiny-egmla"))
    attn = model.layers[0].attn
    ids = torch.tensor([[3, 7, 3]])
    g = attn.gate(ids)
    assert torch.equal(g[0, 0], g[0, 2]) and not torch.equal(g[0, 0], g[0, 1])


def test_grouped_gate_tables_are_shared():
    cfg = with_attention(preset("tiny-egmla"), gate_group_size=2)
    model = build(cfg)
    assert model.layers[0].attn.gate_table is model.layers[1].attn.gate_table
    ungrouped = build(preset("tiny-egmla"))
    assert ungrouped.layers[0].attn.gate_table is not ungrouped.layers[1].attn.gate_table


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameter_count_analytic_equals_built(name):
    cfg = preset(name)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert model.num_params() == cfg.num_params()
    assert model.num_params(include_gate_tables=False) == cfg.num_params(include_gate_tables=False)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_parameter_count_variants_untied(name):
    cfg = dataclasses.replace(VARIANTS[name], tie_embeddings=False)
    model = Transformer(cfg)
    assert model.num_params() == cfg.num_params()
    assert model.lm_head.weight is not model.tok_emb.weight


def test_gate_tables_counted_separately():
    cfg = preset("paper-egmla-kv64")
    gate = cfg.num_params() - cfg.num_params(include_gate_tables=False)
    assert gate == 12 * 50257 * 256  # one table per layer: lookup-only parameters


def test_tied_embeddings_share_storage():
    model = build(preset("tiny-mha"))
    assert model.lm_head.weight is model.tok_emb.weight


def test_cache_overflow_is_a_clear_error():
    model = build(preset("tiny-mha"))
    cache = model.new_cache(1, 4)
    with pytest.raises(ValueError, match="cache full"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache)


@pytest.mark.parametrize("kind", ["mla", "egmla"])
def test_a_config_without_latent_norm_eps_computes_what_it_did(kind):
    """A config dict from before latent_norm_eps builds its latent norms (on c and on the
    low-rank query) at the model's norm_eps, as they were built then: the same logits, bit for
    bit, as the same weights with latent_norm_eps spelled as norm_eps. Set, the field reaches
    the latent norms and no other."""
    data = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "norm_eps": 3e-5,
            "attention": {"type": kind, "d_c": 16, "d_q": 24, "d_nope": 8, "d_rope": 8, "d_v": 8}}
    old = ModelConfig.from_dict(data)
    torch.manual_seed(0)
    model = Transformer(old).eval()

    def same_weights(cfg: ModelConfig) -> Transformer:
        other = Transformer(cfg).eval()
        other.load_state_dict(model.state_dict())
        return other

    def eps(m: Transformer) -> set[tuple[str, float]]:
        return {(name.rpartition(".")[2], mod.eps) for name, mod in m.named_modules()
                if isinstance(mod, RMSNorm)}

    assert old.attention.latent_norm_eps is None
    blocks = {("attn_norm", 3e-5), ("mlp_norm", 3e-5), ("norm", 3e-5)}
    assert eps(model) == blocks | {("q_norm", 3e-5), ("kv_norm", 3e-5)}
    ids = random_ids(old, 2, 12)
    with torch.no_grad():
        assert torch.equal(same_weights(with_attention(old, latent_norm_eps=3e-5))(ids), model(ids))
    deepseek = same_weights(with_attention(old, latent_norm_eps=1e-6))
    assert eps(deepseek) == blocks | {("q_norm", 1e-6), ("kv_norm", 1e-6)}


def test_rmsnorm_matches_formula():
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    norm = RMSNorm(8, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 8))
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * norm.weight
    assert torch.allclose(norm(x), expected, atol=1e-14)


def test_rmsnorm_in_bf16_normalizes_in_float32_then_scales_in_bf16():
    x = torch.randn(2, 3, 64).bfloat16()
    norm = RMSNorm(64).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 64))
        h = x.float()
        expected = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
        assert torch.equal(norm(x), expected)


def test_a_forward_computes_each_ropes_angles_once_and_keeps_nothing(monkeypatch):
    """The layers' rotaries are values (equal when their arguments are, frozen); a forward
    computes each one's angles once and hands them to every layer (Positions), and the next
    forward computes its own."""
    model = build(preset("tiny-mha"))
    rope = model.layers[0].attn.rope
    assert {block.attn.rope for block in model.layers} == {Rotary(rope.dim, rope.theta)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        rope.theta = 1.0
    calls = []
    cos_sin = Rotary.cos_sin
    monkeypatch.setattr(Rotary, "cos_sin", lambda self, *a: calls.append(self) or cos_sin(self, *a))
    ids = random_ids(preset("tiny-mha"), 2, 6)
    with torch.no_grad():
        model(ids)
        assert len(calls) == 1  # for the model's layers
        model(ids)
    assert len(calls) == 2  # one per forward: nothing was kept from the first
    positions = Positions(torch.arange(6)[None])
    first = positions.cos_sin(rope, torch.float32)
    assert positions.cos_sin(model.layers[1].attn.rope, torch.float32)[0] is first[0]
    moved = Positions(torch.arange(3, 9)[None]).cos_sin(rope, torch.float32)
    assert torch.allclose(moved[0], cos_sin(Rotary(rope.dim, rope.theta), torch.arange(3, 9)[None],
                                            torch.float32)[0])


def test_the_layers_of_a_cached_step_share_one_mask(monkeypatch):
    """With a cache, every layer attends over the same key positions: the mask is built once per
    forward (contiguous cache: one key_positions tensor per step)."""
    model = build(preset("tiny-gqa2"))
    built = []
    causal_mask = Positions.causal_mask

    def counted(self, key_positions, R=1):
        before = len(self._masks)
        mask = causal_mask(self, key_positions, R)
        built.append(len(self._masks) > before)
        return mask

    monkeypatch.setattr(Positions, "causal_mask", counted)
    ids = random_ids(preset("tiny-gqa2"), 2, 6)
    with torch.no_grad():
        cache = model.new_cache(batch_size=2, max_len=6)
        model(ids[:, :5], cache=cache)
        model(ids[:, 5:], cache=cache)
    assert len(built) == 2 * model.config.n_layers and sum(built) == 2


def test_a_positions_buffer_reused_in_inference_mode_never_gets_stale_angles():
    """Under torch.inference_mode (Lightning's validation) tensors keep no version counter; a
    caller that refills one positions buffer in place between forwards still gets each
    forward's own RoPE angles and mask: the forwards equal fresh ones."""
    model = build(preset("tiny-mha")).eval()
    ids = random_ids(preset("tiny-mha"), 2, 5)
    with torch.inference_mode():
        buffer = torch.arange(5)[None].expand(2, 5).clone()
        first = model(ids, buffer)
        buffer.add_(7)  # the same tensor, new positions
        shifted = model(ids, buffer)
        fresh = model(ids, torch.arange(7, 12)[None].expand(2, 5).clone())
    assert not torch.equal(first, fresh)  # (RoPE is relative: they differ by rounding only)
    assert torch.equal(shifted, fresh)  # a stale memo would give `first` bit for bit


def test_rope_depends_only_on_relative_position():
    """q_p . k_s after RoPE is unchanged when both positions shift by the same offset."""
    rope = Rotary(16, 10000.0)
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16, dtype=torch.float64)

    def score(p: int, s: int) -> torch.Tensor:
        cq, sq = rope.cos_sin(torch.tensor([[p]]), torch.float64)
        ck, sk = rope.cos_sin(torch.tensor([[s]]), torch.float64)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    assert torch.allclose(score(7, 3), score(107, 103), atol=1e-10)
    assert not torch.allclose(score(7, 3), score(7, 4), atol=1e-6)
    cos, sin = rope.cos_sin(torch.tensor([[0]]), torch.float64)
    assert torch.equal(apply_rope(q, cos, sin), q)  # position 0 is the identity


def test_rope_with_chosen_frequencies_rotates_each_head_at_them():
    """Per-head frequency indices j of a wider head's spectrum: pair i of head h turns by
    position * theta^(-2 j / spectrum), j = freqs[h][i] (a hand-written rotation)."""
    freqs, theta, spectrum = ((0, 5, 9), (2, 3, 11)), 500.0, 24
    rope = Rotary(6, theta, freqs, spectrum)
    positions = torch.tensor([[0, 3, 17]])
    x = torch.randn(1, 3, 4, 6, dtype=torch.float64)  # 4 heads: 0, 1 read key 0; 2, 3 key 1
    out = apply_rope(x, *rope.cos_sin(positions, torch.float64))
    for h in range(4):
        for i, j in enumerate(freqs[h // 2]):
            angle = positions[0].double() * theta ** (-2 * j / spectrum)
            a, b = x[0, :, h, i], x[0, :, h, i + 3]
            assert torch.allclose(out[0, :, h, i], a * angle.cos() - b * angle.sin())
            assert torch.allclose(out[0, :, h, i + 3], b * angle.cos() + a * angle.sin())


def test_rope_with_the_standard_frequencies_chosen_equals_plain_rope_bit_for_bit():
    positions = torch.arange(40)[None]
    plain = Rotary(8, 10000.0).cos_sin(positions, torch.float32)
    chosen = Rotary(8, 10000.0, ((0, 1, 2, 3),), spectrum=8).cos_sin(positions, torch.float32)
    for a, b in zip(plain, chosen):
        assert torch.equal(a, b[:, :, 0])


def test_rope_survives_bf16_model_cast():
    """`model.to(bfloat16)` must not quantize the RoPE frequencies (they are not buffers)."""
    model = build(preset("tiny-mha"), dtype=torch.bfloat16)
    assert not list(model.buffers())
    ids = random_ids(preset("tiny-mha"), 1, 8)
    assert torch.isfinite(model(ids).float()).all()


def test_training_step_reduces_loss():
    """Gradients flow through every variant's parameters, including the gate tables."""
    for name in ("mha", "mla-naive", "egmla-kv", "egmla-latent-naive"):
        cfg = VARIANTS[name]
        model = build(cfg, dtype=torch.float32).train()
        ids = random_ids(cfg, 4, 16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(5):
            logits = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            losses.append(loss.item())
            opt.step()
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        assert not missing, f"{name}: no gradient for {missing}"
        assert losses[-1] < losses[0], f"{name}: {losses}"


def test_masked_attention_takes_sdpa_output_in_any_memory_layout(monkeypatch):
    """On an H200, SDPA returned the grouped (B, G, R*T, Dv) output laid out as (B, R*T, G, Dv)
    and `attend` failed every step with a view error; the result must not depend on layout."""
    import torch.nn.functional as F

    from egmla.models.attention import common

    g = torch.Generator().manual_seed(0)
    B, T, S, H, G, D = 2, 3, 7, 6, 2, 8
    q, k, v = (torch.randn(B, n, h, D, generator=g) for n, h in ((T, H), (S, G), (S, G)))
    positions = torch.arange(S - T, S).expand(B, T)
    key_positions = torch.arange(S).expand(B, S)
    want = common.attend(q, k, v, D**-0.5, positions, key_positions)
    sdpa = F.scaled_dot_product_attention

    def transposed_in_memory(*args, **kwargs):  # the same values, CUDA's layout
        out = sdpa(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(common.F, "scaled_dot_product_attention", transposed_in_memory)
    got = common.attend(q, k, v, D**-0.5, positions, key_positions)
    assert torch.equal(got, want)
