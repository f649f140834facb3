"""Where egmla keeps what it builds once: converted models, tokenizers, token files, kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$EGMLA_CACHE, default ~/.cache/egmla."""
    return Path(os.environ.get("EGMLA_CACHE") or Path.home() / ".cache" / "egmla")
