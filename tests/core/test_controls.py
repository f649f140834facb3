"""The study's control arms do what they claim (docs/study.md), each against its EG-MLA
counterpart, which must fail the same check (so the checks can fail):

- the constant gate has no token dependence;
- the value embedding adds to V (a term of the token id alone), it does not multiply; the K/V
  embedding adds to K and V; the V-only gate multiplies V and leaves K as MLA's;
- the hidden-state gate depends on the hidden state only;
- their KV bytes are what the cache holds (and what they claim relative to their counterparts).
"""

from __future__ import annotations

import pytest
import torch

from egmla.cache import ContiguousCache
from egmla.models import cache_spec_for
from egmla.presets import preset


def layer(name: str, impl: str = "naive", seed: int = 0):
    from support.models import build, with_attention

    model = build(with_attention(preset(name), impl=impl), seed=seed)
    return model, model.layers[0].attn


def inputs(model, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 10, model.config.d_model, generator=g, dtype=torch.float64)
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=g)
    return x, torch.arange(10).expand(2, 10), ids


@pytest.mark.parametrize("name, token_dependent", [("tiny-egmla", True),
                                                   ("tiny-egmla-const-gate", False)])
@pytest.mark.parametrize("impl", ["naive", "absorbed"])
def test_the_constant_gate_ignores_the_token_ids(name, token_dependent, impl):
    model, attn = layer(name, impl)
    x, positions, ids = inputs(model)
    other = (ids + 1) % model.config.vocab_size
    with torch.no_grad():
        a, b = attn(x, positions, None, ids), attn(x, positions, None, other)
    assert (not torch.equal(a, b)) == token_dependent
    if not token_dependent:  # the gate is one vector: the same for every position
        g = attn.gate(ids, x)
        assert torch.equal(g, g[:1, :1].expand_as(g))


@pytest.mark.parametrize("impl", ["naive", "absorbed"])
def test_the_constant_gate_on_the_latent_ignores_the_token_ids_and_decodes_as_it_forwards(impl):
    """`egmla_const_gate` with `gate_position: latent` (EGMLALatentConstGate): the one row gates
    the latent, so the layer and its cache (no token ids) are the same for any ids, and prefill
    + decode equal the full forward."""
    from support.models import build, random_ids, with_attention

    cfg = with_attention(preset("tiny-egmla-const-gate"), gate_position="latent", impl=impl)
    model = build(cfg)
    attn = model.layers[0].attn
    assert type(attn).__name__ == "EGMLALatentConstGate" and not attn.lookup_tables()
    assert model.cache_spec().sequence == {}  # no token ids cached
    x, positions, ids = inputs(model)
    with torch.no_grad():
        assert torch.equal(attn(x, positions, None, ids),
                           attn(x, positions, None, (ids + 1) % cfg.vocab_size))
        ids = random_ids(cfg, 2, 12)
        full = model(ids)
        cache = model.new_cache(batch_size=2, max_len=12)
        steps = [model(ids[:, :9], cache=cache)] + [model(ids[:, t:t + 1], cache=cache)
                                                    for t in range(9, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-10)


def expansions(name: str, seed: int):
    """The layer's K/V expanded from two random latents, each under the token ids and under
    other ids: the layer, ((k1, v1), (k1o, v1o)), ((k2, v2), (k2o, v2o)) and the ids."""
    model, attn = layer(name)
    g = torch.Generator().manual_seed(seed)
    c1, c2 = (torch.randn(2, 10, attn.d_c, generator=g, dtype=torch.float64) for _ in range(2))
    _, _, ids = inputs(model)
    other = (ids + 7) % model.config.vocab_size
    with torch.no_grad():
        return (attn, (attn.expand(c1, ids), attn.expand(c1, other)),
                (attn.expand(c2, ids), attn.expand(c2, other)), ids, other, g)


def test_the_value_embedding_adds_a_term_of_the_token_id_alone():
    _, ((k1, v1), (k1o, v1o)), ((k2, v2), (k2o, v2o)), ids, other, g = expansions(
        "tiny-mla-value-embed", 3)
    assert torch.equal(k1, k1o) and torch.equal(k2, k2o)  # keys carry no token identity
    assert not torch.allclose(v1, v1o)
    # additive: what the ids change in V does not depend on the latent
    torch.testing.assert_close(v1 - v1o, v2 - v2o, rtol=0, atol=1e-12)
    # and a multiplicative gate (EG-MLA kv) fails that same check
    gated_model, gated = layer("tiny-egmla")
    c = torch.randn(2, 2, 10, gated.d_c, generator=g, dtype=torch.float64)
    with torch.no_grad():
        d1 = gated.expand(c[0], ids)[1] - gated.expand(c[0], other)[1]
        d2 = gated.expand(c[1], ids)[1] - gated.expand(c[1], other)[1]
    assert not torch.allclose(d1, d2, atol=1e-6)


def test_the_kv_embedding_adds_to_keys_and_values_and_absorbs_exactly():
    """`mla_kv_embed`: what the ids change in K and in V does not depend on the latent (added,
    not multiplied), and its absorbed decode ([c, e, k_rope] against [W_UK^T q, W_KE^T q,
    q_rope]) equals the rebuild over a prefill and decode steps."""
    _, ((k1, v1), (k1o, v1o)), ((k2, v2), (k2o, v2o)), _, _, _ = expansions("tiny-mla-kv-embed", 5)
    assert not torch.allclose(k1, k1o) and not torch.allclose(v1, v1o)
    torch.testing.assert_close(k1 - k1o, k2 - k2o, rtol=0, atol=1e-12)
    torch.testing.assert_close(v1 - v1o, v2 - v2o, rtol=0, atol=1e-12)
    assert_decode_equals_forward("tiny-mla-kv-embed", "absorbed")
    assert_decode_equals_forward("tiny-mla-value-embed", "absorbed")  # the form it extends


def test_the_value_gate_multiplies_values_only():
    """`egmla_v_gate`: the keys are MLA's (no token identity), the values carry the ids
    multiplied (what they change depends on the latent), and decoding step by step (the
    rebuild) equals the full forward; an absorbed impl is refused by name."""
    from egmla.config import ConfigError
    from support.models import with_attention

    model, attn = layer("tiny-egmla-v-gate")
    g = torch.Generator().manual_seed(6)
    c1, c2 = (torch.randn(2, 10, attn.d_c, generator=g, dtype=torch.float64) for _ in range(2))
    _, _, ids = inputs(model)
    other = (ids + 7) % model.config.vocab_size
    with torch.no_grad():
        (k1, v1), (k1o, v1o) = attn.expand(c1, ids), attn.expand(c1, other)
        (_, v2), (_, v2o) = attn.expand(c2, ids), attn.expand(c2, other)
        k_mla = attn.wkv_b(c1).view(2, 10, attn.n_kv, -1)[..., :attn.d_nope]
    assert torch.equal(k1, k1o) and torch.equal(k1, k_mla)  # keys: MLA's, no token identity
    assert not torch.allclose(v1, v1o)
    assert not torch.allclose(v1 - v1o, v2 - v2o, atol=1e-6)  # multiplied, not added
    assert_decode_equals_forward("tiny-egmla-v-gate", "naive")
    with pytest.raises(ConfigError, match="impl"):
        with_attention(preset("tiny-egmla-v-gate"), impl="auto")


def assert_decode_equals_forward(name: str, impl: str) -> None:
    """A prefill of 6 tokens then one token a step through the cache equals the full forward."""
    from support.models import build, with_attention

    model = build(with_attention(preset(name), impl=impl), seed=1)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 12)
        steps = [model(ids[:, :6], cache=cache)]
        steps += [model(ids[:, t:t + 1], cache=cache) for t in range(6, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name, id_dependent", [("tiny-egmla-latent", True),
                                                ("tiny-egmla-hidden-gate", False)])
