"""The vendored MBPP: unmodified, complete, and split into visible and hidden tests."""

from __future__ import annotations

import subprocess
import sys

import pytest

from eval.selfdebug.datasets import MBPP_FILE, DatasetError, load_mbpp


def test_mbpp_is_the_unmodified_427_problem_copy_with_its_attribution():
    problems = load_mbpp()
    assert len(problems) == 427 and len({p.task_id for p in problems}) == 427
    assert problems[0].task_id == "mbpp/2" and problems[-1].task_id == "mbpp/809"
    for p in problems:
        assert p.visible_tests == p.hidden_tests[:1] and len(p.hidden_tests) >= 3
        assert all(t.startswith("assert") for t in p.hidden_tests)
    assert sum(bool(p.setup) for p in problems) == 13  # the math.isclose tests
    readme = (MBPP_FILE.parent / "README.md").read_text()
    assert "CC BY 4.0" in readme and "arXiv:2108.07732" in readme


def test_a_modified_copy_is_refused_with_its_checksum(tmp_path):
    copy = tmp_path / "sanitized-mbpp.json"
    copy.write_bytes(MBPP_FILE.read_bytes().replace(b"similar_elements", b"similar_element", 1))
    with pytest.raises(DatasetError, match="sha256"):
        load_mbpp(copy)
    with pytest.raises(DatasetError, match="cannot read"):
        load_mbpp(tmp_path / "missing.json")


@pytest.mark.slow
def test_reference_solutions_pass_their_hidden_tests():
    """The harness's ground truth: every reference solution passes all its asserts (one fresh
    interpreter for all 427, each problem in its own namespace; the sandbox comes later)."""
    script = (
        "import json, sys\n"
        "from eval.selfdebug.datasets import load_mbpp\n"
        "failed = []\n"
        "for p in load_mbpp():\n"
        "    scope = {}\n"
        "    try:\n"
        "        exec(p.setup + '\\n' + p.reference + '\\n' + '\\n'.join(p.hidden_tests), scope)\n"
        "    except Exception as e:\n"
        "        failed.append((p.task_id, repr(e)))\n"
        "print(json.dumps(failed))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
