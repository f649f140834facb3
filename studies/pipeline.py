"""What the resumable research pipelines share (studies.locality.runs, studies.upcycling): a step
run as a subprocess with its output in a log file, and records written atomically."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from egmla import files

ROOT = Path(__file__).resolve().parents[1]


class PipelineError(RuntimeError):
    """A step failed; the message says which and where its log is."""


def run_logged(cmd: list[str], log_file: Path, log, append: bool = False) -> None:
    """Run `cmd` from the repository root with its output in `log_file` (appended to with
    `append`, so a resumed step keeps its earlier starts' output); PipelineError if it fails."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    what = " ".join(cmd[1:4])
    log(f"{what} ... (log {log_file})")
    with log_file.open("a" if append else "w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if done.returncode != 0:
        raise PipelineError(f"{what} failed (exit {done.returncode}); see {log_file}")
    log(f"done in {time.perf_counter() - started:.0f} s")


def read_record(path: Path) -> dict[str, Any] | None:
    """The JSON object at `path`, or None where there is no file. A file that cannot be read or
    is not a JSON object is a PipelineError naming it: a pipeline that took it for missing would
    redo its work and write over it."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise PipelineError(f"{path}: cannot be read ({err.strerror})") from None
    try:
        data = json.loads(text)
    except ValueError as err:
        raise PipelineError(f"{path}: not valid JSON ({err}); repair or delete it") from None
    if not isinstance(data, dict):
        raise PipelineError(f"{path}: a JSON {type(data).__name__}, not an object; repair or "
                            "delete it")
    return data


def write_json(path: Path, data: Any) -> None:
    """`data` as JSON (indent 1) at `path`, written whole or not at all (egmla.files)."""
    files.write_json(path, data, parents=True)
