"""`python -m egmla.export --format hf`: transformers (trust_remote_code) computes what egmla
computes, generates the same tokens with a cache of what egmla caches, lm-eval's own `hf` model
scores the same, and the directory loads back into egmla and the serving engine."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from egmla.checkpoint import CheckpointError, save_export
from egmla.config import ModelConfig
from egmla.export.hf import is_hf_export, save_hf, transformers_cache_spec
from egmla.generate import generate
from egmla.imports import load_pretrained
from egmla.models.transformer import Transformer
from serve import LLM, SamplingParams
from support import ROOT
from support.processes import assert_one_line_error, run_export

MLA = {"d_c": 32, "d_nope": 16, "d_rope": 8, "d_v": 16}
# A converted GQA model's form (support.models.CONVERTED, over these tests' 4 layers): 2 KV heads,
# each with its own RoPE key rotating at 4 of the 12 frequencies of a 24-wide head, chosen per
# layer; no latent norm
CONVERTED = {"latent_norm": False, "n_kv_heads": 2, "rope_heads": 2,
             "rope_freqs": [[[0, 3, 5, 11], [1, 2, 7, 9]], [[4, 6, 8, 10], [0, 1, 2, 3]],
                            [[2, 5, 9, 10], [11, 0, 4, 6]], [[1, 3, 6, 8], [5, 7, 10, 11]]]}
RESIDUAL_GATE = {"d_e": 16, "gate_residual": True, "gate_init": "random", "gate_norm": "none"}
VARIANTS = {
    "gqa": {"type": "mha", "n_kv_heads": 2},
    "mla": {"type": "mla", **MLA, "d_q": 24},
    "egmla-kv": {"type": "egmla", **MLA, "d_e": 16, "gate_group_size": 2},
    "egmla-latent": {"type": "egmla", **MLA, "d_e": 16, "gate_position": "latent",
                     "gate_norm": "rmsnorm"},
    "gqa-relu2": {"type": "mha", "n_kv_heads": 2},
    "mla-drelu": {"type": "mla", **MLA},
    "mla-converted": {"type": "mla", **MLA, **CONVERTED},
    "egmla-kv-converted": {"type": "egmla", **MLA, **RESIDUAL_GATE, **CONVERTED},
    "egmla-latent-converted": {"type": "egmla", **MLA, **RESIDUAL_GATE, **CONVERTED,
                               "gate_position": "latent"},
    # attention over lcm(n_kv_heads, rope_heads) heads, each K/V head (here with d_nope 0) or
    # RoPE key serving two consecutive ones; the RoPE keys at permuted frequencies
    "mla-nope0-converted": {"type": "mla", "d_c": 32, "d_nope": 0, "d_rope": 8, "d_v": 16,
                            "latent_norm": False, "n_kv_heads": 2, "rope_heads": 4,
                            "rope_freqs": [[[3, 1, 0, 2], [2, 0, 3, 1], [0, 1, 2, 3],
                                            [1, 3, 2, 0]]] * 4},
    "mla-rope-pairs": {"type": "mla", **MLA, "rope_heads": 2},
}
FFN = {"gqa-relu2": "relu2", "mla-drelu": "drelu"}  # the MLP of a variant, where not SwiGLU


def tiny_model(attention: dict, tie: bool = True, seed: int = 0, ffn: str = "swiglu") -> Transformer:
    """4 layers, d=64, weights large enough that greedy decoding does not settle into a loop;
    norms moved off one so a norm mapped to the wrong place shows."""
    torch.manual_seed(seed)
    config = ModelConfig.from_dict({"vocab_size": 256, "d_model": 64, "n_layers": 4, "n_heads": 4,
                                    "attention": attention, "tie_embeddings": tie,
                                    "init_std": 0.3, "ffn": ffn})  # no eos: 32 tokens every time
    model = Transformer(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def load_transformers(directory: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, **kwargs).eval()


@pytest.fixture(scope="module", params=list(VARIANTS))
def exported(request, tmp_path_factory):
    model = tiny_model(VARIANTS[request.param], tie=request.param != "mla",
                       ffn=FFN.get(request.param, "swiglu"))
    directory = save_hf(model, tmp_path_factory.mktemp("hf") / request.param)
    return model, directory, load_transformers(directory)


def test_the_directory_is_a_transformers_model_with_auto_map(exported):
    _, directory, hf = exported
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "egmla"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_egmla.EgmlaForCausalLM"
    assert type(hf).__name__ == "EgmlaForCausalLM"
    for name in ("model.safetensors", "configuration_egmla.py", "modeling_egmla.py"):
        assert (directory / name).is_file()


def test_the_directory_loads_where_egmla_is_not_installed(tmp_path):
    """Someone with only torch and transformers: egmla cannot be imported in that process."""
    model = tiny_model(VARIANTS["egmla-kv"])
    directory = save_hf(model, tmp_path / "hf")
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(5))
    code = (
        "import sys, torch\n"
        "sys.modules['egmla'] = None  # any import of egmla now fails\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(directory)!r}, trust_remote_code=True)\n"
        f"print(m(torch.tensor({ids.tolist()})).logits[0, -1].tolist())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    theirs = torch.tensor(json.loads(run.stdout.strip().splitlines()[-1]))
    with torch.no_grad():
        ours = model(ids)[0, -1]
    assert (ours - theirs).abs().max().item() < 1e-4


def test_transformers_logits_equal_egmla(exported):
    model, _, hf = exported
    ids = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert ours.abs().max() > 0.1  # not a degenerate model
    assert (ours - theirs).abs().max().item() < 1e-4


def test_greedy_generate_equals_egmla_for_32_tokens_in_a_left_padded_batch(exported):
    model, _, hf = exported
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 256, (1, n), generator=g) for n in (9, 5)]
    width = max(p.shape[1] for p in prompts)
    ids = torch.cat([torch.nn.functional.pad(p, (width - p.shape[1], 0)) for p in prompts])
    mask = torch.cat([torch.nn.functional.pad(torch.ones_like(p), (width - p.shape[1], 0))
                      for p in prompts])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32,
                          do_sample=False, pad_token_id=0)
    for row, prompt in enumerate(prompts):
        expected = generate(model, prompt, max_new_tokens=32)[0, prompt.shape[1]:]
        assert out[row, width:].tolist() == expected.tolist()
        assert len(set(expected.tolist())) > 3  # a continuation worth comparing


def cached_tensors(cache) -> list[torch.Tensor]:
    """Every tensor the transformers cache holds, read from its layers (not from its nbytes)."""
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return tensors + ([cache.token_ids] if cache.token_ids is not None else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_generate_cache_holds_exactly_egmlas_analytic_bytes(exported, dtype, tmp_path):
    model, directory, hf = exported
    if dtype != torch.float32:
        directory = save_hf(copy.deepcopy(model).to(dtype), tmp_path / "cast")
        hf = load_transformers(directory)
    prompt = torch.randint(1, 256, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = hf.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                          return_dict_in_generate=True, pad_token_id=0)
    cache = getattr(out, "cache", None) or out.past_key_values
    assert type(cache).__name__ == "EgmlaCache"
    tokens = 2 * cache.get_seq_length()  # batch * cached positions
    assert cache.get_seq_length() == 7 + 12 - 1  # the last token is sampled, never fed back
    measured = sum(t.untyped_storage().nbytes() for t in cached_tensors(cache))
    assert measured == cache.nbytes()
    assert measured / tokens == transformers_cache_spec(model.config).bytes_per_token(dtype)
    a = model.config.attention
    if a.type != "mha":  # the latent and the RoPE key(s), never per-head K/V
        assert {t.shape[-1] for t in cached_tensors(cache)[:2]} == {a.d_c, a.rope_heads * a.d_rope}


def test_loads_back_into_egmla_exactly(exported):
    model, directory, _ = exported
    back, tokenizer = load_pretrained(directory)
    assert tokenizer is None  # none was exported
    assert back.config == model.config
    ours, theirs = model.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    if model.config.attention.type == "egmla":  # a group of layers still shares one table
        tables = [block.attn.gate_table for block in back.layers]
        group = model.config.attention.gate_group_size
        assert (tables[0] is tables[1]) == (group == 2) and tables[0] is not tables[2]


def test_the_serving_engine_serves_an_hf_export(exported):
    model, directory, _ = exported
    prompt = torch.randint(1, 256, (1, 11), generator=torch.Generator().manual_seed(4))
    llm = LLM(directory, kv_cache_memory=8 * 2**20)
    (result,) = llm.generate([prompt[0].tolist()], SamplingParams(max_tokens=16, temperature=0.0))
    expected = generate(model, prompt, max_new_tokens=16)[0, 11:].tolist()
    assert result.outputs[0].token_ids == expected


@pytest.mark.parametrize("variant", ["gqa", "mla"])
def test_the_serving_engine_serves_a_llama_or_deepseek_directory(variant, tmp_path):
    """A transformers Llama / DeepSeek-V3 directory (here our native export, which transformers
    loads as its own LlamaForCausalLM / DeepseekV3ForCausalLM) imports into the engine."""
    from egmla.export import save_native

    torch.manual_seed(0)
    config = ModelConfig.from_dict({"vocab_size": 256, "d_model": 64, "n_layers": 2,
                                    "n_heads": 4, "attention": VARIANTS[variant], "init_std": 0.3,
                                    "norm_eps": 1e-6})
    model = Transformer(config).eval()
    directory = save_native(model, tmp_path / "native")
    assert json.loads((directory / "config.json").read_text())["model_type"] in (
        "llama", "deepseek_v3")
    prompt = torch.randint(1, 256, (1, 9), generator=torch.Generator().manual_seed(7))
    llm = LLM(directory, kv_cache_memory=8 * 2**20)
    (result,) = llm.generate([prompt[0].tolist()], SamplingParams(max_tokens=16, temperature=0.0))
    assert result.outputs[0].token_ids == generate(model, prompt, max_new_tokens=16)[0, 9:].tolist()


# ---- the command: bad input writes nothing ----------------------------------------------------


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def drop_a_tensor(export: Path) -> str:
    weights = safetensors.torch.load_file(export / "model.safetensors")
    del weights["layers.1.attn.wkv_b.weight"]
    safetensors.torch.save_file(weights, export / "model.safetensors")
    return "layers.1.attn.wkv_b.weight"


def claim_a_newer_version(export: Path) -> str:
    config = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps({**config, "egmla_format_version": 2}))
    return "egmla_format_version=2"


@pytest.mark.parametrize("corrupt", [drop_a_tensor, claim_a_newer_version])
def test_a_bad_export_fails_clearly_and_writes_nothing(corrupt, tmp_path):
    source = save_export(tiny_model(VARIANTS["mla"]), tmp_path / "export")
    named = corrupt(source)
    run = run_export("--checkpoint", str(source), "--out", "out", cwd=tmp_path)
    assert_one_line_error(run, named)
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_an_hf_export_from_a_newer_version_is_refused(tmp_path):
    directory = save_hf(tiny_model(VARIANTS["gqa"]), tmp_path / "hf")
    config = json.loads((directory / "config.json").read_text())
    config["egmla"]["format_version"] = 2
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="newer egmla"):
        load_pretrained(directory)


def test_an_hf_export_missing_a_tensor_is_refused_by_name(tmp_path):
    directory = save_hf(tiny_model(VARIANTS["egmla-kv"]), tmp_path / "hf")
    weights = safetensors.torch.load_file(directory / "model.safetensors")
    del weights["model.gate_embeddings.1.weight"]
    safetensors.torch.save_file(weights, directory / "model.safetensors")
    with pytest.raises(CheckpointError, match="layers.2.attn.gate_table.weight"):
        load_pretrained(directory)


def test_native_format_refuses_egmla_and_a_foreign_out_is_left_alone(tmp_path):
    source = save_export(tiny_model(VARIANTS["egmla-kv"]), tmp_path / "export")
    run = run_export("--checkpoint", str(source), "--out", "native", "--format", "native",
                     cwd=tmp_path)
    assert_one_line_error(run, "EG-MLA", "--format hf")
    assert not (tmp_path / "native").exists() and not leftovers(tmp_path)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    run = run_export("--checkpoint", str(source), "--out", "notes", cwd=tmp_path)
    assert_one_line_error(run, "notes", "--overwrite")
    assert [p.name for p in (tmp_path / "notes").iterdir()] == ["todo.txt"]


@pytest.mark.parametrize("first,then", [("hf", "egmla"), ("egmla", "hf")])
def test_an_export_replaces_an_earlier_one_in_any_format_or_anything_with_overwrite(
        first, then, tmp_path):
    from egmla.export import export

    source = save_export(tiny_model(VARIANTS["mla"]), tmp_path / "export")
    export(source, tmp_path / "out", format=first)
    export(source, tmp_path / "out", format=then)  # written by egmla: replaced
    assert is_hf_export(tmp_path / "out") == (then == "hf")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="--overwrite"):
        export(source, tmp_path / "notes", format=then)
    export(source, tmp_path / "notes", format=then, overwrite=True)
    assert not (tmp_path / "notes" / "todo.txt").exists()
    assert torch.equal(weights(tmp_path / "notes")["layers.0.attn.wkv_b.weight"],
                       weights(source)["layers.0.attn.wkv_b.weight"])


# ---- a real training run: its directory and its Lightning checkpoint, lm-eval on the export ----

QUESTIONS = [
    ("ROMEO: But soft, what light through yonder", [" window", " sword", " river"], 0),
    ("In the beginning God created the heaven and the", [" earth", " king", " night"], 0),
    ("To be, or not to be, that is the", [" question", " horse", " morning"], 0),
    ("And God said, Let there be", [" light", " water", " kings"], 0),
    ("Now is the winter of our", [" discontent", " wisdom", " mercy"], 0),
    ("The LORD is my shepherd; I shall not", [" want", " sleep", " speak"], 0),
    ("All the world's a", [" stage", " field", " house"], 0),
    ("A horse! a horse! my kingdom for a", [" horse", " crown", " sword"], 0),
]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """train.py for real: a tiny EG-MLA run with a run directory, last.ckpt and its export."""
    from support.training import TINY, run_train

    run_dir = tmp_path_factory.mktemp("export-run") / "run"
    # A small validation split: the run ends by validating on all of it.
    result = run_train([*TINY, "model/attention=egmla", "trainer.max_steps=12",
                        "data.val_fraction=0.002",
                        "trainer.val_every_n_steps=12", "trainer.checkpoint_every_n_steps=12",
                        "wandb.mode=disabled", f"hydra.run.dir={run_dir}"])
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def weights(directory: Path) -> dict[str, torch.Tensor]:
    model, _ = load_pretrained(directory)
    return model.state_dict()


@pytest.mark.slow
def test_a_run_directory_and_its_checkpoint_export_the_trained_weights(trained_run, tmp_path):
    run = run_export("--checkpoint", str(trained_run), "--out", "hf", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "hf format" in run.stdout and "bytes per token" in run.stdout
    assert (tmp_path / "hf" / "tokenizer.json").is_file()  # the run's tokenizer goes along
    ckpt = trained_run / "checkpoints" / "last.ckpt"
    run = run_export("--checkpoint", str(ckpt), "--out", "from-ckpt", "--format", "egmla",
                     cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    reference = weights(trained_run / "export")
    for exported in (tmp_path / "hf", tmp_path / "from-ckpt"):
        got = weights(exported)
        assert got.keys() == reference.keys()
        assert all(torch.equal(got[k], reference[k]) for k in got), exported
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["egmla"]["source"] == str(trained_run / "export")
    assert config["egmla"]["git"]["sha"] and config["egmla"]["versions"]["torch"]


@pytest.mark.slow
def test_a_checkpoint_missing_a_tensor_fails_clearly_and_writes_nothing(trained_run, tmp_path):
    ckpt = torch.load(trained_run / "checkpoints" / "last.ckpt", weights_only=True)
    del ckpt["state_dict"]["model.layers.0.attn.wkv_b.weight"]
    torch.save(ckpt, tmp_path / "broken.ckpt")
    run = run_export("--checkpoint", "broken.ckpt", "--out", "out", cwd=tmp_path)
    assert_one_line_error(run, "broken.ckpt", "layers.0.attn.wkv_b.weight")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def lm_eval_run(module: str, model: str, model_args: str, tasks: Path, out: Path) -> dict:
    """lm-eval's command line (`lm_eval` itself, or ours with the egmla model registered)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", module, "--model", model, "--model_args", model_args,
         "--tasks", "shakespeare_kjv", "--include_path", str(tasks), "--device", "cpu",
         "--batch_size", "4", "--output_path", str(out), "--log_samples"],
        cwd=out.parent, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    (results,) = out.rglob("results_*.json")
    (samples,) = out.rglob("samples_shakespeare_kjv_*.jsonl")
    lines = [json.loads(line) for line in samples.read_text().splitlines()]
    scores = [float(r[0][0]) for line in sorted(lines, key=lambda x: x["doc_id"])
              for r in line["resps"]]
    return {"acc": json.loads(results.read_text())["results"]["shakespeare_kjv"]["acc,none"],
            "scores": scores}


