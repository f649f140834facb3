"""KV bytes: the analytic spec, the bytes actually allocated, and a hand-written formula agree."""

from __future__ import annotations

import pytest
import torch

from egmla.cache import CacheSpec, ContiguousCache, FieldSpec
from egmla.config import (EGMLAConfig, EGMLAConstGateConfig, MHAConfig, MLAValueEmbedConfig,
                          ModelConfig)
from egmla.models import Transformer, cache_spec_for
from egmla.presets import PRESETS, preset

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def hand_formula(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """KV bytes per token written out per variant, independent of cache_spec()."""
    a, L, b = cfg.attention, cfg.n_layers, dtype.itemsize
    if isinstance(a, MHAConfig):
        n_kv = a.n_kv_heads or cfg.n_heads
        head_dim = a.head_dim or cfg.d_model // cfg.n_heads
        return L * 2 * n_kv * head_dim * b  # K and V
    per_layer = (a.d_c + a.d_rope) * b  # latent + shared RoPE key
    kv_gate = isinstance(a, EGMLAConfig) and a.gate_position == "kv"
    # int32 token ids, once: the token gate on K/V reads its keys' ids, as does the value embedding
    reads_ids = kv_gate and not isinstance(a, EGMLAConstGateConfig) or isinstance(a, MLAValueEmbedConfig)
    ids = 4 if reads_ids else 0
    if kv_gate and a.impl != "naive":  # the gate norm's statistics for the absorbed decode
        stats = {"layernorm": 2, "rmsnorm": 1, "none": 0}[a.gate_norm]
        per_layer += stats * torch.promote_types(dtype, torch.float32).itemsize
    return L * per_layer + ids


@pytest.mark.parametrize("name", sorted(n for n in PRESETS if not n.startswith("paper")))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_analytic_equals_allocated_equals_formula(name, dtype):
    cfg = preset(name)
    model = Transformer(cfg)
    spec = model.cache_spec()
    cache = ContiguousCache(spec, batch_size=3, max_len=40, dtype=dtype)
    measured = cache.nbytes() / (3 * 40)
    assert measured == spec.bytes_per_token(dtype) == hand_formula(cfg, dtype)


@pytest.mark.parametrize("name", [n for n in PRESETS if n.startswith("paper")])
def test_paper_presets_allocated(name):
    cfg = preset(name)
    spec = cache_spec_for(cfg)
    cache = ContiguousCache(spec, batch_size=1, max_len=16, dtype=torch.bfloat16)
    assert cache.nbytes() == 16 * spec.bytes_per_token(torch.bfloat16) == 16 * hand_formula(
        cfg, torch.bfloat16
    )


def test_paper_elements_per_token():
    elements = {n: cache_spec_for(preset(n)).elements_per_token() for n in PRESETS if "paper" in n}
    assert elements == {
        "paper-mha": 18432,
        "paper-gqa4": 6144,
        "paper-mla": 3840,
        "paper-egmla-kv256": 3840,
        "paper-egmla-kv64": 1536,
        "paper-egmla-kv16": 960,
        "paper-egmla-latent64": 1536,
    }


def test_cache_holds_what_the_layers_wrote():
    """The allocated fields are the ones the forward pass fills: after a prefill, every
    field's first T positions are non-zero and the rest are still zero."""
    for name in ("tiny-mha", "tiny-mla", "tiny-egmla"):
        cfg = preset(name)
        model = Transformer(cfg).eval()
        cache = model.new_cache(2, 10)
        ids = torch.randint(1, cfg.vocab_size, (2, 6))
        with torch.no_grad():
            model(ids, cache=cache)
        for layer in cache.layers:
            for t in layer.values():
                assert t[:, :6].abs().sum(dim=tuple(range(2, t.dim())) or None).ne(0).all()
                assert t[:, 6:].eq(0).all()
        if cache.sequence:
            assert torch.equal(cache.sequence["token_ids"][:, :6].long(), ids)


def test_token_ids_only_cached_for_kv_gate():
    assert cache_spec_for(preset("tiny-egmla")).sequence == {"token_ids": FieldSpec((), torch.int32)}
    assert cache_spec_for(preset("tiny-egmla-latent")).sequence == {}
    assert cache_spec_for(preset("tiny-mla")).sequence == {}


def test_spec_arithmetic():
    spec = CacheSpec(
        layers=({"a": FieldSpec((2, 3))}, {"a": FieldSpec((2, 3)), "b": FieldSpec((4,))}),
        sequence={"ids": FieldSpec((), torch.int32)},
    )
    assert spec.elements_per_token() == 16
    assert spec.bytes_per_token(torch.bfloat16) == 16 * 2 + 4


def test_bad_batch_is_rejected():
    model = Transformer(preset("tiny-mla"))
    cache = model.new_cache(2, 8)
    with pytest.raises(ValueError, match="batch of 3 sequences"):
        model(torch.zeros(3, 2, dtype=torch.long), cache=cache)


def test_both_caches_implement_the_written_contract():
    """ContiguousCache and serve's PagedStep satisfy egmla.cache's protocols (the model is
    annotated against these, not against either class)."""
    from egmla.cache import CacheStep, LayerView
    from serve.paged_cache import PagedKVCache

    spec = cache_spec_for(preset("tiny-egmla"))
    contiguous = ContiguousCache(spec, batch_size=1, max_len=8)
    paged = PagedKVCache(spec, num_blocks=4, block_size=4).step([[0, 1]], [0], [3])
    for step in (contiguous, paged):
        assert isinstance(step, CacheStep) and isinstance(step.layer(0), LayerView)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_every_per_sequence_field_of_the_spec_is_written_or_refused(kind):
    """The per-sequence fields are written by iterating the spec: a second field is stored like
    the first, and a field the step does not give is an error naming it (never left unwritten)."""
    from serve.paged_cache import PagedKVCache

    spec = CacheSpec(layers=({"c": FieldSpec((2,))},),
                     sequence={"token_ids": FieldSpec((), torch.int32),
                               "segment": FieldSpec((), torch.int32)})
    step = (ContiguousCache(spec, batch_size=1, max_len=8) if kind == "contiguous"
            else PagedKVCache(spec, num_blocks=2, block_size=4).step([[1]], [0], [3]))
    ids, segments = torch.tensor([[5, 6, 7]]), torch.tensor([[1, 1, 2]])
    step.begin({"token_ids": ids, "segment": segments}, torch.arange(3)[None])
    assert step.layer(0).sequence_field("segment").tolist() == [[1, 1, 2]]
    assert step.layer(0).sequence_field("token_ids").tolist() == [[5, 6, 7]]
    with pytest.raises(KeyError, match="'segment'"):
        step.begin({"token_ids": ids}, torch.arange(3)[None])
