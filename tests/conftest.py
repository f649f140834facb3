"""Test-wide settings: everything offline, nothing from the user's caches."""

from __future__ import annotations

import os
import tempfile

# Set before any test module imports transformers/datasets/wandb: no hub look-ups (which would
# otherwise wait ~30 s before failing) and no tracker account.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="egmla-hf-home-"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
