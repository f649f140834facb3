"""CPU kernels of our own, compiled once with the system C++ compiler and loaded as a PyTorch
operator library. Every caller keeps the plain PyTorch path as its fallback, so a machine with
no compiler (or a CPU without AVX2 and FMA) runs the same code, only slower.

    python -m egmla.kernels build      # compile now (scripts/setup.sh does this)
    python -m egmla.kernels status     # what is built, where, and whether it is used

`linear(x, weight, bias)` is `F.linear` with a decode fast path: when x has at most
`MAX_ROWS[dtype]` rows (one token, or a batch of decodes), no gradient is wanted, and x and the
weight are float32 or bfloat16 on the CPU, it calls `torch.ops.egmla.gemv` (decode.cpp), which
streams the weight once on all of PyTorch's threads; PyTorch's own kernel for one row runs on
one thread at about half the machine's read bandwidth, and up to 64 rows (fp32; bf16: 8 where
PyTorch multiplies bf16 natively, else 64) ours stays faster (benchmarks/kernel_rows.py
measures both by row count). The result equals F.linear's up to the
order of a float sum. On a CPU without native bf16 arithmetic (no AVX512-BF16 or AMX),
PyTorch's bf16 matmul is 4-6x slower than fp32's, so bf16 products of more rows (a prefill)
widen the weight to fp32 for the product and round the result once: the same arithmetic
(bf16 weights are exact in fp32, and PyTorch accumulates bf16 in fp32 too).

`paged_attention(...)` is a decode step's attention read in place from the paged KV cache's
pools (serve/paged_cache.py), instead of gathering every row's history into a padded copy per
layer and masking it.

`decode_blocks(...)` runs pre-norm Llama blocks (RMSNorm, RoPE attention over the paged cache,
the MLP) for a decode step, one kernel call per block: at one token a layer's ~40 PyTorch
operator calls cost more than their arithmetic, and this is the same arithmetic without them.
The blocks' weights are checked once (`block_weights`), not on every step. The MLP is any
of the model's activations (SwiGLU, ReGLU, dReLU, squared ReLU), dense or sparse.

`sparse_mlp(x, mlp)` is a decode step's MLP over only the neurons that fire (activation
locality, egmla.models.sparse_ffn): "gate" mode runs the deciding projection for every neuron
and the rest of the MLP for those above the threshold; "predicted" mode runs a hot block and
what a low-rank predictor marks. Only the computed neurons' weight rows are read.

The library is built into egmla/kernels/_build/<key>/ (or $EGMLA_KERNELS_DIR, or
$EGMLA_CACHE/kernels where the package directory is read-only), keyed by the source, the
compiler flags, the compiler and the torch version, so a new torch or an edited kernel rebuilds.
EGMLA_KERNELS=0 turns the fast path off (the A/B switch of the benchmarks); CXX picks the
compiler (default c++); EGMLA_KERNELS_AVX512=0 keeps the kernels to AVX2 on an AVX-512 CPU.

`place_weights(model)` (egmla/kernels/placement.py) moves a model's weights onto transparent
huge pages, in the order a decode step reads them; the serving executor does it on the CPU.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from egmla import files
from egmla.devices import native_bf16
from egmla.kernels.placement import huge_zeros, hugepages, place_weights  # noqa: F401 - re-exported
from egmla.paths import cache_dir

SOURCE = Path(__file__).with_name("decode.cpp")
LIBRARY = "libegmla_kernels.so"
# Rows up to which a block-quantized product takes the kernel: it stays faster than
# dequantizing the weight for PyTorch's matmul well past a decode batch (over SmolLM2's MLP
# shapes, interleaved: 0.21x the time at 16 rows, 0.49x at 128 and 0.73x at 256 for Q8_0;
# 0.15x, 0.59x and 0.84x for Q4_1), so short prefills take it too.
QUANT_MAX_ROWS = 256
DTYPES = (torch.float32, torch.bfloat16)
Q8_BLOCK = 32  # values per block of a Q8_0 weight (egmla.quant) and of its activations
FLAGS = ("-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w")


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be compiled (the message carries the compiler's output)."""


