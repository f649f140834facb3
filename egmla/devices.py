"""Where a model runs: one parser for every entry point that takes a device (LLM, the server's
--device, the lm-eval adapter's device=, load_pretrained), so each refuses the same way."""

from __future__ import annotations

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
