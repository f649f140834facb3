"""Dependency direction: the model core imports only torch, the standard library and itself."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ["egmla/models", "egmla/kernels", "egmla/paths.py", "egmla/config.py", "egmla/cache.py",
        "egmla/presets.py", "egmla/generate.py", "egmla/files.py", "egmla/units.py"]
FRAMEWORKS = ["lightning", "pytorch_lightning", "hydra", "omegaconf", "transformers", "wandb",
              "lm_eval", "datasets"]


def imported_roots(source: str) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def foreign_imports(source: str) -> set[str]:
    return imported_roots(source) - set(sys.stdlib_module_names) - {"torch", "egmla", "__future__"}


def core_files() -> list[Path]:
    files = []
    for entry in CORE:
        path = ROOT / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


@pytest.mark.parametrize("path", core_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_source_imports_only_torch_and_stdlib(path):
    assert foreign_imports(path.read_text()) == set()


def test_checker_catches_a_foreign_import():
    assert foreign_imports("import os\nfrom lightning import Trainer\nimport torch.nn") == {"lightning"}


def test_importing_the_core_loads_no_framework():
    """At run time too: no framework arrives through a transitive import."""
    code = (
        "import sys, egmla.models, egmla.config, egmla.cache, egmla.presets, egmla.generate\n"
        f"print([m for m in {FRAMEWORKS!r} if m in sys.modules])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


TRAINING_ONLY = {"lightning", "pytorch_lightning", "hydra", "omegaconf", "submitit"}


def outside_training() -> list[Path]:
    files = [p for p in (ROOT / "egmla").rglob("*.py") if "training" not in p.parts]
    return files + [p for top in ("eval", "serve", "sandbox", "studies")
                   for p in sorted((ROOT / top).rglob("*.py"))]


@pytest.mark.parametrize("path", outside_training(), ids=lambda p: str(p.relative_to(ROOT)))
def test_only_training_imports_lightning_or_hydra(path):
    """Anywhere in a file, functions included: data, eval and serve stay framework-free."""
    assert imported_roots(path.read_text()) & TRAINING_ONLY == set()


@pytest.mark.parametrize("path", sorted((ROOT / "sandbox").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_sandbox_uses_only_the_standard_library(path):
    """The judge runs untrusted code: nothing but Python itself, so nothing to trust beyond it."""
    assert imported_roots(path.read_text()) - set(sys.stdlib_module_names) - {"sandbox", "__future__"} == set()


def test_the_sandbox_and_the_selfdebug_report_start_without_torch():
    code = "import sys, sandbox, sandbox.__main__, eval.selfdebug.report\nprint('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=ROOT)
    assert result.stdout.strip() == "False"
