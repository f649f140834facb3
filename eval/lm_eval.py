"""`python -m eval.lm_eval ...`: lm-eval's own command line, with the `egmla` model registered
and local task YAMLs' relative data files resolved next to the YAML (eval/local_tasks.py).

Every lm-eval flag works as with `lm_eval`; for example

    python -m eval.lm_eval --model egmla --model_args pretrained=SmolLM2-135M-Instruct \\
        --tasks egmla_offline --include_path eval/tasks --limit 20 --output_path results/
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    import eval.adapter  # noqa: F401 - registers the "egmla" model with lm-eval
    from egmla.checkpoint import CheckpointError
    from eval.local_tasks import install
    from lm_eval.__main__ import cli_evaluate

    install()  # a local task's data files are found next to its YAML, from any directory
    if argv is not None:
        sys.argv = ["lm_eval", *argv]
    try:
        cli_evaluate()
    except (CheckpointError, ValueError, OSError, ImportError) as error:
        # A missing checkpoint, an unknown task, data or a package not available offline: one line
        # naming it, not a traceback (EGMLA_DEBUG=1 shows the traceback).
        if os.environ.get("EGMLA_DEBUG"):
            raise
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
