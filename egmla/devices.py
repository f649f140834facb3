"""Where a model runs: one parser for every entry point that takes a device (LLM, the server's
--device, the lm-eval adapter's device=, load_pretrained), so each refuses the same way; and
what the hardware computes fast (native bf16), for the kernels and training's precision."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch


def parse_device(device: str | torch.device | None, name: str = "device") -> torch.device | None:
    """The device asked for, refused (ValueError naming `name`) unless a model can run there;
    None when none was asked for. "cuda" means the current CUDA device."""
    if device is None:
        return None
    try:
        wanted = torch.device(device)
    except (RuntimeError, TypeError):
        wanted = None
    if wanted is None or wanted.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}={device!r}: expected cpu, cuda or cuda:N")
    if wanted.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"{name}={device!r}: CUDA is not available on this machine "
                         "(torch.cuda.is_available() is False); run on the CPU (device cpu)")
    index = torch.cuda.current_device() if wanted.index is None else wanted.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"{name}={device!r}: this machine has {torch.cuda.device_count()} "
                         "CUDA device(s)")
    return torch.device("cuda", index)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def thread_count(text: str) -> int:
    """argparse type of every `--threads` option: torch's CPU threads, from 1 to the CPUs this
    process may run on (more only slow torch down, and OpenMP fails to create thousands: a
    segmentation fault at --threads 100000)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not an integer") from None
    if not 1 <= value <= usable_cpus():
        raise argparse.ArgumentTypeError(f"{text}: must be from 1 to {usable_cpus()}, the CPUs "
                                         f"this process may run on")
    return value


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), so that PyTorch's bf16
    matmul is fast; read from /proc/cpuinfo's flags (False where there is none). Without it
    PyTorch's bf16 products are slow: 20x float32's time for a 1024 x 576 by 576 x 576 product
    on an AVX2 EPYC (2026-12-06)."""
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def _on_gpu(accelerator: str) -> bool:
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def training_precision(precision: str, accelerator: str) -> str:
    """`trainer.precision` as Lightning takes it. "auto": bf16-mixed where the accelerator
    computes bf16 natively (a CUDA device that supports it; a CPU with AVX512-BF16 or AMX),
    else 32-true. Any other value is returned as given."""
    if precision != "auto":
        return precision
    if _on_gpu(accelerator):
        native = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    else:
        native = native_bf16()
    return "bf16-mixed" if native else "32-true"


def slow_precision_note(precision: str, accelerator: str) -> str | None:
    """A warning when `precision` (resolved) asks a CPU without native bf16 for bf16, else None."""
    if "bf16" not in str(precision) or _on_gpu(accelerator) or native_bf16():
        return None
    return (f"trainer.precision={precision} on a CPU without native bf16 (no avx512_bf16 or "
            "amx_bf16 in /proc/cpuinfo): PyTorch's bf16 matmul is slow here (20x float32's time "
            "on an AVX2 EPYC); trainer.precision=auto chooses 32-true on such a CPU")
