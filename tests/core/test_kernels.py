"""egmla's CPU kernel (egmla/kernels): the decode fast path of every linear layer equals
F.linear, is taken where the docs say, and falls back cleanly where it cannot run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from egmla import kernels
from support import ROOT, ops_called, torch_threads

SUPPORTED = kernels.unsupported() is None


def test_the_kernel_is_built_and_used_where_the_cpu_supports_it():
    """On an AVX2 machine the fast path must really be on, or every test below compares
    F.linear with itself."""
    if not SUPPORTED:
        assert not kernels.load() and kernels.status()["reason"] == kernels.unsupported()
        return
    assert kernels.load(), kernels.status()["reason"]
    assert torch.ops.egmla.gemv.default is not None


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("K,N", [(576, 192), (577, 13), (64, 4099), (7, 1)])
def test_fp32_matches_a_float64_reference_as_closely_as_f_linear(rows, K, N):
    torch.manual_seed(rows * K + N)
    x, w = torch.randn(rows, K), torch.randn(N, K)
    exact = x.double() @ w.double().T
    with torch.no_grad():
        ours = kernels.linear(x, w)
    theirs = F.linear(x, w)
    assert ours.shape == theirs.shape and ours.dtype == torch.float32
    bound = max((theirs.double() - exact).abs().max().item(), 1e-6) * 4
    assert (ours.double() - exact).abs().max().item() <= bound


def check_bf16(rows: int, K: int, N: int) -> None:
    """Inputs in bf16, products summed in fp32, the sum rounded to bf16 once: within one bf16
    rounding (2^-8 relative) of the exact result over the same bf16 inputs."""
    torch.manual_seed(rows * K + N)
    x, w = torch.randn(rows, K).bfloat16(), torch.randn(N, K).bfloat16()
    exact = x.double() @ w.double().T
    with torch.no_grad():
        ours = kernels.linear(x, w)
    assert ours.dtype == torch.bfloat16
    assert ((ours.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4 * K**0.5).all()


BF16_SHAPES = [(320, 1000), (577, 13), (64, 300), (7, 3), (96, 5)]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("K,N", BF16_SHAPES)
def test_bf16_is_fp32_accumulated_and_rounded_once(rows, K, N):
    """(Odd widths and widths below a vector take the kernel's tails: a bf16 row is read in
    pairs of weights, against x's even and odd elements.)"""
    check_bf16(rows, K, N)


def test_the_avx2_paths_equal_the_references_too():
    """EGMLA_KERNELS_AVX512=0 takes the AVX2 rows on an AVX-512 machine (read once per
    process, so in a process of its own): the same checks, fp32 and bf16."""
    code = ("import sys; sys.path.insert(0, 'tests'); from core.test_kernels import check_bf16, "
            "BF16_SHAPES, test_fp32_matches_a_float64_reference_as_closely_as_f_linear as fp32\n"
            "for rows in (1, 2, 3, 4, 5):\n"
            "    for K, N in BF16_SHAPES: check_bf16(rows, K, N); fp32(rows, K, N)")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "EGMLA_KERNELS_AVX512": "0"}, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


def test_leading_dimensions_and_bias_are_kept():
    x, w, b = torch.randn(2, 1, 48), torch.randn(24, 48), torch.randn(24)
    with torch.no_grad():
        assert torch.allclose(kernels.linear(x, w, b), F.linear(x, w, b), atol=1e-5)


