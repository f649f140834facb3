"""The host's processes that run as the sandbox's user (the sandbox tests check none is left)."""

from __future__ import annotations

import os
from pathlib import Path

from sandbox import protections


def sandbox_uid_processes() -> list[str]:
    """Pids of the processes whose real uid is the sandbox's (none when it has no uid of its own)."""
    uid = protections().uid
    if uid is None:
        return []
    return [p for p in os.listdir("/proc") if p.isdigit() and _uid(p) == uid]


def _uid(pid: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None
