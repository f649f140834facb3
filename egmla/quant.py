"""Block-quantized weights as llama.cpp stores them: Q8_0, Q4_0 and Q4_1, quantized here from
float weights or read as stored from a GGUF file.

A weight (N, K) is cut along K into blocks of 32 values, each with a float16 scale d:

    q8_0   32 int8 q in [-127, 127], w = d q               34 bytes per 32 weights
    q4_0   32 4-bit q in [0, 15],    w = d (q - 8)          18 bytes
    q4_1   32 4-bit q in [0, 15],    w = d q + m            20 bytes (m: a float16 minimum)

The quantization rules are llama.cpp's (`quantize_row_q8_0_ref`, `_q4_0_ref`, `_q4_1_ref`), so a
model quantized here holds the same numbers as llama.cpp's file of the same float weights
(tests compare with the `gguf` package's quantizers):

    q8_0   amax = max |w|, d = amax / 127, q = round_half_away(w / d)
    q4_0   v = the value of largest |w| (the first), d = v / -8, q = min(15, trunc(w / d + 8.5))
    q4_1   d = (max - min) / 15, m = min, q = min(15, trunc((w - min) / d + 0.5))

(divisions by d as multiplications by 1 / d in float32, with the unrounded d; d and m stored
in float16; a constant block has d = 0.) A 4-bit block keeps its 32 values in 16 bytes, value j
in byte j's low nibble and value j + 16 in its high nibble, as ggml does.

Kept as tensors, `qs` ((N, K) int8 for q8_0, (N, K / 2) uint8 for 4 bits), `d` (N, K / 32)
float16 and, for q4_1, `m` (N, K / 32) float16: what the kernel (`egmla.kernels.gemv_quant`)
streams, as many bytes as the file holds.

A model is quantized for inference with `quantize_model(model, method)`: every linear layer of
its blocks and its LM head becomes a `QuantizedLinear` (the head of a 4-bit method in Q8_0, as
llama.cpp keeps its output tensor at a higher precision; the token embedding stays as it is:
a lookup reads one row). `load_gguf_weights(model, path)` instead gives those layers the GGUF
file's own blocks, where the model was converted from that file, checking that they decode to
the model's weights exactly. A product with a quantized weight quantizes the activations per
block to 8 bits, as llama.cpp does, on every path: the kernel for a decode step's few rows,
and for more rows (a prefill) the same arithmetic in PyTorch (`egmla.kernels.quant_matmul`),
so a prompt computed in chunks or at once agrees with itself up to float rounding, except
where that rounding moves an activation across a quantization boundary (one step, amax / 127,
of that activation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from egmla import kernels
from egmla.kernels import Q8_BLOCK

METHODS = ("q8_0", "q4_0", "q4_1")  # what quantize_model takes
FORMATS = METHODS  # the block formats a QuantWeight holds
# serve.LLM's `quantization` (vLLM's argument): a method at load, or "gguf": a GGUF model's own
# quantized tensors (load_gguf_weights)
QUANTIZATIONS = (*METHODS, "gguf")


@dataclass(frozen=True)
class QuantWeight:
    """A block-quantized weight (module docstring): its `format` ("q8_0", "q4_0" or "q4_1"),
    `qs`, `d` and, for q4_1, `m`."""

    format: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format={self.format!r}: expected one of {', '.join(FORMATS)}")
        if (self.m is not None) != (self.format == "q4_1"):
            raise ValueError(f"{self.format}: m is {'needed' if self.m is None else 'not used'}")

    @property
    def shape(self) -> torch.Size:
        n, width = self.qs.shape
        return torch.Size((n, width if self.format == "q8_0" else 2 * width))

    @property
    def dtype(self) -> torch.dtype:
        """qs's integer dtype, so that code checking a weight's float dtype (the fused decode)
        passes it by."""
        return self.qs.dtype

    @property
    def device(self) -> torch.device:
        return self.qs.device

    def tensors(self) -> list[torch.Tensor]:
        """What the kernels take: [qs, d], or [qs, d, m] for q4_1."""
        return [self.qs, self.d] + ([] if self.m is None else [self.m])

    def is_contiguous(self) -> bool:
        return all(t.is_contiguous() for t in self.tensors())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def values(self) -> torch.Tensor:
        """The stored integers q as (N, K / 32, 32) int16, in the weight's order."""
        n, k = self.shape
        if self.format == "q8_0":
            return self.qs.view(n, k // Q8_BLOCK, Q8_BLOCK).to(torch.int16)
        packed = self.qs.view(n, k // Q8_BLOCK, Q8_BLOCK // 2).to(torch.int16)
        return torch.cat((packed & 0x0F, packed >> 4), dim=-1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight (N, K) as `dtype`, computed in float32 as llama.cpp decodes it."""
        q, d = self.values().float(), self.d.float()[..., None]
        if self.format == "q8_0":
            w = q * d
        elif self.format == "q4_0":
            w = (q - 8) * d
        else:
            w = q * d + self.m.float()[..., None]
        return w.reshape(self.shape).to(dtype)


def _blocks(weight: torch.Tensor, method: str) -> torch.Tensor:
    """`weight` (N, K) as float32 blocks (N, K / 32, 32), or ValueError naming what is wrong."""
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(f"quantize {method}: a 2-D float weight, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    n, k = weight.shape
    if k % Q8_BLOCK:
        raise ValueError(f"quantize {method}: the input width {k} is not a multiple of {Q8_BLOCK}")
    return weight.detach().to(torch.float32).reshape(n, k // Q8_BLOCK, Q8_BLOCK)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d in float32, correctly rounded (through float64: PyTorch's CPU division of float32
    may differ from C's in the last bit), 0 where d is 0."""
    return torch.where(d != 0, (1.0 / d.double()).float(), torch.zeros_like(d))


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """4-bit values (N, K / 32, 32) -> (N, K / 2) uint8, value j low and j + 16 high."""
    q = q.to(torch.uint8)
    packed = q[..., : Q8_BLOCK // 2] | (q[..., Q8_BLOCK // 2:] << 4)
    return packed.reshape(q.shape[0], -1).contiguous()


def quantize_q8_0(weight: torch.Tensor) -> QuantWeight:
    """`weight` (N, K), any float dtype, K a multiple of 32, as Q8_0 (module docstring)."""
    w = _blocks(weight, "q8_0")
    d = (w.abs().amax(dim=-1).double() / 127.0).float()
    scaled = (w * _inverse(d)[..., None]).abs()
    whole = torch.floor(scaled)  # roundf, half away from zero, without adding 0.5 in float32
    q = torch.sign(w) * (whole + torch.floor(2 * (scaled - whole)))
    return QuantWeight("q8_0", qs=q.to(torch.int8).reshape(weight.shape).contiguous(),
                       d=d.to(torch.float16).contiguous())


def quantize_q4_0(weight: torch.Tensor) -> QuantWeight:
    """`weight` (N, K), K a multiple of 32, as Q4_0 (module docstring)."""
    w = _blocks(weight, "q4_0")
    extreme = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True))[..., 0]  # the first largest |w|
    d = extreme / -8.0  # exact: a power of two
    q = torch.clamp(torch.trunc(w * _inverse(d)[..., None] + 8.5), max=15)
    return QuantWeight("q4_0", qs=_pack4(q), d=d.to(torch.float16).contiguous())


def quantize_q4_1(weight: torch.Tensor) -> QuantWeight:
    """`weight` (N, K), K a multiple of 32, as Q4_1 (module docstring)."""
    w = _blocks(weight, "q4_1")
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    d = ((high - low).double() / 15.0).float()
    q = torch.clamp(torch.trunc((w - low[..., None]) * _inverse(d)[..., None] + 0.5), max=15)
    return QuantWeight("q4_1", qs=_pack4(q), d=d.to(torch.float16).contiguous(),
                       m=low.to(torch.float16).contiguous())


QUANTIZERS = {"q8_0": quantize_q8_0, "q4_0": quantize_q4_0, "q4_1": quantize_q4_1}
# The LM head's format under a 4-bit method: 8 bits, as llama.cpp keeps its output tensor at a
# higher precision than the blocks' (the shipped SmolLM2 GGUF: Q4_1 blocks, a Q8_0 head). A
# tied head is also the embedding, whose every row a prediction reads.
HEAD_METHOD = {"q4_0": "q8_0", "q4_1": "q8_0"}


class QuantizedLinear(nn.Module):
    """A linear layer (no bias) over a block-quantized weight, for inference: `weight` is the
    QuantWeight (its tensors are buffers, so `model.to(device)` and `state_dict()` carry them)."""

    def __init__(self, weight: QuantWeight) -> None:
        super().__init__()
        self.format = weight.format
        self.register_buffer("qs", weight.qs)
        self.register_buffer("d", weight.d)
        self.register_buffer("m", weight.m)
        self.out_features, self.in_features = weight.shape

    @property
    def weight(self) -> QuantWeight:
        return QuantWeight(self.format, self.qs, self.d, self.m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.format}"


def quantize_model(model: nn.Module, method: str) -> nn.Module:
    """Replace, in place, every bias-free nn.Linear of `model` whose input width is a multiple of
    32 (its blocks' projections and MLPs, its LM head) by a QuantizedLinear of `method` (the LM
    head of a 4-bit method in Q8_0: HEAD_METHOD); the token embedding stays float. Returns
    `model`; for inference only (no gradients)."""
    if method not in METHODS:
        raise ValueError(f"quantization={method!r}: expected one of {', '.join(METHODS)}")
    linears = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and m.bias is None and m.in_features % Q8_BLOCK == 0]
    if not linears:
        raise ValueError(f"quantization={method!r}: the model has no linear layer it can quantize")
    for name, module in linears:
        quantize = QUANTIZERS[HEAD_METHOD.get(method, method) if name == "lm_head" else method]
        _replace(model, name, QuantizedLinear(quantize(module.weight)))
    if hasattr(model, "weights_replaced"):  # kernels' kept weights are read again
        model.weights_replaced()
    return model


# GGUF's names (llama architecture) for a block's linear layers, and its block types we keep
GGUF_LAYERS = {"attn_q": "attn.wq", "attn_k": "attn.wk", "attn_v": "attn.wv",
               "attn_output": "attn.wo", "ffn_gate": "mlp.w_gate", "ffn_up": "mlp.w_up",
               "ffn_down": "mlp.w_down"}
GGUF_TYPES = {"Q8_0": ("q8_0", 34), "Q4_0": ("q4_0", 18), "Q4_1": ("q4_1", 20)}  # bytes per block


def gguf_weight(raw, kind: str) -> QuantWeight:
    """A GGUF tensor's raw blocks (N, bytes) uint8 of block type `kind` as a QuantWeight: per
    block d (float16), for Q4_1 m (float16), then the values, as ggml lays them out."""
    fmt, size = GGUF_TYPES[kind]
    blocks = torch.from_numpy(raw.copy()).view(raw.shape[0], -1, size)
    n = blocks.shape[0]
    half = lambda at: blocks[..., at:at + 2].contiguous().view(torch.float16)[..., 0]  # noqa: E731
    start = 4 if fmt == "q4_1" else 2
    qs = blocks[..., start:].reshape(n, -1)
    return QuantWeight(fmt, qs=(qs.view(torch.int8) if fmt == "q8_0" else qs).contiguous(),
                       d=half(0).contiguous(), m=half(2).contiguous() if fmt == "q4_1" else None)


def _llama_rows(weight: QuantWeight, heads: int) -> QuantWeight:
    """GGUF's Q and K rows back in transformers' order: llama.cpp's converter interleaves each
    head's two RoPE halves, and transformers' loader undoes it; a permutation of whole rows, so
    the blocks move as they are."""
    from egmla.weight_names import gguf_rope_rows

    order = gguf_rope_rows(weight.shape[0], heads)
    return QuantWeight(weight.format, *(t.index_select(0, order).contiguous() if t is not None
                                        else None for t in (weight.qs, weight.d, weight.m)))


def load_gguf_weights(model: nn.Module, path) -> nn.Module:
    """Give `model` (an egmla Transformer converted from the GGUF file at `path`, any float
    dtype) the file's quantized blocks as stored: each linear layer of its blocks, and its LM
    head (the file's output tensor, or its token embedding when the two are tied), whose tensor
    is Q8_0, Q4_0 or Q4_1 becomes a QuantizedLinear of those blocks; float tensors stay float.
    Each one is checked to decode exactly to the model's weight (in the model's dtype), so a
    model that is not the file's conversion raises ValueError naming the first tensor that
    differs. Returns `model`; for inference only."""
    from gguf import GGUFReader  # the hf extra (transformers reads GGUF files through it)

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    wanted = {"lm_head": tensors.get("output.weight", tensors.get("token_embd.weight"))}
    for i in range(len(model.layers)):
        for theirs, ours in GGUF_LAYERS.items():
            wanted[f"layers.{i}.{ours}"] = tensors.get(f"blk.{i}.{theirs}.weight")
    head_size = model.layers[0].attn.wq.weight.shape[0] // model.config.n_heads
    replaced = 0
    for name, tensor in wanted.items():
        if tensor is None or tensor.tensor_type.name not in GGUF_TYPES:
            continue
        linear = model.get_submodule(name)
        weight = gguf_weight(tensor.data, tensor.tensor_type.name)
        if ".attn_q." in tensor.name or ".attn_k." in tensor.name:
            weight = _llama_rows(weight, weight.shape[0] // head_size)
        if (weight.shape != linear.weight.shape
                or not torch.equal(weight.dequantize(linear.weight.dtype), linear.weight)):
            raise ValueError(f"{path}: {tensor.name} ({tensor.tensor_type.name}) does not decode "
                             f"to the model's {name}.weight: the model is not this file's conversion")
        _replace(model, name, QuantizedLinear(weight))
        replaced += 1
    if not replaced:
        raise ValueError(f"{path}: no Q8_0, Q4_0 or Q4_1 tensor of a linear layer to keep quantized")
    if hasattr(model, "weights_replaced"):
        model.weights_replaced()
    return model


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


__all__ = ["FORMATS", "METHODS", "QUANTIZATIONS", "Q8_BLOCK", "QuantWeight", "QuantizedLinear",
           "load_gguf_weights", "quantize_model", "quantize_q4_0", "quantize_q4_1", "quantize_q8_0"]
