"""Facts about the code's shape (issue 16), checked on the source itself:

- no import loop among the project's modules, function-local imports included;
- no module outside `egmla/models/attention/` and `egmla/config.py` branches on an attention
  variant (an `isinstance` on a variant class, or a variant's type name compared): what differs
  per variant is declared by the variant;
- `serve/` holds only serving: every module in it is reached from the server or `from serve import
  LLM`, and none imports the evaluation, the sandbox or the training stack;
- the research programs (`studies/`) are built on the tools, never the other way round: nothing
  in egmla/, serve/, eval/ or sandbox/ imports a study (eval/'s old command names for the studies
  run them by name, without importing them);
- every command-line option that says where a command writes is checked when the command line
  is read (`egmla.files.output_directory` / `output_prefix`), or by the command itself before
  its work, so that a mistyped path fails at once rather than after the work.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("egmla", "eval", "serve", "sandbox", "studies")
SCRIPTS = ("train.py", "benchmarks")
# The exported remote-code files run inside transformers, apart from egmla (egmla/export/hf_code).
STANDALONE = ("egmla/export/hf_code",)
VARIANT_HOME = ("egmla/models/attention/", "egmla/config.py")


def variant_classes() -> set[str]:
    """The names of every variant's classes, read from the registry: the config classes and
    the module classes under them (the forms a module builds, like EGMLALatent, included)."""
    from egmla.config import AttentionConfig
    from egmla.models.attention import AttentionLayer

    def under(cls: type) -> set[type]:
        return {c for sub in cls.__subclasses__() for c in (sub, *under(sub))}

    return {c.__name__ for c in under(AttentionConfig) | under(AttentionLayer)
            if c.__module__.startswith("egmla.")}


def variant_names() -> set[str]:
    from egmla.config import ATTENTION_REGISTRY

    return {name for name, cls in ATTENTION_REGISTRY.items() if cls.__module__.startswith("egmla.")}


VARIANT_CLASSES = variant_classes()
VARIANT_NAMES = variant_names()
# Where naming a variant is the point, with the reason.
NAMED_ON_PURPOSE = {
    "eval/kv_bytes.py": "the report's 'vs MLA' column picks its baseline config by type",
}


def sources(*roots: str) -> dict[str, ast.Module]:
    out = {}
    for root in roots:
        path = ROOT / root
        for file in ([path] if path.is_file() else sorted(path.rglob("*.py"))):
            rel = file.relative_to(ROOT).as_posix()
            if not rel.startswith(STANDALONE):
                out[rel] = ast.parse(file.read_text(), rel)
    return out


def module_name(rel: str) -> str:
    name = rel.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


def imports_of(rel: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The project modules `rel` imports, anywhere in it (a module's package __init__ counts as
    imported with it, as Python runs it)."""
    me, found = module_name(rel), set()
    package = me if rel.endswith("__init__.py") else me.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != me:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    trees = sources(*PACKAGES)
    known = {module_name(rel) for rel in trees}
    return {module_name(rel): imports_of(rel, tree, known) for rel, tree in trees.items()}


