"""Q8_0 weights in a model and in the engine (egmla.quant.quantize_model, LLM(quantization=)):
the decode path (the kernel) agrees with the full forward (PyTorch, the same arithmetic), the
engine's greedy tokens are the quantized model's own, and bad settings are refused by name."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from egmla.presets import preset
from egmla.quant import QuantizedLinear, quantize_model
from serve import LLM, SamplingParams
from support import ROOT
from support.models import build, decode, random_ids, tiny_text_export


def quantized_tiny(seed: int = 0):
    cfg = preset("tiny-gqa2")
    return cfg, quantize_model(build(cfg, torch.float32, seed), "q8_0")


def test_every_linear_of_the_blocks_and_the_head_is_quantized_and_the_embedding_is_not():
    cfg, model = quantized_tiny()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears == []
    quantized = [n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    assert len(quantized) == cfg.n_layers * 7 + 1 and "lm_head" in quantized
    assert model.tok_emb.weight.dtype == torch.float32


def test_prefill_then_decode_equals_the_full_forward():
    """Decode rows run the kernel, a long forward runs q8_matmul: one arithmetic, so the two
    agree to float rounding, except where rounding moves an activation across a quantization
    boundary (a jump of one step, amax / 127, in that activation): rare, and small."""
    cfg, model = quantized_tiny()
    ids = random_ids(cfg, 2, 40)
    with torch.no_grad():
        full = model(ids)  # 80 rows: PyTorch
    stepped = decode(model, ids, prompt=8)  # 16 rows, then 2 per step: the kernel
    diff, scale = (stepped - full).abs(), full.abs().max()
    assert diff.median() <= 1e-6 * scale  # float rounding almost everywhere
    assert diff.max() <= 5e-3 * scale  # and at most a step's worth where a rounding flipped
    assert torch.equal(stepped.argmax(-1), full.argmax(-1))


def test_the_quantized_model_stays_close_to_the_float_one():
    cfg = preset("tiny-gqa2")
    ids = random_ids(cfg, 2, 32)
    with torch.no_grad():
        exact = build(cfg, torch.float32)(ids)
        quantized = quantized_tiny()[1](ids)
    assert (quantized - exact).norm() / exact.norm() < 0.02


def test_the_engine_decodes_the_quantized_models_own_greedy_tokens(tmp_path, monkeypatch):
    """Through the fused Q8_0 block kernel (decode_block_q8: seen running), against full
    forwards of the same model through its modules."""
    from egmla import kernels
    from serve import executor

    ops, real = [], kernels.decode_blocks

    def decode_blocks(x, blocks, *rest):  # the real kernel call, noted
        ops.extend(w.op for w, _ in blocks)
        return real(x, blocks, *rest)

    monkeypatch.setattr(executor.kernels, "decode_blocks", decode_blocks, raising=True)
    tiny_text_export(tmp_path / "m")
    llm = LLM(tmp_path / "m", quantization="q8_0", num_blocks=64)
    prompt = llm.encode("the quick brown fox")
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0,
                                                stop_token_ids=(), ignore_eos=True))
    tokens = out[0].outputs[0].token_ids
    ids = list(prompt)
    with torch.no_grad():  # the reference: full forwards of the same quantized model
        for _ in range(12):
            ids.append(int(llm.model(torch.tensor([ids]))[0, -1].argmax()))
    assert list(tokens) == ids[len(prompt):]
    assert ops and set(ops) == {"decode_block_q8"}


@pytest.mark.parametrize("kwargs, message", [
    ({"quantization": "q4_k"}, "quantization='q4_k': expected one of q8_0"),
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
