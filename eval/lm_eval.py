"""`python -m eval.lm_eval ...`: lm-eval's own command line, with the `egmla` model registered
and local task YAMLs' relative data files resolved next to the YAML (eval/local_tasks.py).

Every lm-eval flag works as with `lm_eval`; for example

    python -m eval.lm_eval --model egmla --model_args pretrained=SmolLM2-135M-Instruct \\
        --tasks egmla_offline --include_path eval/tasks --limit 20 --output_path results/
"""

from __future__ import annotations

import os
import sys


def default_device(argv: list[str]) -> list[str]:
    """`argv`, plus `--device cpu` for `--model egmla` when no device is given.

    lm-eval's command line defaults to cuda:0 and records that in its results whatever the model
    does; the egmla adapter honours the device it is given (and refuses cuda without a GPU), so
    without this a plain run would be refused on a CPU machine. The CPU is where egmla's weights
    load; `--device cuda` runs on the GPU. A `--config` file may set the device itself.
    """
    flags = {arg.split("=", 1)[0] for arg in argv}
    models = [value for flag, value in zip(argv, argv[1:]) if flag in ("--model", "-M")]
    models += [arg.split("=", 1)[1] for arg in argv if arg.startswith(("--model=", "-M="))]
    given = any(len(f) > 3 and "--device".startswith(f) for f in flags)  # argparse takes --dev
    if models == ["egmla"] and not given and not flags & {"--config", "-C"}:
        return [*argv, "--device", "cpu"]
    return argv


def main(argv: list[str] | None = None) -> int:
    import eval.adapter  # noqa: F401 - registers the "egmla" model with lm-eval
    import lm_eval.models  # noqa: F401 - and lm-eval's own (local-completions, hf, ...): its
    # registry imports them only while it is empty, which egmla's registration ends
    from egmla.checkpoint import CheckpointError
    from egmla.data.corpus import CorpusError
    from eval.local_tasks import install
    from lm_eval.__main__ import cli_evaluate

    install()  # a local task's data files are found next to its YAML, from any directory
    sys.argv = ["lm_eval", *default_device(sys.argv[1:] if argv is None else argv)]
    try:
        cli_evaluate()
    except (CheckpointError, CorpusError, ValueError, OSError, ImportError) as error:
        # A missing checkpoint, an unknown task, data or a package not available offline (the
        # corpus or model packages among them): one line naming it, not a traceback
        # (EGMLA_DEBUG=1 shows the traceback).
        if os.environ.get("EGMLA_DEBUG"):
            raise
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
