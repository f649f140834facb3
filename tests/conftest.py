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

# Tests marked slow run in CI (.ci/run sets EGMLA_SLOW=1) and when asked for: EGMLA_SLOW=1, an
# explicit -m, or a test named by its node id. A plain `pytest` leaves them out.
RUN_SLOW = os.environ.get("EGMLA_SLOW", "").strip().lower() in ("1", "true", "yes")


def pytest_collection_modifyitems(config, items):
    if RUN_SLOW or config.getoption("markexpr") or any("::" in a for a in config.args):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
        config.stash[_LEFT_OUT] = len(slow)


_LEFT_OUT = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter, config):
    left_out = config.stash.get(_LEFT_OUT, 0)
    if left_out:
        terminalreporter.write_line(f"{left_out} slow tests left out: EGMLA_SLOW=1 runs them "
                                    "too, as CI does")


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
