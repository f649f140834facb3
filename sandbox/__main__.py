"""`python -m sandbox PROGRAM.py --tests TESTS.py`: run a program against tests, safely.

TESTS.py is ordinary Python. Its top-level `assert` statements and bare expressions (such as
`check(candidate)`) are the tests, one each, and so is every top-level `def test_*()`; the rest
(imports, helpers, constants) is setup, run first. The tests see the program's top-level
functions that they use, by name, except that a builtin the tests use stays the builtin (a
program's `def abs` does not replace it; see docs/selfdebug.md).

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


def split_tests(source: str, filename: str) -> tuple[str, list[str]]:
    """TESTS.py -> (setup source, [one source per test])."""
    tree = ast.parse(source, filename)
    setup, cases = [], []
    for node in tree.body:
        segment = ast.get_source_segment(source, node) or ast.unparse(node)
        if isinstance(node, (ast.Assert, ast.Expr)) and not (
                isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            cases.append(segment)
            continue
        setup.append(segment)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                node.name.startswith("test_") and not node.args.args:
            cases.append(f"{node.name}()")
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
            raise SandboxError(f"{args.tests}: no tests found (no top-level assert, expression "
                               "or test_* function)")
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
