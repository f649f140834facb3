"""Helpers shared by the tests (importable as `support` from any test: pytest puts tests/, the
directory of the root conftest, on sys.path). Test files import from here, never from each other.

- support.models: the variant zoo every reference test runs over, and seeded builders;
- support.engine: a reference greedy decode, mixed prompt sets, and a tiny fake model for
  scheduler-only tests;
- support.training: train.py run for real, and tiny overrides;
- support.tasks: a plain lm-eval task written to disk.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
