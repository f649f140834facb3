"""Test-wide settings: everything offline, nothing from the user's caches."""

from __future__ import annotations

import os
import tempfile

import pytest

# Set before any test module imports transformers/datasets/wandb: no hub look-ups (which would
# otherwise wait ~30 s before failing) and no tracker account.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="egmla-hf-home-"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory):
    """An EGMLA_CACHE for this test session (never the user's); SmolLM2 is converted into it once,
    by the first test that loads it (tests of the conversion itself use their own)."""
    return tmp_path_factory.mktemp("egmla-cache")


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_cache):
    """SmolLM2-135M-Instruct behind the serving API."""
    from serve import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EGMLA_CACHE", str(smollm2_cache))
        return LLM("SmolLM2-135M-Instruct", num_blocks=1024)
