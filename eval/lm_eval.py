"""`python -m eval.lm_eval ...`: lm-eval's own command line, with the `egmla` model registered
and local task YAMLs' relative data files resolved next to the YAML (eval/local_tasks.py).

Every lm-eval flag works as with `lm_eval`; for example

    python -m eval.lm_eval --model egmla --model_args pretrained=SmolLM2-135M-Instruct \\
        --tasks egmla_offline --include_path eval/tasks --limit 20 --output_path results/
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    import eval.adapter  # noqa: F401 - registers the "egmla" model with lm-eval
    from eval.local_tasks import install
    from lm_eval.__main__ import cli_evaluate

    install()  # a local task's data files are found next to its YAML, from any directory
    if argv is not None:
        sys.argv = ["lm_eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
