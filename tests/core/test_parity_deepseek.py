"""Dense DeepSeek-V3 weights in egmla's MLA compute what transformers' DeepseekV3ForCausalLM does,
through both MLA computations (naive and absorbed)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import transformers

from egmla.generate import generate
from egmla.imports import (
    ConversionError,
    config_from_deepseek_v3,
    from_deepseek_v3,
    load_pretrained,
    state_dict_from_deepseek_v3,
)
from egmla.models import Transformer

VOCAB = 128
TOL = 1e-4  # float32


def tiny_config(q_lora_rank: int | None = None, **overrides) -> transformers.DeepseekV3Config:
    """Two dense layers (first_k_dense_replace = num_hidden_layers: no MoE layer is built).

    initializer_range 0.2 makes attention sharp enough that a wrong RoPE layout moves the logits
    by whole units (checked below), far above the tolerance.
    """
    fields = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=q_lora_rank,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=2,
        n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2,
        max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rope_interleave=True,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    return transformers.DeepseekV3Config(**{**fields, **overrides})


def tiny_deepseek(q_lora_rank: int | None = None, **overrides) -> Any:
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(tiny_config(q_lora_rank, **overrides)).eval()


def with_impl(model: Transformer, impl: str) -> Transformer:
    """The same weights under another MLA computation."""
    attention = dataclasses.replace(model.config.attention, impl=impl)
    other = Transformer(dataclasses.replace(model.config, attention=attention)).eval()
    other.load_state_dict(model.state_dict())
    return other


def input_ids(T: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("impl", ["naive", "absorbed"])
@pytest.mark.parametrize("q_lora_rank", [None, 24], ids=["full-q", "lora-q"])
def test_logits_match(q_lora_rank, impl):
    hf = tiny_deepseek(q_lora_rank)
    ours = with_impl(from_deepseek_v3(hf), impl)
    ids = input_ids()
    with torch.no_grad():
        expected, got = hf(ids).logits, ours(ids)
    assert expected.abs().max() > 1.0
    assert (got - expected).abs().max().item() < TOL


def test_non_interleaved_rope_needs_no_permutation():
    hf = tiny_deepseek(24, rope_interleave=False)
    ids = input_ids()
    with torch.no_grad():
        assert (from_deepseek_v3(hf)(ids) - hf(ids).logits).abs().max().item() < TOL


def test_the_rope_permutation_is_what_makes_them_agree():
    """Control: the same interleaved weights without de-interleaving give different logits."""
    hf = tiny_deepseek(24)
    config = config_from_deepseek_v3(hf.config)
    wrong = Transformer(config).eval()
    weights = state_dict_from_deepseek_v3(hf.state_dict(), config, rope_interleave=False)
    wrong.load_state_dict(weights)
    ids = input_ids()
    with torch.no_grad():
        assert (wrong(ids) - hf(ids).logits).abs().max().item() > 0.1


@pytest.mark.parametrize("q_lora_rank", [None, 24], ids=["full-q", "lora-q"])
def test_greedy_generation_matches(q_lora_rank):
    """Ours decodes with the absorbed computation over the latent cache (impl auto)."""
    hf = tiny_deepseek(q_lora_rank)
    ours = from_deepseek_v3(hf)
    prompt = input_ids(6)
    with torch.no_grad():
        expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                               max_new_tokens=16)
    assert torch.equal(generate(ours, prompt, 16, eos_token_id=ours.config.eos_token_id), expected)


def test_config_fields_are_carried_over():
    config = config_from_deepseek_v3(tiny_config(24))
    a = config.attention
    assert (a.type, a.d_c, a.d_q, a.d_nope, a.d_rope, a.d_v) == ("mla", 16, 24, 8, 8, 12)
    assert (config.d_model, config.n_layers, config.n_heads, config.d_ff) == (64, 2, 4, 96)
    assert (config.norm_eps, config.tie_embeddings, config.eos_token_id) == (1e-6, False, 1)
    assert a.latent_norm_eps == 1e-6  # what transformers computes its latent norms with


def test_another_rms_norm_eps_converts_with_the_latent_norms_at_1e_6():
    """transformers' DeepSeek-V3 builds its block norms with rms_norm_eps and its latent norms
    (q_a_layernorm, kv_a_layernorm) with 1e-6 whatever it says; egmla's config spells both.
    Inputs scaled down to where the eps matters: the latent norms at rms_norm_eps (a config
    without latent_norm_eps) would be off by whole units."""
    hf = tiny_deepseek(24, rms_norm_eps=1e-4)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(0.01)
        for layer in hf.model.layers:
            layer.self_attn.q_a_proj.weight.mul_(1e-3)
            layer.self_attn.kv_a_proj_with_mqa.weight[:16].mul_(1e-3)  # the latent rows
    ours = from_deepseek_v3(hf)
    assert (ours.config.norm_eps, ours.config.attention.latent_norm_eps) == (1e-4, 1e-6)
    without = dataclasses.replace(ours.config.attention, latent_norm_eps=None)
    control = Transformer(dataclasses.replace(ours.config, attention=without)).eval()
    control.load_state_dict(ours.state_dict())
    ids = input_ids()
    with torch.no_grad():
        theirs = hf(ids).logits
        assert theirs.abs().max() > 1.0
        assert (ours(ids) - theirs).abs().max().item() < TOL
        assert (control(ids) - theirs).abs().max().item() > 0.5


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"first_k_dense_replace": 1}, "mixture-of-experts"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                              "original_max_position_embeddings": 32}}, "rope scaling 'yarn'"),
    ],
)
def test_unsupported_features_are_refused(overrides, match):
    config = tiny_config()
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(ConversionError, match=match):
        config_from_deepseek_v3(config)


def test_moe_weights_are_refused():
    hf = tiny_deepseek()
    config = config_from_deepseek_v3(hf.config)
    weights = {**hf.state_dict(), "model.layers.1.mlp.experts.down_proj": torch.zeros(1)}
    with pytest.raises(ConversionError, match="mixture-of-experts"):
        state_dict_from_deepseek_v3(weights, config)


def test_load_pretrained_reads_a_transformers_directory(tmp_path):
    hf = tiny_deepseek(24)
    hf.save_pretrained(tmp_path / "hf")
    ids = input_ids()
    model, _ = load_pretrained(tmp_path / "hf")
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() < TOL
