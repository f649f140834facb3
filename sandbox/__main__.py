"""`python -m sandbox PROGRAM.py --tests TESTS.py`: run a program against tests, safely.

TESTS.py is ordinary Python, run in file order. Every top-level statement that can fail is a
test, one each: an `assert`, a `raise`, a bare expression (such as `check(candidate)`), a `for`,
`while`, `if`, `with`, `try` or `match` holding one of those (outside nested functions), and a
call of each top-level `def test_*()`. The other statements (imports, definitions, assignments)
run in their place: those before the first test are the setup, each later one runs just before
the test that follows it. The tests see the program's top-level functions that they use, by
name, except that a builtin the tests use stays the builtin (a program's `def abs` does not
replace it; see docs/selfdebug.md).

    python -m sandbox solution.py --tests tests.py --timeout 5 --json

Exit status: 0 when every test passed, 1 when the verdict is anything else, 2 for bad input.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import warnings
from pathlib import Path

from sandbox import Limits, SandboxError, protections, run


COMPOUND = (ast.For, ast.AsyncFor, ast.While, ast.If, ast.With, ast.AsyncWith, ast.Try,
            ast.TryStar, ast.Match)


def can_fail(node: ast.stmt) -> bool:
    """Whether a statement checks something (module docstring): a docstring does not."""
    if isinstance(node, ast.Expr):
        return not isinstance(node.value, ast.Constant)
    if isinstance(node, (ast.Assert, ast.Raise)):
        return True
    if isinstance(node, COMPOUND):
        blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
        blocks += [h.body for h in getattr(node, "handlers", [])]
        blocks += [c.body for c in getattr(node, "cases", [])]
        return any(can_fail(child) for block in blocks for child in block)
    return False


def split_tests(source: str, filename: str) -> tuple[str, list[str]]:
    """TESTS.py -> (setup source, [one source per test]), which run in the file's order.

        import math            -> setup
        for x in (1, 2):       -> test 0
            assert f(x) > 0
        y = f(3)               -> test 1: "y = f(3)\nassert y == math.pi"
        assert y == math.pi
    """
    tree = ast.parse(source, filename)
    setup: list[str] = []
    cases: list[str] = []
    pending: list[str] = []  # statements after the first test, waiting for the next one
    for node in tree.body:
        segment = ast.get_source_segment(source, node) or ast.unparse(node)
        if can_fail(node):
            cases.append("\n".join(pending + [segment]))
            pending = []
            continue
        (pending if cases else setup).append(segment)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                node.name.startswith("test_") and not node.args.args:
            cases.append("\n".join(pending + [f"{node.name}()"]))
            pending = []
    if pending and cases:  # trailing statements still run, and can still fail the last test
        cases[-1] = "\n".join([cases[-1], *pending])
    return "\n".join(setup), cases


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sandbox", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("program", type=Path, nargs="?", help="the untrusted program (Python source)")
    p.add_argument("--tests", type=Path, help="the tests (Python source; required with PROGRAM)")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="wall-clock seconds for the program and all its tests (%(default)s)")
    p.add_argument("--memory-mb", type=int, default=1024,
                   help="memory limit in MiB: of the whole run where the machine gives the "
                        "sandbox a cgroup, and of each process's address space (%(default)s)")
    p.add_argument("--trace", action="store_true",
                   help="add a line trace of the first failing call")
    p.add_argument("--json", action="store_true", help="print the verdict as one JSON object")
    p.add_argument("--protections", action="store_true",
                   help="print which protections this machine gives, then exit")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.protections and (args.program is None or args.tests is None):
        parser.error("PROGRAM and --tests are required (or --protections alone)")
    try:
        if args.protections:
            prot = protections()
            print("\n".join(["active:"] + [f"  {x}" for x in prot.active()] +
                            ["missing:"] + [f"  {x}" for x in prot.warnings or ["nothing"]]))
            return 0
        limits = Limits(timeout_s=args.timeout, memory_bytes=args.memory_mb << 20)
        program = args.program.read_text()
        setup, cases = split_tests(args.tests.read_text(), str(args.tests))
        if not cases:
            raise SandboxError(f"{args.tests}: no tests found (no top-level statement that can "
                               "fail: assert, raise, expression, a block holding one, or a "
                               "test_* function)")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the verdict carries them
            verdict = run(program, cases, setup=setup, limits=limits, trace=args.trace)
    except (OSError, UnicodeDecodeError) as e:
        print(f"error: cannot read {getattr(e, 'filename', None) or e}: "
              f"{getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 2
    except SyntaxError as e:
        print(f"error: {e.filename}:{e.lineno}: {e.msg}", file=sys.stderr)
        return 2
    except SandboxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(verdict.to_dict()))
    else:
        print(f"{verdict.status}: {verdict.reason} ({verdict.wall_s:.2f} s)")
        failing = verdict.first_failure
        if failing:
            for key in ("source", "call", "message", "expected", "actual", "type", "line",
                        "trace"):
                if failing.get(key) not in (None, ""):
                    print(f"  {key}: {failing[key]}")
        for note in verdict.warnings:
            print(f"warning: {note}", file=sys.stderr)
    return 0 if verdict.passed else 1


if __name__ == "__main__":
    sys.exit(main())
