"""The sandbox on the real datasets: every reference solution passes its visible and hidden
tests there, and deliberately wrong solutions get the verdict their fault deserves."""

from __future__ import annotations

import ast
import builtins
from concurrent.futures import ThreadPoolExecutor

import pytest

from eval.selfdebug.datasets import load_humaneval, load_mbpp
from sandbox import Limits, run

LIMITS = Limits(timeout_s=20)


def verdicts(pairs):
    """(program, problem) pairs -> verdicts on visible + hidden tests, two runs at a time."""
    def one(pair):
        program, p = pair
        return run(program, p.visible_tests + p.hidden_tests, setup=p.setup, limits=LIMITS)
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, pairs))


@pytest.mark.slow
def test_all_reference_solutions_pass_in_the_sandbox():
    problems = load_humaneval() + load_mbpp()
    results = verdicts([(p.reference, p) for p in problems])
    failing = [(p.task_id, v.status, v.first_failure) for p, v in zip(problems, results)
               if not v.passed]
    assert failing == []
    assert len(problems) == 164 + 427


def wrong_body(p, body: str) -> str:
    """The prompt's signature and docstring with `body` instead of the solution."""
    return p.prompt.rstrip() + "\n" + "".join(f"    {line}\n" for line in body.splitlines())


@pytest.mark.slow
def test_wrong_humaneval_solutions_get_the_expected_verdicts():
    problems = load_humaneval()
    none = verdicts([(wrong_body(p, "return None"), p) for p in problems])
    assert {v.status for v in none} == {"failed"}
    raising = verdicts([(wrong_body(p, "raise ValueError('wrong')"), p) for p in problems[:20]])
    for v in raising:
        assert v.status == "error" and v.first_failure["type"] == "ValueError"
        assert v.first_failure["message"] == "wrong"
    loops = [run(wrong_body(p, "while True:\n    pass"), p.visible_tests, setup=p.setup,
                 limits=Limits(timeout_s=2)) for p in problems[:2]]
    assert [v.status for v in loops] == ["timeout", "timeout"]
    off = problems[53]  # add(x, y)
    v = run(wrong_body(off, "return x + y + 1"), off.visible_tests, limits=LIMITS)
    assert v.status == "failed" and (v.tests[0]["expected"], v.tests[0]["actual"]) == ("5", "6")


def test_a_shadowed_builtin_does_not_pass_a_wrong_solution():
    """The forgeries of issue 15 on real problems: each passed its hidden test (the one that
    counts) when the program's top-level names reached the tests over the builtins."""
    problems = {p.task_id: p for p in load_humaneval()}
    wrong = {"HumanEval/4": ("return 0.0", "def abs(x):\n    return 0\n"),
             **{f"HumanEval/{i}": ("return None", "def range(*a):\n    return []\n")
                for i in (38, 50, 32)}}
    for t, (body, shadow) in wrong.items():
        p = problems[t]
        v = run(wrong_body(p, body) + shadow, p.hidden_tests, setup=p.setup, limits=LIMITS)
        assert v.status in ("failed", "error"), (t, v)


LIAR = "def {0}(*args, **kwargs):\n    raise RuntimeError(\"the tests called the program's {0}\")\n"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # escapes in the sources
def test_reference_solutions_pass_beside_lying_builtins_named_in_their_tests():
    """Each reference runs in a namespace of its own (so its own calls see the real builtins)
    and is exported to the program's top level, next to a function that raises for every
    builtin its tests name. The tests must never call those."""
    pairs = []
    for p in load_humaneval() + load_mbpp():
        named = {n.id for s in [p.setup, *p.hidden_tests] for n in ast.walk(ast.parse(s))
                 if isinstance(n, ast.Name)}
        own = {n.name for n in ast.parse(p.reference).body if isinstance(n, ast.FunctionDef)}
        shadows = sorted(n for n in named & set(vars(builtins)) - own if not n.startswith("__"))
        if shadows:
            program = (f"_own = {{}}\nexec({p.reference!r}, _own)\n"
                       "globals().update({k: v for k, v in _own.items() if k[:2] != '__'})\n"
                       + "".join(LIAR.format(n) for n in shadows))
            pairs.append((program, p))
    assert len(pairs) == 17 + 6 - 1  # of issue 15, less MBPP/126 (its function is `sum`)
    failing = [(p.task_id, v.status, v.first_failure) for (_, p), v in zip(pairs, verdicts(pairs))
               if not v.passed]
    assert failing == []
