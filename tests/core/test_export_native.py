"""Native exports load in transformers' own LlamaForCausalLM / DeepseekV3ForCausalLM (no remote
code) and compute what the egmla model computes; they convert back bit for bit."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import transformers

from egmla.config import EGMLAConfig, MHAConfig, MLAConfig, ModelConfig
from egmla.export.native import (
    NativeExportError,
    interleave_order,
    native_architecture,
    native_config,
    native_state_dict,
)
from egmla.generate import generate
from egmla.imports import config_from_deepseek_v3, config_from_llama, deinterleave_order, load_pretrained
from egmla.models import Transformer
from egmla.models.layers import RMSNorm

VOCAB = 256
TOL = 1e-4  # float32
NEW_TOKENS = 32


def mla(**fields: Any) -> MLAConfig:
    """MLA as configs/model/attention/mla.yaml builds it: the latent norms at DeepSeek's eps 1e-6,
    the block norms at egmla's norm_eps 1e-5 (which the native export writes as rms_norm_eps)."""
    return MLAConfig(**{"latent_norm_eps": 1e-6, **fields})


# name -> (attention, tie_embeddings[, ffn])
CASES: dict[str, tuple] = {
    "mha-tied": (MHAConfig(), True),
    "mha-untied": (MHAConfig(), False),
    "gqa2-tied": (MHAConfig(n_kv_heads=2), True),
    "gqa2-untied": (MHAConfig(n_kv_heads=2), False),
    "mla-full-q-tied": (mla(d_c=16, d_nope=8, d_rope=8, d_v=12), True),
    "mla-lora-q-untied": (mla(d_c=16, d_q=24, d_nope=8, d_rope=8, d_v=12), False),
    "gqa2-reglu-tied": (MHAConfig(n_kv_heads=2), True, "reglu"),  # hidden_act "relu"
    "mla-reglu-untied": (mla(d_c=16, d_nope=8, d_rope=8, d_v=12), False, "reglu"),
}
NATIVE_CLASS = {"mha": transformers.LlamaForCausalLM, "mla": transformers.DeepseekV3ForCausalLM}


def tiny_config(attention: Any, tie: bool, **overrides: Any) -> ModelConfig:
    fields: dict[str, Any] = {
        "vocab_size": VOCAB, "d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 96,
        "max_seq_len": 128, "attention": attention, "tie_embeddings": tie, "init_std": 0.2,
        # No EOS: both sides then generate all NEW_TOKENS, so the whole continuation is compared.
        "bos_token_id": 0, "eos_token_id": None,
    }
    return ModelConfig(**{**fields, **overrides})


def tiny_model(attention: Any, tie: bool, ffn: str = "swiglu", **overrides: Any) -> Transformer:
    """A seeded random model. init_std 0.2 makes attention sharp, so a wrong head or RoPE layout
    moves the logits by whole units; norm weights away from 1 catch a mis-mapped norm."""
    torch.manual_seed(0)
    model = Transformer(tiny_config(attention, tie, ffn=ffn, **overrides)).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.add_(0.5 * torch.randn_like(module.weight))
    return model