def test_no_import_loops():
    graph = import_graph()
    known = set(graph)
    # a package's __init__ importing its own submodules is how packages are made, not a loop
    graph = {m: {d for d in deps if not (d.startswith(m + ".") and m in known)}
             for m, deps in graph.items()}
    loops, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == "open":
                loops.append(" -> ".join([*path[path.index(dep):], dep]))
            elif dep not in state:
                visit(dep, [*path, dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not loops, "\n".join(loops)


def test_serve_holds_only_serving_code():
    graph = import_graph()
    serving = {m for m in graph if m == "serve" or m.startswith("serve.")}
    reached, todo = set(), ["serve", "serve.__main__"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += [d for d in graph[module] if d in serving]
    assert serving - reached == set(), "modules in serve/ that serving never uses"
    foreign = {m: sorted(d for d in graph[m] if d.split(".")[0] in ("eval", "sandbox")
                         or d.startswith("egmla.training")) for m in serving}
    assert not any(foreign.values()), foreign


def variant_branches(tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            classes = node.args[1] if len(node.args) > 1 else None
            elts = classes.elts if isinstance(classes, ast.Tuple) else [classes]
            named = {getattr(e, "id", None) or getattr(e, "attr", None) for e in elts}
            if named & VARIANT_CLASSES:
                found.append(f"line {node.lineno}: isinstance on {sorted(named & VARIANT_CLASSES)}")
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            typed = any(isinstance(s, ast.Attribute) and s.attr == "type"
                        or isinstance(s, ast.Subscript) and getattr(s.slice, "value", None) == "type"
                        for s in sides)
            literals = {s.value for s in sides if isinstance(s, ast.Constant)}
            for s in sides:
                if isinstance(s, (ast.Tuple, ast.List, ast.Set)):
                    literals |= {e.value for e in s.elts if isinstance(e, ast.Constant)}
            if typed and literals & VARIANT_NAMES:
                found.append(f"line {node.lineno}: compares a type with {sorted(literals & VARIANT_NAMES)}")
    return found


def test_only_the_variants_and_the_config_branch_on_a_variant():
    trees = sources(*PACKAGES, *SCRIPTS)
    offenders = {rel: hits for rel, tree in trees.items()
                 if not rel.startswith(VARIANT_HOME) and rel not in NAMED_ON_PURPOSE
                 and (hits := variant_branches(tree))}
    assert not offenders, offenders
    for rel in NAMED_ON_PURPOSE:  # the exceptions still exist and still need their exemption
        assert variant_branches(trees[rel]), f"{rel} no longer names a variant: drop its exemption"


@pytest.mark.parametrize("snippet, flagged", [
    ("isinstance(a, EGMLAConfig)", True), ("isinstance(a, (int, cfg.MLA))", True),
    ("a.type == 'mha'", True), ("'egmla' != cfg.attention.type", True),
    ("a['type'] in ('mla', 'x')", True), ("isinstance(a, dict)", False), ("a.kind == 'mha'", False),
])
def test_the_branch_finder_finds_branches(snippet, flagged):
    assert bool(variant_branches(ast.parse(snippet))) == flagged


def test_nothing_below_the_studies_imports_a_study():
    graph = import_graph()
    below = {m: sorted(d for d in deps if d.split(".")[0] == "studies")
             for m, deps in graph.items() if m.split(".")[0] != "studies"}
    assert not any(below.values()), {m: d for m, d in below.items() if d}
    assert any(m.startswith("studies.") for m in graph)  # the rule looks at the studies


def test_the_old_study_commands_are_aliases_that_run_the_study_by_name():
    """`python -m eval.study` and the like keep working for scripts and habits: each is a few
    lines naming its new home, and imports nothing of the project."""
    for rel in ("eval/study.py", "eval/study_tables.py", "eval/locality.py",
                "eval/locality_runs.py", "eval/upcycle_runs.py"):
        text = (ROOT / rel).read_text()
        assert "runpy.run_module(\"studies." in text and len(text.splitlines()) < 15, rel


def test_no_test_file_imports_another():
    """Shared test helpers live in tests/support/, never in a test file another one imports
    (a test module imported twice runs its module code twice, and its fixtures leak)."""
    tests = ROOT / "tests"
    names = {p.stem for p in tests.rglob("test_*.py")}
    offenders = {}
    for path in sorted(tests.rglob("*.py")):
        if "legacy" in path.relative_to(tests).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            found = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            hits = [n for n in found if n.split(".")[-1] in names or n.split(".")[0] in names]
            if hits:
                offenders[str(path.relative_to(ROOT))] = hits
    assert not offenders, offenders


def test_the_variants_are_read_from_the_registry():
    """Every registered type and its classes, and the forms a module builds, without a list."""
    from egmla.models.attention import ATTENTION_MODULES

    assert {"mha", "mla", "egmla"} <= VARIANT_NAMES
    for name in VARIANT_NAMES:
        module = ATTENTION_MODULES[name]
        assert {module.__name__, module.config_class.__name__} <= VARIANT_CLASSES
    assert "EGMLALatent" in VARIANT_CLASSES  # built by EGMLA for gate_position latent
    assert not {"AttentionConfig", "AttentionLayer"} & VARIANT_CLASSES


# Options naming where a command writes, and the commands that check theirs themselves, why.
OUTPUT_FLAGS = ("--out", "--output-dir", "--results", "--runs-dir", "--lean-results", "--keep-run")
CHECKED_TYPES = ("output_directory", "output_prefix")
CHECKED_IN_MAIN = {
    "egmla/upcycle/__main__.py": "an export: checkpoint.check_destination, --overwrite included",
    "egmla/export/__main__.py": "an export: checkpoint.check_destination inside export()",
    "eval/compare.py": "--out checked in main with its other inputs, as one-line errors",
    "eval/selfdebug/report.py": "--out checked in main with its other inputs, as one-line errors",
    "eval/kv_bytes.py": "--output-dir made in main with its other inputs, as one-line errors",
}


def output_options(tree: ast.Module, flags=OUTPUT_FLAGS) -> list[tuple[str, str | None]]:
    """(flag, the name of its `type=`) for each add_argument of one of `flags` (by default the
    output flags) in `tree`."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument" and node.args
                and isinstance(node.args[0], ast.Constant) and node.args[0].value in flags):
            continue
        kind = next((k.value for k in node.keywords if k.arg == "type"), None)
        name = kind.id if isinstance(kind, ast.Name) else getattr(kind, "attr", None)
        found.append((node.args[0].value, name))
    return found


def test_every_output_option_is_checked_before_the_work():
    unchecked, seen = [], set()
    for rel, tree in sources(*PACKAGES, *SCRIPTS).items():
        for flag, kind in output_options(tree):
            seen.add(rel)
            if kind not in CHECKED_TYPES and rel not in CHECKED_IN_MAIN:
                unchecked.append(f"{rel}: {flag} (type={kind})")
    assert not unchecked, unchecked
    assert set(CHECKED_IN_MAIN) <= seen  # no stale exemption
    assert len(seen) > 20  # the walk finds the commands


def test_every_threads_option_is_bounded_by_the_cpus():
    """torch.set_num_threads(100000) segfaulted the server: every --threads is thread_count."""
    found = {rel: kind for rel, tree in sources(*PACKAGES, *SCRIPTS).items()
             for _, kind in output_options(tree, {"--threads"})}
    assert len(found) >= 10 and "serve/__main__.py" in found  # the walk finds them
    assert {rel for rel, kind in found.items() if kind != "thread_count"} == set()


def test_the_output_check_finds_an_unchecked_option():
    tree = ast.parse('p.add_argument("--out", type=Path, default=RESULTS)\n'
                     'p.add_argument("--results", type=files.output_directory)')
    assert output_options(tree) == [("--out", "Path"), ("--results", "output_directory")]
