"""The run directory, checked before a start writes anything in it; train.py's error line.

A start is checked whole before it writes: the run directory is a writable directory or can be
created as one (here), the config agrees with the run the directory holds (run.check_resume),
and its last.ckpt reads back with the bytes it was saved with (checkpoints.verify_checkpoint).
Only then are config.json, run_info.json, Hydra's record (.hydra/<time>/), hparams.yaml and the
logs written, so a start that fails leaves the directory as it was.

No Lightning or torch here: `RunDirCheck` runs inside Hydra, before a bad override would have
its two-second answer.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from hydra.experimental.callback import Callback

from egmla import files

CHOOSE_ANOTHER = "choose another run directory (name=... or hydra.run.dir=...)"


class RunError(ValueError):
    """The run directory cannot be used as asked; nothing in it was changed."""


def check_run_dir(run_dir: str | os.PathLike) -> None:
    """Raise RunError unless `run_dir` is a writable directory or can be created as one
    (its nearest existing ancestor a writable directory), and its checkpoints/ a directory."""
    path = Path(os.path.abspath(run_dir))
    try:
        if path.exists() and not path.is_dir():
            raise RunError(f"{path}: exists and is not a directory; {CHOOSE_ANOTHER}")
        existing = path
        while not existing.exists():  # False also below a file (ENOTDIR)
            existing = existing.parent
        if not existing.is_dir():
            raise RunError(f"{path}: cannot be created, {existing} is a file; {CHOOSE_ANOTHER}")
        if not os.access(existing, os.W_OK | os.X_OK):  # root too, on a read-only file system
            raise RunError(f"{path}: cannot be written (no permission to write in {existing}); "
                           f"{CHOOSE_ANOTHER}")
        checkpoints = path / "checkpoints"
        if checkpoints.exists() and not checkpoints.is_dir():
            raise RunError(f"{checkpoints}: exists and is not a directory; move it away or "
                           f"{CHOOSE_ANOTHER}")
    except OSError as err:  # e.g. a parent that cannot be searched
        raise RunError(f"{path}: cannot be used as a run directory ({err.strerror}); "
                       f"{CHOOSE_ANOTHER}") from err


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary sibling renamed into place, fsynced first: a
    crash leaves the old file or the new one, never a torn one."""
    files.write_text(path, text, fsync=True)


def exit_with_error(err: Exception) -> NoReturn:
    """train.py's answer to bad input: one line on stderr and exit status 2 (with EGMLA_DEBUG
    set, the exception and its traceback instead)."""
    if os.environ.get("EGMLA_DEBUG"):
        raise err
    message = str(err).replace("\n", " ")  # one line, whatever the source of the message
    print(f"train.py: error: {message} (EGMLA_DEBUG=1 shows the traceback)", file=sys.stderr)
    sys.exit(2)


class RunDirCheck(Callback):
    """Hydra callback (configs/train.yaml): check the run or sweep directory and create it, as
    Hydra would the moment after, so that an unusable one is train.py's one-line error, not a
    traceback from Hydra's mkdir (some fail only when tried: /proc/x, for root too)."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        self._check(config, "run")

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self._check(config, "sweep")

    @staticmethod
    def _check(config: Any, mode: str) -> None:
        try:
            directory = str(config.hydra[mode].dir)
        except Exception:  # noqa: BLE001 - an interpolation only a job can resolve: Hydra's own
            return
        try:
            check_run_dir(directory)
            try:
                Path(directory).mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise RunError(f"{os.path.abspath(directory)}: cannot be created "
                               f"({err.strerror}); {CHOOSE_ANOTHER}") from err
        except RunError as err:
            exit_with_error(err)