def unsupported() -> str | None:
    """Why this machine cannot run the kernels, or None when it can."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the kernels are written for x86-64 Linux, not {sys.platform}/{platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2 and FMA (PyTorch reports {capability})"
    return None


def _torch_dirs() -> tuple[Path, Path]:
    root = Path(torch.__file__).resolve().parent
    return root / "include", root / "lib"


def _command(output: Path) -> list[str]:
    include, lib = _torch_dirs()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [os.environ.get("CXX") or "c++", *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-I{include}", str(SOURCE), "-o", str(output), f"-L{lib}", "-ltorch_cpu", "-lc10",
            f"-Wl,-rpath,{lib}"]


def build_dir() -> Path:
    """Where libraries are built: $EGMLA_KERNELS_DIR; else beside the source (egmla/kernels/
    _build/, so one build serves every $EGMLA_CACHE, as tests set their own) when that is
    writable; else $EGMLA_CACHE/kernels."""
    if os.environ.get("EGMLA_KERNELS_DIR"):
        return Path(os.environ["EGMLA_KERNELS_DIR"])
    beside = SOURCE.parent / "_build"
    if os.access(beside if beside.is_dir() else SOURCE.parent, os.W_OK):
        return beside
    return cache_dir() / "kernels"


def library_path() -> Path:
    """Where the library for this source, these flags, this compiler and this torch lives."""
    key = hashlib.sha256()
    key.update(SOURCE.read_bytes())
    key.update(" ".join((*FLAGS, torch.__version__, os.environ.get("CXX") or "c++")).encode())
    return build_dir() / key.hexdigest()[:16] / LIBRARY


def build(force: bool = False) -> Path:
    """Compile the kernels (unless built already) and return the library's path. Written to a
    temporary file and renamed, so a concurrent or interrupted build never leaves half a file."""
    target = library_path()
    if target.is_file() and not force:
        return target
    with files.atomic_path(target, suffix=".so", parents=True) as partial:
        command = _command(partial)
        try:
            done = subprocess.run(command, capture_output=True, text=True, check=False)
        except OSError as error:  # no compiler at all
            raise KernelBuildError(f"cannot run the C++ compiler {command[0]!r}: {error}") from None
        if done.returncode != 0:
            raise KernelBuildError(f"{' '.join(command)} failed (exit {done.returncode}):\n"
                                   f"{done.stderr[-3000:]}")
    return target


_lock = threading.Lock()
_state: dict[str, object] = {}  # "loaded": bool, "reason": why not, "path": the library


def load() -> bool:
    """Load the kernels once (building them first if needed); False, with the reason in
    `status()`, when they are off, unsupported or fail to build: callers then use PyTorch."""
    if "loaded" in _state:
        return bool(_state["loaded"])
    with _lock:
        if "loaded" not in _state:
            _state.update(_load())
    return bool(_state["loaded"])


def _load() -> dict[str, object]:
    if os.environ.get("EGMLA_KERNELS", "1").strip().lower() in ("0", "off", "false", "no"):
        return {"loaded": False, "reason": "turned off by EGMLA_KERNELS"}
    reason = unsupported()
    if reason:
        return {"loaded": False, "reason": reason}
    path = library_path()
    try:
        if not path.is_file():
            print(f"egmla: building the CPU kernels once into {path.parent} (about 20 s)",
                  file=sys.stderr, flush=True)
            path = build()
        if not hasattr(torch.ops.egmla, "gemv"):  # a second copy of the library cannot register
            torch.ops.load_library(str(path))
            # shapes without running it, so torch.compile can trace a model that calls it
            torch.library.register_fake("egmla::gemv")(
                lambda x, w: x.new_empty(x.shape[0], w.shape[0]))
            torch.library.register_fake("egmla::gemv_quant")(
                lambda x, w: x.new_empty(x.shape[0], w[0].shape[0]))
            torch.library.register_fake("egmla::gemv_many")(
                lambda x, ws: [x.new_empty(x.shape[0], w.shape[0]) for w in ws])
            torch.library.register_fake("egmla::paged_attention")(
                lambda q, k, v, slots, lengths, scale: q.new_empty(*q.shape[:2], v.shape[-1]))
            torch.library.register_fake("egmla::paged_latent_attention")(
                lambda q, c, r, slots, lengths, scale: q.new_empty(*q.shape[:2], c.shape[-1]))
            torch.library.register_fake("egmla::paged_gated_attention")(
                lambda m, q_mu, *rest: (torch.empty_like(m), torch.empty_like(q_mu)))
            # (the count of MLP neurons computed is data-dependent: an unbacked size)
            torch.library.register_fake("egmla::decode_block")(
                lambda x, *rest: (torch.empty_like(x), torch.library.get_ctx().new_dynamic_size()))
            torch.library.register_fake("egmla::decode_block_quant")(
                lambda x, *rest: (torch.empty_like(x), torch.library.get_ctx().new_dynamic_size()))
            torch.library.register_fake("egmla::sparse_mlp")(
                lambda x, activation, w_gate, w_up, down_t, *rest: (
                    x.new_empty(x.shape[0], down_t.shape[1]),
                    torch.library.get_ctx().new_dynamic_size()))
    except (KernelBuildError, OSError, RuntimeError) as error:
        warnings.warn(f"egmla: CPU kernels unavailable, using PyTorch's: {error}", stacklevel=3)
        return {"loaded": False, "reason": str(error).splitlines()[0]}
    return {"loaded": True, "reason": None, "path": str(path)}


def status() -> dict[str, object]:
    """Whether the kernels are in use, and if not, why."""
    load()
    return {"loaded": _state["loaded"], "reason": _state["reason"],
            "library": _state.get("path") or str(library_path()),
            "max_rows": {str(d).removeprefix("torch."): n for d, n in MAX_ROWS.items()},
            "native_bf16": native_bf16(),
            "threads": torch.get_num_threads()}


# Rows of x up to which the kernel takes the product, at or below where it stops being faster
# than PyTorch's matmul over SmolLM2's decode linears (benchmarks/kernel_rows.py,
# results/kernel_rows.md; 2-core AVX-512 EPYC with AVX512-BF16, 2026-12-05): fp32 3.9x at 1 row,
# 1.87x at 16, 1.25x at 64, 1.13x at 96; bf16, against PyTorch's native bf16 matmul, 3.2x at 1,
# 1.21x at 8, 0.98x at 12. Where the CPU has no native bf16 PyTorch widens bf16 to fp32, and the
# kernel measured 1.55x at 64 rows and 1.10x at 128 (an AVX2 EPYC, the record before it).
MAX_ROWS = {torch.float32: 64, torch.bfloat16: 8 if native_bf16() else 64}


def _rows_for_kernel(x: torch.Tensor, weights: Sequence[torch.Tensor], quantized: bool = False
                     ) -> int:
    """x's rows when the kernel may take x @ w.T for every w (`quantized`: for block-quantized
    weights, up to QUANT_MAX_ROWS rows), else 0."""
    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    if x.dtype not in DTYPES or x.device.type != "cpu":
        return 0
    if not 0 < rows <= (QUANT_MAX_ROWS if quantized else MAX_ROWS[x.dtype]):
        return 0
    grad = torch.is_grad_enabled()
    if grad and x.requires_grad:
        return 0
    for w in weights:
        if (w.dtype != x.dtype or w.device.type != "cpu" or not w.is_contiguous()
                or (grad and w.requires_grad)):
            return 0
    return rows if load() else 0


def _widened(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether F.linear(x, weight) should run in fp32 on bf16 tensors (see the module doc)."""
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and not native_bf16())


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch's F.linear, widened to fp32 for bf16 on a CPU without native bf16."""
    if not _widened(x, weight):
        return F.linear(x, weight, bias)
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(torch.bfloat16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the kernel when x has few rows (see the module doc).
    A block-quantized weight (egmla.quant.QuantWeight) takes its product (`quant_linear`)."""
    if not isinstance(weight, torch.Tensor):
        y = quant_linear(x, weight)
        return y if bias is None else y + bias
    rows = _rows_for_kernel(x, (weight,))
    if not rows:
        return _matmul(x, weight, bias)
    y = torch.ops.egmla.gemv(x.reshape(rows, x.shape[-1]).contiguous(), weight)
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def linears(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """[F.linear(x, w) for w in weights] (no biases): several projections of one input, such as
    a layer's Q, K and V, in one pass of the kernel over all their rows, so that small weights
    (a GQA layer's K and V) still read on every thread."""
    if not all(isinstance(w, torch.Tensor) for w in weights):
        return [linear(x, w) for w in weights]
    rows = _rows_for_kernel(x, weights)
    if not rows:
        return [_matmul(x, w) for w in weights]
    ys = torch.ops.egmla.gemv_many(x.reshape(rows, x.shape[-1]).contiguous(), list(weights))
    return [y.view(*x.shape[:-1], w.shape[0]) for y, w in zip(ys, weights)]


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) float as the kernel sees it: per block of 32, dx = max|x| / 127 and
    q = round(x * (127 / max|x|)) (half to even), returned as dx * q in float32."""
    blocks = x.float().unflatten(-1, (-1, Q8_BLOCK))
    amax = blocks.abs().amax(-1, keepdim=True).double()  # divisions rounded once, as C's
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)).float()
    dx = (amax / 127.0).float()
    return (torch.round(blocks * inv) * dx).flatten(-2)


def quant_matmul(x: torch.Tensor, weight) -> torch.Tensor:
    """x @ w.T for a block-quantized weight (egmla.quant.QuantWeight) in PyTorch with the
    kernel's arithmetic (activations quantized per block), in float32, returned in x's dtype:
    the path for many rows."""
    return (quantize_activations(x) @ weight.dequantize(torch.float32).T).to(x.dtype)


def quant_linear(x: torch.Tensor, weight) -> torch.Tensor:
    """x @ w.T for a block-quantized weight: the kernel for up to QUANT_MAX_ROWS rows on the
    CPU, else the same arithmetic in PyTorch (`quant_matmul`)."""
    return gemv_quant(x, weight) if _rows_for_kernel(x, (), quantized=True) else quant_matmul(x, weight)


def gemv_quant(x: torch.Tensor, weight) -> torch.Tensor:
    """x @ w.T for a Q8_0, Q4_0 or Q4_1 weight (`egmla.quant.QuantWeight`) and x (..., K)
    float32 or bfloat16 on the CPU, the activations quantized per 32-value block as llama.cpp
    quantizes them for these products (decode.cpp). Raises RuntimeError where the kernels are
    unavailable."""
    if not load():
        raise RuntimeError(f"egmla: the CPU kernels are unavailable ({_state['reason']}); "
                           "quantized weights need them")
    K = x.shape[-1]
    y = torch.ops.egmla.gemv_quant(x.reshape(-1, K).contiguous(), weight.tensors())
    return y.view(*x.shape[:-1], weight.shape[0])


def paged_attention_runs(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Whether `paged_attention` can take these tensors here."""
    return (q.device.type == "cpu" and k_pool.device.type == "cpu" and k_pool.dtype in DTYPES
            and v_pool.dtype == k_pool.dtype and k_pool.dim() == 3 and v_pool.dim() == 3
            and not (torch.is_grad_enabled() and q.requires_grad) and load())


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    slots: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention read in place from a paged cache's pools (where `paged_attention_runs`).

    q (B, H, D): each row's one query (its newest token); k_pool (slots, G, D) and v_pool
    (slots, G, Dv) in float32 or bfloat16; slots (B, S) int64, of which row b's first
    lengths[b] are its keys in order; -> (B, H, Dv) in q's dtype. Query head h reads K/V head
    h // (H / G). Softmax and sums in float32."""
    if not load():
        raise RuntimeError(f"egmla kernels unavailable: {_state['reason']}")
    out = torch.ops.egmla.paged_attention(q.float().contiguous(), k_pool, v_pool, slots, lengths,
                                          float(scale))
    return out.to(q.dtype)


def paged_latent_attention_runs(q: torch.Tensor, c_pool: torch.Tensor, r_pool: torch.Tensor) -> bool:
    """Whether `paged_latent_attention` can take these tensors here."""
    return (q.device.type == "cpu" and c_pool.device.type == "cpu" and c_pool.dtype in DTYPES
            and r_pool.dtype == c_pool.dtype and c_pool.dim() == 2 and r_pool.dim() in (2, 3)
            and not (torch.is_grad_enabled() and q.requires_grad) and load())


def paged_latent_attention(q: torch.Tensor, c_pool: torch.Tensor, r_pool: torch.Tensor,
                           slots: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """MLA's absorbed decode attention read in place from a paged cache's pools (where
    `paged_latent_attention_runs`): an MQA whose one key is [c, k_rope] and value c.

    q (B, H, C + r): each row's query heads, absorbed (W_UK^T q_nope) then q_rope; c_pool
    (slots, C) and r_pool (slots, r) or (slots, Hr, r), float32 or bfloat16, query head h
    reading RoPE key h // (H / Hr); slots (B, S) int64, of which row b's first lengths[b] are
    its keys; -> (B, H, C) in q's dtype: softmax((q_c . c + q_r . k_rope) * scale) . c.
    Softmax and sums in float32."""
    if not load():
        raise RuntimeError(f"egmla kernels unavailable: {_state['reason']}")
    out = torch.ops.egmla.paged_latent_attention(q.float().contiguous(), c_pool, r_pool, slots,
                                                 lengths, float(scale))
    return out.to(q.dtype)


def paged_gated_attention_runs(c_pool: torch.Tensor, r_pool: torch.Tensor, table: torch.Tensor,
                               stats_pool: torch.Tensor | None, q: torch.Tensor) -> bool:
    """Whether `paged_gated_attention` can take these tensors here (q: a query-side input,
    M or q_rope, whose gradient would be lost)."""
    return (c_pool.device.type == "cpu" and c_pool.dtype in DTYPES and r_pool.dtype == c_pool.dtype
            and c_pool.dim() == 2 and r_pool.dim() in (2, 3) and table.dtype in DTYPES
            and (stats_pool is None or stats_pool.dtype == torch.float32)
            and not (torch.is_grad_enabled() and q.requires_grad) and load())


def paged_gated_attention(m: torch.Tensor, q_mu: torch.Tensor, q_rope: torch.Tensor,
                          c_pool: torch.Tensor, r_pool: torch.Tensor, stats_pool: torch.Tensor | None,
                          id_pool: torch.Tensor, table: torch.Tensor, residual: bool,
                          slots: torch.Tensor, lengths: torch.Tensor, scale: float
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """EG-MLA `kv`'s absorbed decode attention read in place from a paged cache's pools (where
    `paged_gated_attention_runs`; docs/attention.md, "The absorbed kv computation"). With e_j
    the key's gate-table row (table[id_j], then a constant 1 when `residual`) and mu_j, inv_j its
    cached norm statistics (stats_pool: [inv_sigma] or [mu, inv_sigma]; None: 0 and 1):

        s_ij = (inv_j (c_j^T M_i e_j - mu_j q_mu_i) + q_rope_i . k_rope_j) * scale
        A_i = sum_j a_ij inv_j c_j e_j^T,   m_i = sum_j a_ij inv_j mu_j,   a = softmax_j(s)

    m (B, H, C, E') each head's M_i, q_mu (B, H), q_rope (B, H, r); c_pool (slots, C), r_pool
    (slots, r) or (slots, Hr, r), float32 or bfloat16; id_pool (slots,) int32; table (vocab, E)
    float32 or bfloat16; slots (B, S) int64, of which row b's first lengths[b] are its keys.
    -> A (B, H, C, E') and m (B, H) in m's dtype; products and softmax in float32."""
    if not load():
        raise RuntimeError(f"egmla kernels unavailable: {_state['reason']}")
    a, msum = torch.ops.egmla.paged_gated_attention(
        m.float().contiguous(), q_mu.float().contiguous(), q_rope.float().contiguous(), c_pool,
        r_pool, stats_pool, id_pool, table.contiguous(), bool(residual), slots, lengths, float(scale))
    return a.to(m.dtype), msum.to(m.dtype)


ACTIVATIONS = {"swiglu": 0, "reglu": 1, "drelu": 2, "relu2": 3}  # decode.cpp's codes


@dataclass(frozen=True)
class Sparse:
    """How a sparse MLP decodes (egmla.models.sparse_ffn states the semantics): neurons fire
    above `threshold`; with a `predictor` (w1, w2, bias, float32) the first `hot` neurons and
    those it predicts are computed ("predicted" mode), else those whose deciding projection,
    computed for every neuron, fires ("gate" mode). down_t: the down projection transposed."""

    down_t: torch.Tensor
    threshold: float = 0.0
    hot: int = 0
    predictor: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def args(self) -> tuple:
        return (self.down_t, float(self.threshold), self.hot, *(self.predictor or (None,) * 3))


@dataclass(frozen=True)
class MLP:
    """An MLP as the kernels take it: its activation (swiglu, reglu, drelu, relu2), its weights
    as nn.Linear keeps them (gate None for relu2), and, for a sparse decode, how."""

    activation: str
    gate: torch.Tensor | None
    up: torch.Tensor
    down: torch.Tensor
    sparse: Sparse | None = None

    def weights(self) -> tuple[torch.Tensor, ...]:
        return tuple(w for w in (self.gate, self.up, self.down) if w is not None)

    def args(self) -> tuple:
        return (ACTIVATIONS[self.activation], self.gate, self.up, self.down)


@dataclass(frozen=True)
class BlockWeights:
    """A pre-norm block's weights as `decode_blocks` hands them to the kernel, checked once by
    `block_weights` (a model keeps them while its parameters stand): `args`, the kernel's
    arguments from the attention norm's weight to the MLP's down projection; `scale`, the
    attention's; `dtype`, every weight's."""

    args: tuple
    scale: float
    dtype: torch.dtype
    op: str = "decode_block"  # decode_block_quant for quantized weights (each [qs, d(, m)])

    def tensors(self) -> tuple[torch.Tensor, ...]:
        flat = [t for a in self.args for t in (a if isinstance(a, list) else [a])]
        return tuple(t for t in flat if isinstance(t, torch.Tensor))


def block_weights(norms: Sequence[torch.nn.Module], attention: Sequence[torch.Tensor], mlp: MLP,
                  scale: float) -> BlockWeights | None:
    """The weights of a block `h = x + attn(norm1(x)); out = h + mlp(norm2(h))` for
    `decode_blocks`, or None where the kernel cannot take them (not one float32 or bfloat16
    dtype, not contiguous, not on the CPU, or no kernels here). norms: the two RMSNorm modules
    (`weight`, `eps`); attention: wq, wk, wv, wo of RoPE attention; mlp: its dense weights (a
    sparse decoding rides with each step, see `decode_blocks`)."""
    attn_norm, mlp_norm = norms
    if not isinstance(attention[0], torch.Tensor):
        return _quant_block_weights(norms, attention, mlp, scale)
    weights = (attn_norm.weight, *attention, mlp_norm.weight, *mlp.weights())
    dtype = weights[0].dtype
    if dtype not in DTYPES or not all(w.dtype == dtype and w.device.type == "cpu" and w.is_contiguous()
                                      for w in weights) or not load():
        return None
    return BlockWeights((attn_norm.weight, attn_norm.eps, *attention, mlp_norm.weight, mlp_norm.eps,
                         *mlp.args()), float(scale), dtype)


def _quant_block_weights(norms: Sequence[torch.nn.Module], attention: Sequence, mlp: MLP,
                         scale: float) -> BlockWeights | None:
    """block_weights for block-quantized weights (egmla.quant.QuantWeight, read by duck type:
    this module sits below egmla.quant): every matrix quantized, on the CPU, float32 norms, a
    dense MLP."""
    attn_norm, mlp_norm = norms
    mats = (*attention, *mlp.weights())
    if (not all(hasattr(w, "tensors") and w.device.type == "cpu" and w.is_contiguous() for w in mats)
            or mlp.sparse is not None or not load()
            or any(n.weight.dtype != torch.float32 for n in norms)):
        return None
    return BlockWeights((attn_norm.weight, attn_norm.eps, *(w.tensors() for w in attention),
                         mlp_norm.weight, mlp_norm.eps, ACTIVATIONS[mlp.activation],
                         [] if mlp.gate is None else mlp.gate.tensors(), mlp.up.tensors(),
                         mlp.down.tensors()), float(scale), torch.float32, op="decode_block_quant")


def decode_blocks(x: torch.Tensor, blocks: Sequence[tuple[BlockWeights, Sparse | None]],
                  cos: Sequence[torch.Tensor], sin: Sequence[torch.Tensor],
                  pools: Sequence[tuple[torch.Tensor, torch.Tensor]], new_slots: torch.Tensor,
                  slots: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, list[int]] | None:
    """Consecutive pre-norm blocks over a decode step, one kernel call each, with the number of
    MLP neurons each computed (all of them, when dense), or None (nothing written) where the
    kernel cannot take the step; the caller then runs its modules.

    x (B, 1, D) with B <= MAX_ROWS[x.dtype] (QUANT_MAX_ROWS for quantized blocks); blocks:
    each block's weights (`block_weights`) and its MLP's sparse decoding for this step (None:
    dense); cos[i], sin[i] (B, Dh) float32 at
    the rows' positions for block i; pools[i]: block i's (k_pool, v_pool) (slots, G, Dh) from
    the paged cache, into which each row's new K and V go at new_slots (B,) before it attends
    over its first lengths[b] slots of slots (B, S)."""
    B, T, D = x.shape
    quantized = all(w.op == "decode_block_quant" for w, _ in blocks)
    if (T != 1 or not blocks or not _rows_for_kernel(x, (), quantized)
            or any(w.dtype != x.dtype for w, _ in blocks)):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for w, _ in blocks for t in w.tensors()):
        return None
    if not all(paged_attention_runs(x, k, v) for k, v in pools):
        return None
    h, computed = x.view(B, D), []
    for (weights, sparse), c, s, (k_pool, v_pool) in zip(blocks, cos, sin, pools):
        op = getattr(torch.ops.egmla, weights.op)
        h, n = op(h, *weights.args, c, s, k_pool, v_pool, new_slots, slots, lengths, weights.scale,
                  *(sparse.args() if sparse else ()))
        computed.append(n)
    return h.view(x.shape), computed


def sparse_mlp(x: torch.Tensor, mlp: MLP) -> tuple[torch.Tensor, int] | None:
    """mlp(x) over only the neurons that fire, for a decode step's rows x (..., D), with the
    number of neurons computed; None where the kernel cannot take it (the caller then runs
    PyTorch's path)."""
    if mlp.sparse is None or not _rows_for_kernel(x, (*mlp.weights(), mlp.sparse.down_t)):
        return None
    D = x.shape[-1]
    y, computed = torch.ops.egmla.sparse_mlp(x.reshape(-1, D).contiguous(), ACTIVATIONS[mlp.activation],
                                             mlp.gate, mlp.up, *mlp.sparse.args())
    return y.view(x.shape), computed
