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
