"""Block-quantized weights in a model and in the engine (egmla.quant.quantize_model,
load_gguf_weights, LLM(quantization=)): for every format the decode path (the kernel) agrees
with the full forward (PyTorch, the same arithmetic), the engine's greedy tokens are the
quantized model's own, a GGUF model keeps its file's blocks, and bad settings are refused by
name."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from egmla.presets import preset
from egmla.quant import METHODS, QuantizedLinear, quantize_model
from serve import LLM, SamplingParams
from support import ROOT
from support.models import build, decode, random_ids, tiny_text_export


def quantized_tiny(method: str = "q8_0", seed: int = 0):
    cfg = preset("tiny-gqa2")
    return cfg, quantize_model(build(cfg, torch.float32, seed), method)


@pytest.mark.parametrize("method", METHODS)
def test_every_linear_of_the_blocks_and_the_head_is_quantized_and_the_embedding_is_not(method):
    cfg, model = quantized_tiny(method)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears == []
    quantized = {n: m.format for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert len(quantized) == cfg.n_layers * 7 + 1
    assert quantized.pop("lm_head") == "q8_0"  # a 4-bit method's head keeps 8 bits
    assert set(quantized.values()) == {method}
    assert model.tok_emb.weight.dtype == torch.float32


@pytest.mark.parametrize("method", METHODS)
def test_prefill_then_decode_equals_the_full_forward(method):
    """Decode rows run the kernel, a forward over more than QUANT_MAX_ROWS rows runs
    quant_matmul: one arithmetic, so the two agree to float rounding, except where rounding
    moves an activation across a quantization boundary (a jump of one step, amax / 127, in
    that activation): rare, and small."""
    from egmla.kernels import QUANT_MAX_ROWS

    cfg, model = quantized_tiny(method)
    ids = random_ids(cfg, 4, 80)
    assert ids.numel() > QUANT_MAX_ROWS
    with torch.no_grad():
        full = model(ids)  # 320 rows: PyTorch
    stepped = decode(model, ids, prompt=8)  # 32 rows, then 4 per step: the kernel
    diff, scale = (stepped - full).abs(), full.abs().max()
    assert diff.median() <= 1e-6 * scale  # float rounding almost everywhere
    assert diff.max() <= 5e-3 * scale  # and at most a step's worth where a rounding flipped
    assert torch.equal(stepped.argmax(-1), full.argmax(-1))


@pytest.mark.parametrize("method, error", [("q8_0", 0.02), ("q4_0", 0.12), ("q4_1", 0.12)])
def test_the_quantized_model_stays_close_to_the_float_one(method, error):
    cfg = preset("tiny-gqa2")
    ids = random_ids(cfg, 2, 32)
    with torch.no_grad():
        exact = build(cfg, torch.float32)(ids)
        quantized = quantized_tiny(method)[1](ids)
    assert (quantized - exact).norm() / exact.norm() < error


@pytest.mark.parametrize("method", METHODS)
def test_the_engine_decodes_the_quantized_models_own_greedy_tokens(method, tmp_path, monkeypatch):
    """Through the fused quantized block kernel (decode_block_quant: seen running), against
    full forwards of the same model through its modules."""
    from egmla import kernels
    from serve import executor

    ops, real = [], kernels.decode_blocks

    def decode_blocks(x, blocks, *rest):  # the real kernel call, noted
        ops.extend(w.op for w, _ in blocks)
        return real(x, blocks, *rest)

    monkeypatch.setattr(executor.kernels, "decode_blocks", decode_blocks, raising=True)
    tiny_text_export(tmp_path / "m")
    llm = LLM(tmp_path / "m", quantization=method, num_blocks=64)
    prompt = llm.encode("the quick brown fox")
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0,
                                                stop_token_ids=(), ignore_eos=True))
    tokens = out[0].outputs[0].token_ids
    ids = list(prompt)
    with torch.no_grad():  # the reference: full forwards of the same quantized model
        for _ in range(12):
            ids.append(int(llm.model(torch.tensor([ids]))[0, -1].argmax()))
    assert list(tokens) == ids[len(prompt):]
    assert ops and set(ops) == {"decode_block_quant"}


@pytest.mark.parametrize("kwargs, message", [
    ({"quantization": "q4_k"}, "quantization=.q4_k.: expected one of q8_0, q4_0, q4_1, gguf"),
    ({"quantization": "gguf"}, "quantization=.gguf.: .* is not a GGUF model; those are SmolLM2"),
    ({"quantization": "q8_0", "ffn_sparsity": "oracle"}, "the sparse MLP decodes float weights"),
])
def test_settings_it_cannot_serve_are_refused_by_name(tmp_path, kwargs, message):
    tiny_text_export(tmp_path / "m")
    with pytest.raises(ValueError, match=message):
        LLM(tmp_path / "m", **kwargs)


def test_the_server_refuses_an_unknown_quantization_at_its_command_line():
    run = subprocess.run([sys.executable, "-m", "serve", "--model", "x", "--quantization", "q3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--quantization: invalid choice: 'q3'" in run.stderr


@pytest.mark.slow
def test_a_gguf_model_keeps_its_files_blocks_and_decodes_its_own_greedy_tokens(monkeypatch):
    """quantization="gguf" on the shipped SmolLM2 (Q4_1 blocks, a Q8_0 head): each linear
    layer holds the file's blocks (checked at load to decode to the converted weights exactly),
    and the engine, through the fused block kernel, decodes the model's own greedy tokens."""
    from egmla import kernels
    from serve import executor

    ops, real = [], kernels.decode_blocks

    def decode_blocks(x, blocks, *rest):  # the real kernel call, noted
        ops.extend(w.op for w, _ in blocks)
        return real(x, blocks, *rest)

    monkeypatch.setattr(executor.kernels, "decode_blocks", decode_blocks, raising=True)
    llm = LLM("SmolLM2-135M-Instruct", quantization="gguf", num_blocks=64)
    formats = {name: m.format for name, m in llm.model.named_modules()
               if isinstance(m, QuantizedLinear)}
    assert len(formats) == 30 * 7 + 1 and formats.pop("lm_head") == "q8_0"
    assert set(formats.values()) == {"q4_1"}
    prompt = llm.encode("def add(a, b):")
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0,
                                                stop_token_ids=(), ignore_eos=True))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(llm.model(torch.tensor([ids]))[0, -1].argmax()))
    assert list(out[0].outputs[0].token_ids) == ids[len(prompt):]
    assert ops and set(ops) == {"decode_block_quant"}


@pytest.mark.slow
def test_a_model_that_is_not_the_files_conversion_is_refused_naming_the_tensor():
    from egmla.imports import gguf_source, load_pretrained
    from egmla.quant import load_gguf_weights

    model, _ = load_pretrained("SmolLM2-135M-Instruct")
    with torch.no_grad():
        model.layers[3].attn.wk.weight[5, 7] += 1e-3
    with pytest.raises(ValueError, match=r"blk\.3\.attn_k\.weight \(Q4_1\) does not decode to the "
                                         r"model's layers\.3\.attn\.wk\.weight"):
        load_gguf_weights(model, gguf_source("smollm2-135m-instruct"))