def write_native(model: Transformer, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = native_config(model.config, torch.float32)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    safetensors.torch.save_file(native_state_dict(model), str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """case -> (egmla model, export directory, transformers model loaded from it, loading info)."""
    made: dict[str, tuple[Transformer, Path, Any, dict]] = {}

    def get(case: str):
        if case not in made:
            model = tiny_model(*CASES[case])
            directory = write_native(model, tmp_path_factory.mktemp(case))
            hf, info = transformers.AutoModelForCausalLM.from_pretrained(
                directory, output_loading_info=True
            )
            made[case] = (model, directory, hf.eval(), info)
        return made[case]

    return get


def input_ids(T: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_loads_as_the_native_class_with_every_weight(case, exported):
    model, _, hf, info = exported(case)
    assert type(hf) is NATIVE_CLASS[model.config.attention.type]
    assert {k: v for k, v in info.items() if v} == {}  # nothing missing, unexpected, mismatched
    assert hf.dtype == torch.float32
    names = {name for name, _ in hf.named_parameters()}
    assert not any(".mlp.experts" in n or ".mlp.gate." in n for n in names)  # all layers dense
    tied = hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    assert tied == model.config.tie_embeddings


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match(case, exported):
    model, _, hf, _ = exported(case)
    ids = input_ids(24, seed=1)
    with torch.no_grad():
        expected, got = model(ids), hf(ids).logits
    assert expected.abs().max() > 1.0  # large enough for the tolerance to mean something
    assert (got - expected).abs().max().item() < TOL


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_generation_matches(case, exported):
    """egmla decodes over its own cache (MLA: absorbed); transformers over its DynamicCache."""
    model, _, hf, _ = exported(case)
    prompt = input_ids(6, seed=2)
    expected = generate(model, prompt, NEW_TOKENS)
    with torch.no_grad():
        got = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                          max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    assert got.shape == (2, 6 + NEW_TOKENS)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_is_bit_identical(case, exported):
    model, directory, _, _ = exported(case)
    back, _ = load_pretrained(directory)
    assert back.config == dataclasses.replace(model.config, init_std=back.config.init_std)
    original, loaded = model.state_dict(), back.state_dict()
    assert loaded.keys() == original.keys()
    for key, tensor in original.items():
        assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), key


@pytest.mark.parametrize("case", ["mha-untied", "mla-lora-q-untied"])
def test_config_is_what_transformers_itself_writes(case, exported, tmp_path):
    """Every field transformers writes for the loaded model has our value, and we write nothing
    else except the 4.x spellings (rope_theta, torch_dtype) kept for older readers."""
    model, _, hf, _ = exported(case)
    ours = native_config(model.config, torch.float32)
    hf.config.save_pretrained(tmp_path)
    theirs = json.loads((tmp_path / "config.json").read_text())
    theirs.pop("transformers_version")
    assert set(ours) - set(theirs) == {"rope_theta", "torch_dtype"}
    assert {k: ours.get(k, "<absent>") for k in theirs} == theirs


CONFIG_CASES = {
    "llama-head-dim-gqa": tiny_config(
        MHAConfig(n_kv_heads=1, head_dim=32), False, rope_theta=500000.0, max_seq_len=512,
        bos_token_id=1, eos_token_id=2,
    ),
    "llama-defaults": tiny_config(MHAConfig(), True, bos_token_id=None),
    "llama-reglu": tiny_config(MHAConfig(n_kv_heads=2), True, ffn="reglu"),
    "deepseek-lora-q": tiny_config(
        mla(d_c=32, d_q=48, d_nope=16, d_rope=4, d_v=8, impl="absorbed"), True,
        rope_theta=50000.0, eos_token_id=7,
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_config_converts_back_to_the_same_model_config(case, tmp_path):
    config = CONFIG_CASES[case]
    (tmp_path / "config.json").write_text(json.dumps(native_config(config, torch.bfloat16)))
    hf_config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert hf_config.dtype == torch.bfloat16
    to_config = config_from_llama if hf_config.model_type == "llama" else config_from_deepseek_v3
    back = to_config(hf_config)
    # impl is an egmla compute choice and init_std is not read back; everything else must match.
    attention = config.attention
    if isinstance(attention, MLAConfig):
        attention = dataclasses.replace(attention, impl=back.attention.impl)
    assert back == dataclasses.replace(config, attention=attention, init_std=back.init_std)


@pytest.mark.parametrize("case", ["mha-tied", "mla-full-q-tied"])
def test_tied_head_is_omitted_for_llama_and_copied_for_deepseek(case):
    """vLLM's Llama ties lm_head back; its DeepSeek model never ties, so it needs the tensor."""
    model = tiny_model(*CASES[case])
    weights = native_state_dict(model)
    storages = [w.untyped_storage().data_ptr() for w in weights.values()]
    assert len(set(storages)) == len(storages)  # nothing shared: safetensors accepts them
    if case.startswith("mha"):
        assert "lm_head.weight" not in weights
    else:
        head, embedding = weights["lm_head.weight"], weights["model.embed_tokens.weight"]
        assert torch.equal(head, embedding) and head.data_ptr() != embedding.data_ptr()


def test_interleave_is_the_inverse_of_the_import_deinterleave():
    for r in (2, 8, 64):
        forward, backward = deinterleave_order(r), interleave_order(r)
        assert torch.equal(forward[backward], torch.arange(r))
        assert torch.equal(backward[forward], torch.arange(r))
    assert interleave_order(8).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_egmla_is_refused_naming_the_gate():
    config = tiny_config(EGMLAConfig(d_c=16, d_nope=8, d_rope=8, d_v=12, d_e=16), False)
    for call in (lambda: native_architecture(config), lambda: native_config(config, torch.float32)):
        with pytest.raises(NativeExportError, match="embedding gate.*--format hf"):
            call()
    torch.manual_seed(0)
    with pytest.raises(NativeExportError, match="embedding gate"):
        native_state_dict(Transformer(config))


@pytest.mark.parametrize("ffn", ["drelu", "relu2"])
@pytest.mark.parametrize("attention", [MHAConfig(), mla(d_c=16, d_nope=8, d_rope=8, d_v=12)])
def test_an_mlp_with_no_hidden_act_is_refused_naming_it(ffn, attention):
    config = tiny_config(attention, False, ffn=ffn)
    with pytest.raises(NativeExportError, match=f"ffn='{ffn}'.*--format hf"):
        native_config(config, torch.float32)


@pytest.mark.parametrize("latent, norm_eps, named", [
    (None, 1e-5, r"attention\.latent_norm_eps=null \(so norm_eps=1e-05 applies\).*"
                 r"\+model\.attention\.latent_norm_eps=1e-06"),
    (1e-5, 1e-6, r"attention\.latent_norm_eps=1e-05: .* model\.attention\.latent_norm_eps=1e-06"),
], ids=["null-at-1e-5", "set-to-1e-5"])
def test_mla_whose_latent_norms_use_another_eps_is_refused_naming_the_setting(
        latent, norm_eps, named):
    """A config from before latent_norm_eps (null: norm_eps) at egmla's norm_eps 1e-5, or one
    that sets another latent eps: transformers would compute its latent norms at 1e-6."""
    attention = MLAConfig(d_c=16, d_nope=8, d_rope=8, d_v=12, latent_norm_eps=latent)
    config = tiny_config(attention, False, norm_eps=norm_eps)
    for call in (lambda: native_architecture(config), lambda: native_config(config, torch.float32)):
        with pytest.raises(NativeExportError, match=named) as err:
            call()
        assert "\n" not in str(err.value) and "--format hf" in str(err.value)


def test_the_form_from_before_latent_norm_eps_at_norm_eps_1e_6_still_exports(tmp_path):
    """latent_norm_eps null with norm_eps 1e-6 (how an MLA exported natively before the field):
    transformers computes it, and it imports back with the latent eps spelled out."""
    model = tiny_model(MLAConfig(d_c=16, d_q=24, d_nope=8, d_rope=8, d_v=12), False,
                       norm_eps=1e-6)
    directory = write_native(model, tmp_path / "native")
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = input_ids(24, seed=1)
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)).abs().max().item() < TOL
    back, _ = load_pretrained(directory)
    assert (back.config.norm_eps, back.config.attention.latent_norm_eps) == (1e-6, 1e-6)


def where_eps_matters(model: Transformer) -> Transformer:
    """Scale the embeddings and the latent projections (W_DQ, W_DKV) down until the inputs of
    the block norms and of the latent norms have mean squares near 1e-6..1e-5, where a norm's
    eps moves its output by a large fraction."""
    a = model.config.attention
    with torch.no_grad():
        model.tok_emb.weight.mul_(0.01)
        for layer in model.layers:
            layer.attn.wq_a.weight.mul_(1e-3)
            layer.attn.wkv_a.weight[: a.d_c].mul_(1e-3)  # the latent rows, not the RoPE key's
    return model


def same_weights(model: Transformer, **changes: Any) -> Transformer:
    other = Transformer(dataclasses.replace(model.config, **changes)).eval()
    other.load_state_dict(model.state_dict())
    return other


def test_each_norm_reaches_transformers_at_its_own_eps(tmp_path):
    """The block norms at norm_eps (written as rms_norm_eps) and the latent norms at
    latent_norm_eps (the 1e-6 transformers' DeepSeek-V3 fixes), where the eps matters: the same
    weights with either norm at the other eps (the controls) are off by whole units."""
    model = where_eps_matters(tiny_model(mla(d_c=16, d_q=24, d_nope=8, d_rope=8, d_v=12), False))
    assert (model.config.norm_eps, model.config.attention.latent_norm_eps) == (1e-5, 1e-6)
    hf = transformers.AutoModelForCausalLM.from_pretrained(write_native(model, tmp_path)).eval()
    assert json.loads((tmp_path / "config.json").read_text())["rms_norm_eps"] == 1e-5
    ids = input_ids(24, seed=1)
    with torch.no_grad():
        theirs = hf(ids).logits
        assert theirs.abs().max() > 1.0
        assert (model(ids) - theirs).abs().max().item() < TOL
        latent_at_norm_eps = dataclasses.replace(model.config.attention, latent_norm_eps=None)
        for control in (same_weights(model, attention=latent_at_norm_eps),
                        same_weights(model, norm_eps=1e-6)):
            assert (control(ids) - theirs).abs().max().item() > 0.5


def test_mha_with_indivisible_d_model_is_refused():
    config = tiny_config(MHAConfig(head_dim=16), False, d_model=66)
    with pytest.raises(NativeExportError, match="d_model=66 is not divisible by n_heads=4"):
        native_config(config, torch.float32)


def test_a_non_float_dtype_is_refused():
    with pytest.raises(NativeExportError, match="floating-point"):
        native_config(tiny_config(MHAConfig(), True), torch.int8)


# A converted GQA model's forms of MLA (egmla.upcycle): DeepSeek-V3 holds none of them, and the
# refusal names the option. Each case sets one option off its default.
CONVERTED_FORMS = {
    "latent_norm=False": {"latent_norm": False},
    "n_kv_heads=2": {"n_kv_heads": 2},
    "rope_heads=2": {"rope_heads": 2},
    "rope_freqs": {"rope_freqs": [[[0, 2, 5, 7]], [[1, 3, 4, 6]]]},
    "d_nope=0": {"d_nope": 0},
}


@pytest.mark.parametrize("option", list(CONVERTED_FORMS))
def test_a_converted_mla_form_is_refused_naming_the_option(option):
    shape = {"d_c": 16, "d_nope": 8, "d_rope": 8, "d_v": 12}
    config = tiny_config(mla(**{**shape, **CONVERTED_FORMS[option]}), False)
    named = re.escape(f"attention.{option}")
    for call in (lambda: native_architecture(config), lambda: native_config(config, torch.float32)):
        with pytest.raises(NativeExportError, match=f"{named}.*--format hf") as err:
            call()
        assert "\n" not in str(err.value)
    torch.manual_seed(0)
    with pytest.raises(NativeExportError, match=named):
        native_state_dict(Transformer(config))


def test_n_kv_heads_equal_to_n_heads_is_plain_mla_and_exports():
    config = tiny_config(mla(d_c=16, d_nope=8, d_rope=8, d_v=12, n_kv_heads=4), False)
    assert native_architecture(config) == "deepseek_v3"


def test_egmla_in_a_converted_form_is_refused_for_its_gate_first():
    attention = EGMLAConfig(d_c=16, d_nope=8, d_rope=8, d_v=12, d_e=16, latent_norm=False,
                            gate_residual=True)
    with pytest.raises(NativeExportError, match="embedding gate"):
        native_architecture(tiny_config(attention, False))


# ---- the command, on a saved export and on a real training run -------------------------------


def test_the_command_refuses_an_mla_from_before_latent_norm_eps_in_one_line(tmp_path):
    from egmla.checkpoint import save_export
    from support.processes import assert_one_line_error, run_export

    old = tiny_model(MLAConfig(d_c=16, d_nope=8, d_rope=8, d_v=12), False)  # norm_eps 1e-5
    source = save_export(old, tmp_path / "export")
    run = run_export("--checkpoint", str(source), "--out", "native", "--format", "native",
                     cwd=tmp_path)
    assert_one_line_error(run, "attention.latent_norm_eps=null",
                          "+model.attention.latent_norm_eps=1e-06")
    assert not (tmp_path / "native").exists()


@pytest.mark.slow
def test_a_default_mla_run_exports_natively_and_transformers_computes_it(tmp_path):
    """train.py with the shipped MLA config (model/attention=mla, no eps named anywhere) for 5
    steps, `python -m egmla.export --format native`, then transformers' own DeepseekV3ForCausalLM
    (no remote code) computes the run's logits and greedy tokens."""
    from support.processes import run_export
    from support.training import TINY, run_train

    run_dir = tmp_path / "run"
    trained = run_train([*TINY, "model/attention=mla", "debug=quick", f"hydra.run.dir={run_dir}"])
    assert trained.returncode == 0, trained.stderr[-3000:]
    composed = json.loads((run_dir / "config.json").read_text())["model"]
    assert "norm_eps" not in composed  # egmla's default 1e-5 for the block norms
    assert composed["attention"]["latent_norm_eps"] == 1e-6  # configs/model/attention/mla.yaml
    run = run_export("--checkpoint", str(run_dir), "--out", "native", "--format", "native",
                     cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "vLLM computes the latent norms with rms_norm_eps=1e-05" in run.stdout
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "native").eval()
    assert type(hf) is transformers.DeepseekV3ForCausalLM and hf.config.rms_norm_eps == 1e-5
    ours, _ = load_pretrained(run_dir / "export")
    ids = torch.randint(0, ours.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() < TOL
        got = hf.generate(ids[:, :6], attention_mask=torch.ones_like(ids[:, :6]), do_sample=False,
                          max_new_tokens=16, min_new_tokens=16)
    assert torch.equal(got, generate(ours, ids[:, :6], 16))
