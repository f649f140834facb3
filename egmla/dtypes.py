"""Floating-point dtype names, parsed and printed in one place (command lines, exports, reports).

    parse_dtype("bf16", aliases=True) -> torch.bfloat16      dtype_name(torch.bfloat16) -> "bfloat16"
    short_name(torch.bfloat16) -> "bf16"

torch is imported inside the functions only, so a command line can list `WEIGHT_DTYPES` in its
`--help` without loading torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

WEIGHT_DTYPES = ("float32", "bfloat16", "float16")  # what weights and KV caches load in
REPORT_DTYPES = (*WEIGHT_DTYPES, "float8_e4m3fn")  # what the KV-bytes report sizes caches in
SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8"}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the name torch and transformers' configs use)."""
    return str(dtype).removeprefix("torch.")


def short_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bf16"."""
    return SHORT_NAMES[dtype_name(dtype)]


def parse_dtype(name: str, accepted: Sequence[str] = WEIGHT_DTYPES, aliases: bool = False
                ) -> torch.dtype:
    """"bfloat16" (or, with `aliases`, "bf16") -> torch.bfloat16, case-insensitive; a name not in
    `accepted` is a ValueError listing the accepted names."""
    import torch

    names = [n for full in accepted for n in ((SHORT_NAMES[full], full) if aliases else (full,))]
    key = str(name).lower()
    full = next((f for f in accepted if key in (f, SHORT_NAMES[f] if aliases else f)), None)
    if full is None:
        raise ValueError(f"unknown dtype {name!r}; accepted: {', '.join(names)}")
    return getattr(torch, full)


VLLM_NAMES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
              "fp32": "float32"}  # the spellings vLLM's `dtype` takes besides the full names


def parse_model_dtype(dtype: object) -> torch.dtype | None:
    """A model's dtype as vLLM takes it: None or "auto" (the checkpoint's), a torch.dtype, or a
    name ("bfloat16", "bf16", "half", "float", ...). Anything else is a ValueError naming it."""
    import torch

    if dtype is None or (isinstance(dtype, str) and dtype.lower() == "auto"):
        return None
    if isinstance(dtype, torch.dtype):
        if dtype_name(dtype) not in WEIGHT_DTYPES:
            raise ValueError(f"dtype={dtype}: accepted {', '.join(WEIGHT_DTYPES)}")
        return dtype
    if not isinstance(dtype, str):
        raise ValueError(f"dtype={dtype!r}: expected a name such as 'bfloat16' or a torch.dtype")
    name = VLLM_NAMES.get(dtype.lower(), dtype)
    try:
        return parse_dtype(name)
    except ValueError:
        raise ValueError(f"dtype={dtype!r}: accepted auto, {', '.join(WEIGHT_DTYPES)}, "
                         f"{', '.join(VLLM_NAMES)}") from None
