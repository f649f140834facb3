"""Block-quantized weights (egmla/quant.py: Q8_0, Q4_0, Q4_1) and their kernel
(egmla.kernels.gemv_quant): the quantizers equal llama.cpp's (the `gguf` package's numpy
implementations), the stored blocks decode as gguf decodes them, and the kernel's product equals
a float64 reference of the same quantized arithmetic, on both code paths."""

from __future__ import annotations

import os
import subprocess
import sys

import gguf  # the hf extra: transformers reads GGUF files through it
import numpy as np
import pytest
import torch

from egmla import kernels
from egmla.quant import GGUF_TYPES, Q8_BLOCK, QUANTIZERS, QuantWeight, gguf_weight, quantize_q8_0
from support import ROOT



GGML = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}


def llama_cpp(w: torch.Tensor, fmt: str) -> tuple[np.ndarray, QuantWeight]:
    """The gguf package's blocks of `w` in format `fmt`: the raw bytes, and read as ours."""
    kind = getattr(gguf.GGMLQuantizationType, GGML[fmt])
    raw = gguf.quants.quantize(w.numpy(), kind)  # (N, K / 32 * bytes) uint8
    return raw, gguf_weight(raw, GGML[fmt])


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bit for bit (float16 compared as integers, so that -0 and NaN patterns count)."""
    if a is None or b is None:
        return a is None and b is None
    view = torch.int16 if a.dtype == torch.float16 else a.dtype
    return a.dtype == b.dtype and torch.equal(a.view(view), b.view(view))


def awkward(scale: float) -> torch.Tensor:
    torch.manual_seed(0)
    w = torch.randn(48, 256) * scale
    w[3, :32] = 0.0  # a zero block: d = 0
    w[4, 32:64] = 0.25 * scale  # a constant block
    w[5, 40] = 7.5 * scale  # an outlier sets its block's scale
    w[6, 64:96] = -w[6, 64:96].abs()  # all negative: Q4_0's extreme is a minimum
    w[7, 96] = -w[7, 96:128].abs().max() * 1.0001 - 0.1  # the largest |w| negative...
    w[7, 97] = -w[7, 96]  # ... and equalled by a positive one after it (the first one counts)
    return w


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("scale", [1.0, 1e-3, 40.0])
def test_the_quantizers_are_llama_cpps(fmt, scale):
    w = awkward(scale)
    ours = QUANTIZERS[fmt](w)
    raw, theirs = llama_cpp(w, fmt)
    assert ours.format == theirs.format == fmt
    assert all(same(a, b) for a, b in zip(ours.tensors(), theirs.tensors()))
    assert ours.nbytes() == raw.nbytes == 48 * 256 // Q8_BLOCK * GGUF_TYPES[GGML[fmt]][1]
    # and the blocks decode as the gguf package decodes them (float32, bit for bit)
    decoded = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, GGML[fmt]))
    assert torch.equal(ours.dequantize(), torch.from_numpy(decoded.astype(np.float32)))


def test_q8_0_values_sit_within_half_a_step_of_the_weights():
    w = awkward(1.0)
    ours = quantize_q8_0(w)
    assert ours.qs.abs().max() <= 127 and ours.d.dtype == torch.float16
    # every value within half a step of its block's exact scale, plus what storing the scale in
    # float16 moves the largest value (a tiny block's scale is a float16 subnormal)
    exact = (w.view(48, -1, Q8_BLOCK).abs().amax(-1) / 127).repeat_interleave(Q8_BLOCK, dim=1)
    stored = ours.d.float().repeat_interleave(Q8_BLOCK, dim=1)
    bound = 0.5 * exact + 127 * (stored - exact).abs() + 1e-6 * exact
    assert ((ours.dequantize() - w).abs() <= bound).all()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_a_weight_it_cannot_block_is_refused_naming_its_width(fmt):
    with pytest.raises(ValueError, match="width 33 is not a multiple of 32"):
        QUANTIZERS[fmt](torch.randn(4, 33))


def reference(x: torch.Tensor, weight: QuantWeight, magnitude: bool = False) -> torch.Tensor:
    """The kernel's arithmetic in float64: x quantized per block (d = amax / 127 in float32,
    q = round half to even of x * (127 / amax)), integer block dots with the stored values,
    each block's sum d dx dot + m dx sum(xq) (m = -8 d for Q4_0, 0 for Q8_0). `magnitude`:
    the same over |x| and |w|'s terms, the size a rounding error is measured against."""
    m, k = x.shape
    xb = x.float().view(m, k // Q8_BLOCK, Q8_BLOCK)
    amax = xb.abs().amax(-1).double()  # the divisions in float64, rounded once to float32:
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)).float()  # as C divides
    xq = torch.round(xb * inv[..., None]).double()  # torch.round: half to even, as nearbyint
    xd = (amax / 127.0).float().double()
    q, d = weight.values().double(), weight.d.double()
    offset = {"q8_0": torch.zeros_like(d), "q4_0": -8 * d,
              "q4_1": weight.m.double() if weight.m is not None else None}[weight.format]
    if magnitude:
        xq, q, d, offset = xq.abs(), q.abs(), d.abs(), offset.abs()
    dots = torch.einsum("mbj,nbj->mnb", xq, q)  # exact: integers below 2^53
    sums = xq.sum(-1)  # (m, blocks)
    return ((dots * d[None] + sums[:, None, :] * offset[None]) * xd[:, None, :]).sum(-1)


def check_products(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    for fmt, quantize in QUANTIZERS.items():
        for m, n, k in [(1, 576, 576), (2, 100, 64), (3, 37, 1536), (4, 192, 576), (6, 130, 96)]:
            w = quantize(torch.randn(n, k) * 0.05 + (0.01 if fmt == "q4_1" else 0.0))
            x = torch.randn(m, k).to(dtype)
            x[0, :32] = 0.0  # a zero activation block
            y = kernels.gemv_quant(x, w)
            assert y.shape == (m, n) and y.dtype == dtype
            want = reference(x, w)
            bound = reference(x, w, magnitude=True) * 1e-5 + 1e-6
            if dtype == torch.bfloat16:  # the result rounded to bf16
                bound = bound + want.abs() * 2.0 ** -8
            assert ((y.double() - want).abs() <= bound).all(), (fmt, m, n, k, dtype)
            # and close to the float product it stands for (quantization error, not a bug)
            exact = x.double() @ w.dequantize(torch.float64).T
            assert (y.double() - exact).norm() / exact.norm() < (0.02 if fmt == "q8_0" else 0.1)


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
        torch.ops.egmla.gemv_quant(torch.randn(1, 48), [w.qs[:, :48].contiguous(), w.d])
    with pytest.raises(RuntimeError, match="d must be contiguous float16"):
        torch.ops.egmla.gemv_quant(torch.randn(1, 64), [w.qs, w.d.float()])
    with pytest.raises(RuntimeError, match=r"qs must be a contiguous CPU \(8, 32\)"):
        torch.ops.egmla.gemv_quant(torch.randn(1, 64), [w.qs.view(torch.uint8), w.d])
    with pytest.raises(RuntimeError, match="qs must be int8 .* or uint8"):
        torch.ops.egmla.gemv_quant(torch.randn(1, 64), [w.qs, w.d, w.d])