def test_training_keeps_pytorchs_path_and_its_gradients():
    x = torch.randn(1, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    kernels.linear(x, w).sum().backward()
    assert torch.allclose(x.grad, w.sum(0).detach()) and torch.allclose(w.grad, x.detach().expand(16, 32))


def test_many_rows_and_other_dtypes_go_to_f_linear():
    """Past MAX_ROWS (prefill, training batches) and in float64 the result is F.linear's, bit
    for bit."""
    w = torch.randn(40, 24)
    with torch.no_grad():
        many = torch.randn(kernels.MAX_ROWS[torch.float32] + 1, 24)
        assert torch.equal(kernels.linear(many, w), F.linear(many, w))
        x64 = torch.randn(1, 24, dtype=torch.float64)
        assert torch.equal(kernels.linear(x64, w.double()), F.linear(x64, w.double()))


def test_bf16_products_of_many_rows_run_in_fp32_where_the_cpu_lacks_native_bf16():
    """Past the kernel's rows, a bf16 product on a CPU without AVX512-BF16/AMX is the widened
    fp32 product rounded once (bit for bit), which is also what PyTorch's bf16 matmul computes
    (to its rounding); with native bf16, or with gradients, it is PyTorch's own."""
    torch.manual_seed(3)
    x = torch.randn(kernels.MAX_ROWS[torch.bfloat16] + 9, 96).bfloat16()
    w = torch.randn(80, 96).bfloat16()
    with torch.no_grad():
        ours = kernels.linear(x, w)
        widened = F.linear(x.float(), w.float()).bfloat16()
        native = F.linear(x, w)
    assert torch.equal(ours, native if kernels.native_bf16() else widened)
    assert torch.allclose(ours.float(), native.float(), rtol=2**-7, atol=1e-2)
    assert kernels.status()["native_bf16"] == kernels.native_bf16()
    wg = w.clone().requires_grad_()
    assert torch.equal(kernels.linear(x, wg).detach(), F.linear(x, w))


def test_a_models_decode_step_runs_its_linears_on_the_kernel():
    """The model's layers are egmla's Linear: at one token per row they call the kernel, at
    prefill they do not; the state dict is nn.Linear's."""
    from egmla.models import Transformer
    from egmla.presets import preset

    model = Transformer(preset("tiny-mha")).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, kernels.MAX_ROWS[torch.float32] + 8))
    with torch.no_grad():
        decode, prefill = ops_called(lambda: model(ids[:, :1])), ops_called(lambda: model(ids))
    assert ("egmla::gemv" in decode) == SUPPORTED and "egmla::gemv" not in prefill
    assert "aten::linear" in prefill
    assert all(k.endswith(".weight") or "norm" in k for k in model.state_dict())


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **env}, timeout=300, check=False)


def test_egmla_kernels_0_turns_the_fast_path_off():
    out = run_python("from egmla import kernels; print(kernels.load(), kernels.status()['reason'])",
                     EGMLA_KERNELS="0")
    assert out.returncode == 0 and out.stdout.split(None, 1) == ["False", "turned off by EGMLA_KERNELS\n"]


