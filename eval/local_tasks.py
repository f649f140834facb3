"""Local lm-eval tasks that run from any working directory.

lm-eval resolves a task YAML's relative `dataset_kwargs.data_files` against the current working
directory, so a plain YAML with its JSONL next to it only works when run from that directory.
`install()` makes lm-eval look next to the YAML first: a relative data file that exists beside
the YAML becomes an absolute path; any other value is left exactly as written (so hub datasets
and cwd-relative paths behave as before). `group_tasks(name)` reads the task list of a group
YAML here, the one list the scripts that run a group's tasks one by one use.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
_INSTALLED = False


def resolve_data_files(cfg: dict[str, Any], yaml_dir: Path) -> dict[str, Any]:
    """`cfg` with relative data files that exist beside the YAML made absolute."""
    kwargs = cfg.get("dataset_kwargs")
    if not isinstance(kwargs, dict) or "data_files" not in kwargs:
        return cfg

    def fix(value: Any) -> Any:
        if isinstance(value, str) and not Path(value).is_absolute() and "://" not in value:
            beside = yaml_dir / value
            return str(beside) if beside.exists() else value
        if isinstance(value, list):
            return [fix(v) for v in value]
        if isinstance(value, dict):
            return {k: fix(v) for k, v in value.items()}
        return value

    return {**cfg, "dataset_kwargs": {**kwargs, "data_files": fix(kwargs["data_files"])}}


def install() -> None:
    """Wrap lm-eval's task-YAML loader (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    try:
        from lm_eval.tasks import _factory
    except ImportError:  # another lm-eval layout: keep its behaviour, and say so
        log.warning("this lm-eval version has no tasks._factory; relative data_files in local "
                    "task YAMLs resolve against the working directory")
        return
    original = _factory.load_yaml

    @functools.wraps(original)
    def load_yaml(path, *args, **kwargs):
        cfg = original(path, *args, **kwargs)
        return resolve_data_files(cfg, Path(path).expanduser().resolve().parent)

    _factory.load_yaml = load_yaml
    _INSTALLED = True


TASKS = Path(__file__).resolve().parent / "tasks"


def group_tasks(group: str, tasks_dir: Path = TASKS) -> tuple[str, ...]:
    """The tasks a group YAML under eval/tasks lists (`group: NAME`, `task: [...]`), in its
    order: the one list a script runs, so that a task added to the group reaches every script
    that runs the group. ValueError if no YAML there defines the group."""
    import yaml

    for path in sorted(tasks_dir.glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        if isinstance(data, dict) and data.get("group") == group:
            return tuple(t if isinstance(t, str) else t["task"] for t in data["task"])
    raise ValueError(f"no lm-eval group {group!r} in {tasks_dir}")
