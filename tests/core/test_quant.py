"""Q8_0 weights (egmla/quant.py) and their kernel (egmla.kernels.gemv_q8_0): the quantizer
equals llama.cpp's (the `gguf` package's numpy implementation of it), and the kernel's product
equals a float64 reference of the same quantized arithmetic, on both code paths."""

from __future__ import annotations

import os
import subprocess
import sys

import gguf  # the hf extra: transformers reads GGUF files through it
import numpy as np
import pytest
import torch

from egmla import kernels
from egmla.quant import Q8_BLOCK, quantize_q8_0
from support import ROOT



def llama_cpp_q8_0(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(qs int8 (N, K), d float16 (N, K/32)) from the gguf package's Q8_0 bytes."""
    raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)  # (N, K/32*34) uint8
    n, k = w.shape
    blocks = raw.reshape(n, k // Q8_BLOCK, 2 + Q8_BLOCK)
    d = blocks[..., :2].copy().view(np.float16)[..., 0]
    qs = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
    return qs, d


@pytest.mark.parametrize("scale", [1.0, 1e-3, 40.0])
def test_the_quantizer_is_llama_cpps(scale):
    torch.manual_seed(0)
    w = torch.randn(48, 256) * scale
    w[3, :32] = 0.0  # a zero block: d = 0, q = 0
    w[5, 40] = 7.5 * scale  # an outlier sets its block's scale
    ours = quantize_q8_0(w)
    qs, d = llama_cpp_q8_0(w)
    assert np.array_equal(ours.qs.numpy(), qs)
    assert np.array_equal(ours.d.numpy().view(np.uint16), d.view(np.uint16))
    assert ours.qs.abs().max() <= 127 and ours.d.dtype == torch.float16
    assert ours.nbytes() == 48 * 256 // Q8_BLOCK * 34  # as in the GGUF file
    # every value within half a step of its block's exact scale, plus what storing the scale in
    # float16 moves the largest value (a tiny block's scale is a float16 subnormal)
    exact = (w.view(48, -1, Q8_BLOCK).abs().amax(-1) / 127).repeat_interleave(Q8_BLOCK, dim=1)
    stored = ours.d.float().repeat_interleave(Q8_BLOCK, dim=1)
    bound = 0.5 * exact + 127 * (stored - exact).abs() + 1e-6 * exact
    assert ((ours.dequantize() - w).abs() <= bound).all()


def test_a_weight_it_cannot_block_is_refused_naming_its_width():
    with pytest.raises(ValueError, match="width 33 is not a multiple of 32"):
        quantize_q8_0(torch.randn(4, 33))


def reference(x: torch.Tensor, weight) -> torch.Tensor:
    """The kernel's arithmetic in float64: x quantized per block (d = amax / 127 in float32,
    q = round half to even of x * (127 / amax)), integer block dots, scaled by dw * dx."""
    m, k = x.shape
    xb = x.float().view(m, k // Q8_BLOCK, Q8_BLOCK)
    amax = xb.abs().amax(-1).double()  # the divisions in float64, rounded once to float32:
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)).float()  # as C divides
    xq = torch.round(xb * inv[..., None]).double()  # torch.round: half to even, as nearbyint
    xd = (amax / 127.0).float().double()
    wq = weight.qs.view(weight.qs.shape[0], k // Q8_BLOCK, Q8_BLOCK).double()
    dots = torch.einsum("mbj,nbj->mnb", xq, wq)  # exact: integers below 2^53
    return (dots * xd[:, None, :] * weight.d.double()[None]).sum(-1)


def check_products(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    for m, n, k in [(1, 576, 576), (2, 100, 64), (3, 37, 1536), (4, 192, 576), (6, 130, 96)]:
        w = quantize_q8_0(torch.randn(n, k) * 0.05)
        x = torch.randn(m, k).to(dtype)
        x[0, :32] = 0.0  # a zero activation block
        y = kernels.gemv_q8_0(x, w)
        assert y.shape == (m, n) and y.dtype == dtype
        want = reference(x, w)
        bound = (reference(x.abs(), type(w)(w.qs.abs(), w.d)) * 1e-5 + 1e-6)
        if dtype == torch.bfloat16:  # the result rounded to bf16
            bound = bound + want.abs() * 2.0 ** -8
        assert ((y.double() - want).abs() <= bound).all(), (m, n, k, dtype)
        # and close to the float product it stands for (quantization error, not a bug)
        exact = x.double() @ w.dequantize(torch.float64).T
        assert (y.double() - exact).norm() / exact.norm() < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_equals_the_quantized_reference(dtype):
    if not kernels.load():
        pytest.fail(f"the CPU kernels did not load: {kernels.status()['reason']}")
    check_products(dtype)


def test_the_avx2_path_equals_the_reference_too():
    """EGMLA_KERNELS_AVX512=0 takes the AVX2 path on a VNNI machine (read once per process)."""
    code = ("import sys, torch; sys.path.insert(0, 'tests'); from core.test_quant import "
            "check_products; check_products(torch.float32); check_products(torch.bfloat16)")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "EGMLA_KERNELS_AVX512": "0"}, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


def test_a_bad_layout_is_a_clear_error():
    if not kernels.load():
        pytest.fail(f"the CPU kernels did not load: {kernels.status()['reason']}")
    w = quantize_q8_0(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="K=48 is not a multiple of 32"):
        torch.ops.egmla.gemv_q8_0(torch.randn(1, 48), w.qs[:, :48].contiguous(), w.d)
    with pytest.raises(RuntimeError, match="d must be contiguous float16"):
        torch.ops.egmla.gemv_q8_0(torch.randn(1, 64), w.qs, w.d.float())
