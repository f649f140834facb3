"""The sandbox on the real datasets: every reference solution passes its visible and hidden
tests there, and deliberately wrong solutions get the verdict their fault deserves."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from serve.sandbox import Limits, run
from serve.selfdebug.datasets import load_humaneval, load_mbpp

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