def test_the_hidden_gate_depends_on_the_hidden_state_only(name, id_dependent):
    model, attn = layer(name)
    x, positions, ids = inputs(model)
    other = (ids + 1) % model.config.vocab_size
    cos, sin = attn.rope.cos_sin(positions, x.dtype)
    with torch.no_grad():
        a = attn.cached_fields(x, ids, cos, sin, with_auxiliary=True)["c"]
        b = attn.cached_fields(x, other, cos, sin, with_auxiliary=True)["c"]
        moved = attn.cached_fields(x + 0.5, ids, cos, sin, with_auxiliary=True)["c"]
    assert (not torch.equal(a, b)) == id_dependent
    assert not torch.allclose(a, moved)
    if not id_dependent:  # the gate is sigmoid(W_G h): in (0, 1), and it is what scales c
        gate = torch.sigmoid(attn.w_gate(x))
        assert bool(((gate > 0) & (gate < 1)).all())
        c, _ = attn.wkv_a(x).split([attn.d_c, attn.d_rope], dim=-1)
        torch.testing.assert_close(a, attn.gate_norm(attn.kv_norm(c) * gate))


@pytest.mark.parametrize("control, counterpart, extra_bytes", [
    ("small-egmla-hidden-gate", "small-egmla-latent", 0),  # the same cache
    ("small-egmla-const-gate", "small-egmla", -4),  # no token ids (int32) to cache
    ("small-mla-value-embed", "small-mla-narrow", 4),  # MLA's cache plus the token ids
    ("small-mla-kv-embed", "small-mla-narrow", 4),
    ("small-egmla-v-gate", "small-mla-narrow", 4),  # the rebuild only: no norm statistics
])
def test_control_kv_bytes_are_allocated_and_relate_to_their_counterpart(control, counterpart,
                                                                        extra_bytes):
    sizes = {}
    for name in (control, counterpart):
        spec = cache_spec_for(preset(name))
        cache = ContiguousCache(spec, 1, 64, dtype=torch.bfloat16, device="cpu")
        assert cache.nbytes() == spec.bytes_per_token(torch.bfloat16) * 64  # measured == analytic
        sizes[name] = spec.bytes_per_token(torch.bfloat16)
    assert sizes[control] - sizes[counterpart] == extra_bytes


@pytest.mark.parametrize("name", ["tiny-egmla-const-gate", "tiny-egmla-hidden-gate",
                                  "tiny-mla-value-embed", "tiny-mla-kv-embed", "tiny-egmla-v-gate"])
def test_controls_refuse_the_exports_that_have_no_modeling_code_for_them(name, tmp_path):
    from egmla.export.hf import save_hf
    from egmla.export.native import NativeExportError, native_architecture

    model, _ = layer(name)
    with pytest.raises(ValueError, match="study control"):
        save_hf(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()  # nothing half-written
    with pytest.raises(NativeExportError, match="study control"):
        native_architecture(model.config)