@pytest.mark.slow
def test_lm_eval_hf_on_the_export_scores_like_the_egmla_model(trained_run, tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    rows = [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS]
    (tasks / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "shakespeare_kjv.yaml").write_text(
        "task: shakespeare_kjv\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tasks / 'data.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    run = run_export("--checkpoint", str(trained_run), "--out", "hf", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    theirs = lm_eval_run("lm_eval", "hf", f"pretrained={tmp_path / 'hf'},trust_remote_code=True,"
                         "dtype=float32", tasks, tmp_path / "out-hf")
    ours = lm_eval_run("eval.lm_eval", "egmla", f"pretrained={trained_run / 'export'}", tasks,
                       tmp_path / "out-egmla")
    assert len(ours["scores"]) == len(theirs["scores"]) == 3 * len(QUESTIONS)
    assert ours["acc"] == theirs["acc"]
    assert max(abs(a - b) for a, b in zip(ours["scores"], theirs["scores"])) < 1e-4


def test_every_layer_attends_through_transformers_attention_interface(tmp_path):
    """The plug point of vLLM's Transformers backend (docs/export.md): a function registered
    with transformers' AttentionInterface receives every layer's attention, and without a
    cache the model computes the same logits through it."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        calls.append(module.layer_idx)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("egmla_test_recording", recording)
    model = tiny_model(VARIANTS["egmla-kv"])
    hf = load_transformers(save_hf(model, tmp_path / "hf"),
                           attn_implementation="egmla_test_recording")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        theirs = hf(ids, use_cache=False).logits
        ours = model(ids)
    assert calls == [0, 1, 2, 3]
    assert (ours - theirs).abs().max().item() < 1e-4


def test_an_export_from_before_the_converted_forms_reads_them_at_their_defaults(tmp_path):
    """A config.json written before the converted forms has none of their keys: transformers
    and egmla both read DeepSeek's MLA (and the plain gate), and compute what egmla computes."""
    model = tiny_model(VARIANTS["egmla-kv"])
    directory = save_hf(model, tmp_path / "hf")
    config = json.loads((directory / "config.json").read_text())
    for key in ("latent_norm", "n_kv_heads", "rope_heads", "rope_freqs", "gate_residual"):
        del config["attention"][key]
    (directory / "config.json").write_text(json.dumps(config))
    back, _ = load_pretrained(directory)
    assert back.config == model.config
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ours, theirs = model(ids), load_transformers(directory)(ids).logits
    assert (ours - theirs).abs().max().item() < 1e-4


# EG-MLA's gate norm undoes the scale that the norm on c gives each token, so there the eps
# shows through the low-rank query's norm
@pytest.mark.parametrize("attention", [VARIANTS["mla"], {**VARIANTS["egmla-kv"], "d_q": 24}],
                         ids=["mla", "egmla-kv-lora-q"])
def test_the_latent_norms_eps_reaches_the_remote_code(attention, tmp_path):
    """latent_norm_eps goes into config.json and the remote code builds kv_a_layernorm and
    q_a_layernorm with it; an export from before the key computes them at rms_norm_eps, as
    egmla's null does. The latent norms' inputs scaled down to where the eps matters, so the
    controls are off by whole units."""
    model = tiny_model({**attention, "latent_norm_eps": 1e-6})
    d_c = model.config.attention.d_c
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.wkv_a.weight[:d_c].mul_(1e-3)  # the latent rows
            layer.attn.wq_a.weight.mul_(1e-3)
    directory = save_hf(model, tmp_path / "hf")
    back, _ = load_pretrained(directory)
    assert back.config == model.config and back.config.attention.latent_norm_eps == 1e-6
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        theirs = load_transformers(directory)(ids).logits
        assert theirs.abs().max() > 1.0
        assert (model(ids) - theirs).abs().max().item() < 1e-4
    config = json.loads((directory / "config.json").read_text())
    del config["attention"]["latent_norm_eps"]
    (directory / "config.json").write_text(json.dumps(config))
    before = Transformer(load_pretrained(directory)[0].config).eval()
    assert before.config.attention.latent_norm_eps is None
    before.load_state_dict(model.state_dict())
    with torch.no_grad():
        theirs = load_transformers(directory)(ids).logits
        assert (model(ids) - theirs).abs().max().item() > 0.5
        assert (before(ids) - theirs).abs().max().item() < 1e-4


INITS = {
    "gqa": {"type": "mha", "n_kv_heads": 2},
    "mla": {"type": "mla", **MLA},
    "egmla-kv-small": {"type": "egmla", **MLA, "d_e": 32, "gate_group_size": 2},
    "egmla-kv-random": {"type": "egmla", **MLA, "d_e": 32, "gate_init": "random"},
    "egmla-kv-matched": {"type": "egmla", **MLA, "d_e": 32, "gate_init": "matched"},
    "egmla-kv-identity": {"type": "egmla", **MLA, "d_e": 32, "gate_init": "identity",
                          "gate_residual": True},
    "egmla-latent-random": {"type": "egmla", **MLA, "d_e": 32, "gate_position": "latent",
                            "gate_init": "random", "gate_norm": "rmsnorm"},
}


@pytest.mark.parametrize("variant", list(INITS))
def test_a_fresh_transformers_model_starts_as_a_fresh_egmla_model(variant, tmp_path):
    """A model transformers builds from an export's config (weights drawn by the exported
    modeling code) starts with egmla's initialization: per tensor the same mean and spread
    (the residual outputs at init_std / sqrt(2 layers), each `gate_init`'s gate), and the
    constant tensors (norms, `identity`'s zero W_UE, `matched`'s gate norm gain) equal."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = ModelConfig.from_dict({"vocab_size": 512, "d_model": 128, "n_layers": 4,
                                    "n_heads": 4, "attention": INITS[variant]})
    ours = hf_state_dict_of(Transformer(config))
    directory = save_hf(Transformer(config), tmp_path / "hf")
    fresh = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(directory, trust_remote_code=True), trust_remote_code=True)
    theirs = dict(fresh.state_dict())
    assert set(ours) <= set(theirs)
    for name, mine in ours.items():
        other = theirs[name].float()
        if mine.std() == 0:  # a constant: a norm's gain or bias, a zero W_UE
            assert torch.equal(other, mine), name
            continue
        assert other.std() / mine.std() == pytest.approx(1.0, abs=0.1), name
        assert abs(other.mean() - mine.mean()) < 0.1 * mine.std(), name


def hf_state_dict_of(model: Transformer) -> dict[str, torch.Tensor]:
    from egmla.export.hf import hf_state_dict

    return {name: t.float() for name, t in hf_state_dict(model).items()}
