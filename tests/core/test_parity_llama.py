"""Llama weights in egmla's MHA backbone compute what transformers' LlamaForCausalLM computes."""

from __future__ import annotations

import pytest
import torch
import transformers

from egmla.checkpoint import save_export
from egmla.generate import generate
from egmla.imports import (
    ConversionError,
    config_from_llama,
    from_llama,
    load_pretrained,
)

VOCAB = 128
TOL = 1e-4  # float32


def tiny_llama(n_kv_heads: int = 4, tie: bool = True, **overrides) -> transformers.LlamaForCausalLM:
    """A seeded random Llama. initializer_range 0.2 (not 0.02) makes attention sharp, so a wrong
    head layout or RoPE shows up as a large logit difference, not one hidden under 1e-4."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=n_kv_heads, tie_word_embeddings=tie,
        max_position_embeddings=128, initializer_range=0.2, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=1, eos_token_id=2, pad_token_id=2, **overrides,
    )
    return transformers.LlamaForCausalLM(config).eval()


CASES = {"mha-tied": (4, True), "mha-untied": (4, False), "gqa2-tied": (2, True),
         "gqa2-untied": (2, False)}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match(case):
    hf = tiny_llama(*CASES[case])
    ours = from_llama(hf)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = hf(ids).logits, ours(ids)
    assert expected.abs().max() > 1.0  # logits large enough for the tolerance to mean something
    assert (got - expected).abs().max().item() < TOL


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_generation_matches(case):
    hf = tiny_llama(*CASES[case])
    ours = from_llama(hf)
    prompt = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                               max_new_tokens=16)
    got = generate(ours, prompt, 16, eos_token_id=ours.config.eos_token_id)
    assert torch.equal(got, expected)


def test_config_fields_are_carried_over():
    hf = tiny_llama(2, False, head_dim=32)  # head_dim != hidden / heads, as some Llamas have
    config = config_from_llama(hf.config)
    assert (config.d_model, config.n_layers, config.n_heads, config.d_ff) == (64, 2, 4, 96)
    assert (config.attention.n_kv_heads, config.attention.head_dim) == (2, 32)
    assert (config.bos_token_id, config.eos_token_id, config.max_seq_len) == (1, 2, 128)
    assert not config.tie_embeddings and config.norm_eps == 1e-5
    ids = torch.randint(0, VOCAB, (1, 10))
    with torch.no_grad():
        assert (from_llama(hf)(ids) - hf(ids).logits).abs().max().item() < TOL


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
         "rope scaling 'linear'"),
    ],
)
def test_unsupported_features_are_refused(overrides, match):
    config = tiny_llama().config
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(ConversionError, match=match):
        config_from_llama(config)


def test_load_pretrained_reads_a_transformers_directory_and_an_export(tmp_path):
    hf = tiny_llama(2, False)
    hf.save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        expected = hf(ids).logits
    model, tokenizer = load_pretrained(tmp_path / "hf")
    assert tokenizer is None  # the directory holds weights only
    with torch.no_grad():
        assert (model(ids) - expected).abs().max().item() < TOL
    save_export(model, tmp_path / "export")
    again, _ = load_pretrained(str(tmp_path / "export"), dtype=torch.float64)
    assert again.tok_emb.weight.dtype == torch.float64
    with torch.no_grad():
        assert (again(ids).float() - expected).abs().max().item() < TOL