def test_a_failing_build_warns_once_and_falls_back(tmp_path):
    """No compiler: a warning naming it (on a CPU that could run the kernels), F.linear's
    results, exit 0; nothing half-written."""
    code = ("import torch, warnings; from egmla import kernels\n"
            "with torch.no_grad(): y = kernels.linear(torch.ones(1, 8), torch.ones(2, 8))\n"
            "print(y.tolist(), kernels.status()['loaded'])")
    out = run_python(code, CXX=str(tmp_path / "no-such-compiler"), EGMLA_KERNELS_DIR=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[[8.0, 8.0]] False"
    assert ("CPU kernels unavailable" in out.stderr and "no-such-compiler" in out.stderr) == SUPPORTED
    assert "Traceback" not in out.stderr
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_status_and_build_commands():
    out = subprocess.run([sys.executable, "-m", "egmla.kernels", "status"], capture_output=True,
                         text=True, cwd=ROOT, check=False)
    assert out.returncode == 0 and '"loaded": ' + ("true" if SUPPORTED else "false") in out.stdout
    bad = subprocess.run([sys.executable, "-m", "egmla.kernels", "compile"], capture_output=True,
                         text=True, cwd=ROOT, check=False)
    assert bad.returncode == 2 and "invalid choice: 'compile'" in bad.stderr


def test_linears_is_one_pass_over_weights_that_share_an_input():
    """The fused projections (Q, K, V; gate, up) equal one F.linear each, with or without the
    kernel, including weights of a few rows that a thread's run of blocks spans."""
    torch.manual_seed(1)
    x = torch.randn(1, 3, 40)
    ws = [torch.randn(n, 40) for n in (7, 300, 1, 64)]
    with torch.no_grad():
        ours = kernels.linears(x, ws)
    assert [y.shape for y in ours] == [(1, 3, n) for n in (7, 300, 1, 64)]
    for y, w in zip(ours, ws):
        assert torch.allclose(y, F.linear(x, w), atol=1e-5)


def reference_attention(q, k_pool, v_pool, slots, lengths, scale):
    """softmax(q . k * scale) . v in float64 over each row's first lengths[b] slots (GQA)."""
    B, H, _ = q.shape
    R = H // k_pool.shape[1]
    out = torch.empty(B, H, v_pool.shape[-1], dtype=torch.float64)
    for b in range(B):
        keys = slots[b, : lengths[b]]
        for h in range(H):
            k, v = k_pool[keys, h // R].double(), v_pool[keys, h // R].double()
            out[b, h] = torch.softmax(k @ q[b, h].double() * scale, 0) @ v
    return out


@pytest.mark.skipif(not SUPPORTED, reason="the kernels need x86-64 with AVX2 and FMA")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lengths,D", [([300], 64), ([5, 700, 129], 64), ([1, 2], 12), ([257], 20)])
def test_paged_attention_equals_a_float64_softmax_over_long_and_ragged_rows(lengths, D, pool_dtype,
                                                                            threads):
    """A row's keys are cut into chunks whose softmaxes are merged (several per row, rows shorter
    than a chunk's start, one thread or two); the vectorized exp and the eight-keys-at-a-time
    scores (D a multiple of 8) and their scalar tails (D 12, 20) all equal float64's softmax."""
    torch.manual_seed(len(lengths) + D)
    B, H, G, slots_n = len(lengths), 6, 2, 2048
    k_pool = (torch.randn(slots_n, G, D) * 2).to(pool_dtype)  # scores spread over ~+-30
    v_pool = torch.randn(slots_n, G, D).to(pool_dtype)
    S = max(lengths)
    slots = torch.stack([torch.randperm(slots_n)[:S] for _ in range(B)])  # scattered slots
    q = torch.randn(B, H, D)
    with torch_threads(threads):
        out = kernels.paged_attention(q, k_pool, v_pool, slots, torch.tensor(lengths), 0.4)
    ref = reference_attention(q, k_pool, v_pool, slots, lengths, 0.4)
    assert (out.double() - ref).abs().max() < 2e-5


@pytest.mark.skipif(not SUPPORTED, reason="the kernels need x86-64 with AVX2 and FMA")
def test_the_fused_block_refuses_inconsistent_inputs_with_a_message():
    """decode_block checks what it is handed (shapes, dtypes, slots) before touching memory."""
    assert kernels.load()
    D, Dh, G, F_ = 32, 8, 2, 48
    w = {"wq": torch.randn(4 * Dh, D), "wk": torch.randn(G * Dh, D), "wv": torch.randn(G * Dh, D),
         "wo": torch.randn(D, 4 * Dh), "w_gate": torch.randn(F_, D), "w_up": torch.randn(F_, D),
         "w_down": torch.randn(D, F_)}
    pools = [torch.zeros(16, G, Dh), torch.zeros(16, G, Dh)]

    def call(**over):
        m = {"x": torch.randn(1, D), "new": torch.tensor([2]), "slots": torch.tensor([[0, 1, 2]]),
             **w, **over}
        return torch.ops.egmla.decode_block(
            m["x"], torch.ones(D), 1e-5, m["wq"], m["wk"], m["wv"], m["wo"], torch.ones(D), 1e-5,
            m.get("activation", 0), m["w_gate"], m["w_up"], m["w_down"], torch.ones(1, Dh),
            torch.zeros(1, Dh), *pools, m["new"], m["slots"], torch.tensor([3]), 0.3,
            **m.get("sparse", {}))

    out, computed = call()
    assert out.shape == (1, D) and computed == F_ and pools[0][2].any()  # a good call writes K
    for pool in pools:
        pool.zero_()
    for bad, message in [({"wo": torch.randn(D, 3 * Dh)}, "wo is"),
                         ({"w_up": torch.randn(F_, D).bfloat16()}, "x's dtype"),
                         ({"new": torch.tensor([1])}, "is not its last key's"),
                         ({"slots": torch.tensor([[0, 1, 99]])}, "names slot 99"),
                         ({"x": torch.randn(1, D).double()}, "float32 or bfloat16"),
                         ({"activation": 7}, "activation 7 is not"),
                         ({"activation": 3}, "relu2 has no gate"),
                         ({"w_gate": None}, "a gated MLP needs w_gate"),
                         ({"sparse": {"p_w1": torch.randn(4, D), "p_w2": torch.randn(F_, 4),
                                      "p_bias": torch.zeros(F_)}}, "needs the sparse MLP"),
                         ({"sparse": {"down_t": torch.randn(D, F_)}}, "down_t is"),
                         ({"sparse": {"down_t": torch.randn(F_, D), "threshold": -1.0}},
                          "threshold -1"),
                         ({"sparse": {"down_t": torch.randn(F_, D), "p_w1": torch.randn(4, D),
                                      "p_w2": torch.randn(F_, 4)}}, "together"),
                         ({"sparse": {"down_t": torch.randn(F_, D), "hot": F_ + 1}}, "hot=49")]:
        with pytest.raises(RuntimeError, match=message):
            call(**bad)
    assert not pools[0].any()  # nothing written by a refused call
