"""What produced a result: git SHA, package versions, hardware. Written next to every run,
benchmark and report so that a number can be traced back to the code and machine behind it."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("egmla", "torch", "numpy", "lightning", "hydra-core", "transformers", "tokenizers",
            "datasets", "wandb", "safetensors", "lm-eval")


def git_info(repo: Path = REPO) -> dict[str, Any]:
    """SHA of HEAD and whether the tree has uncommitted changes; None outside a checkout.

    Recorded results (`benchmarks/results/`) do not make the tree dirty: a chain of benchmarks
    run from one commit writes them as it goes, and the code that made them is still HEAD's."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    status = git("status", "--porcelain", "--", ".", ":(exclude)benchmarks/results")
    return {"sha": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in packages:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def machine_memory_bytes() -> int | None:
    """The machine's physical memory in bytes, where the OS says (None elsewhere)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def hardware() -> dict[str, Any]:
    cpu = platform.processor() or None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                       cpu)
    except OSError:
        pass
    info: dict[str, Any] = {"hostname": socket.gethostname(), "platform": platform.platform(),
                            "cpu": cpu, "cpu_count": os.cpu_count()}
    memory = machine_memory_bytes()
    if memory is not None:
        info["memory_gib"] = round(memory / 2**30, 1)
    if "torch" in sys.modules:
        import torch

        info["torch_threads"] = torch.get_num_threads()  # what a speed figure ran on
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def provenance(command: list[str] | None = None) -> dict[str, Any]:
    """Everything above, plus the command line and the time (UTC)."""
    return {
        "command": command if command is not None else [sys.executable, *sys.argv],
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git": git_info(),
        "versions": versions(),
        "hardware": hardware(),
    }
