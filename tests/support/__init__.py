"""Helpers shared by the tests (importable as `support` from any test: pytest puts tests/, the
directory of the root conftest, on sys.path). Test files import from here, never from each other.

- support.models: the variant zoo every reference test runs over, and seeded builders;
- support.engine: a reference greedy decode, mixed prompt sets, a tiny fake model for
  scheduler-only tests, and a fault injected into one request of an engine;
- support.training: train.py run for real, and tiny overrides;
- support.tasks: a plain lm-eval task written to disk;
- support.processes: the host's processes that run as the sandbox's user.

The test directories (core, training, evaluation, serving, sandboxing) are deliberately not named
after the packages they test: pytest puts test directories on sys.path, and a `tests/eval/` there
would be found as a namespace package `eval` wherever the real one is not on the path first.
Test file names are unique across directories for the same reason (no __init__.py here).
"""

from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository


@contextmanager
def torch_threads(n: int):
    """PyTorch's intra-op threads set to n inside the block, restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def ops_called(fn) -> dict[str, int]:
    """The operators `fn()` called (torch's profiler), with how many times each."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.count for e in prof.key_averages()}


# The interpreter's view of a machine where some packages are not installed: importlib's
# find_spec (how egmla locates its data and model packages without importing them) finds none.
_WITHOUT = """
import importlib.util, runpy, sys
hidden, module = set(sys.argv[1].split(",")), sys.argv[2]
found = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] in hidden else found(name, *a)
sys.argv = [module, *sys.argv[3:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def module_without(packages: list[str], module: str, *args: str) -> list[str]:
    """The command line of `python -m module args...` run as if `packages` were not installed."""
    import sys

    return [sys.executable, "-c", _WITHOUT, ",".join(packages), module, *args]
