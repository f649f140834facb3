"""One cgroup per run: the memory and process limits of all the program's processes together.

An rlimit counts one process (`RLIMIT_AS`) or every process of a uid on the machine
(`RLIMIT_NPROC`), so eight forked children get eight times the memory limit, and one run holding
its processes starves every concurrent run of the same uid. A cgroup counts exactly the run: the
judge moves the worker into it before the program starts, and every process the program starts
is born inside it.

    >>> found = find_hierarchy()                                          # doctest: +SKIP
    >>> group = RunCgroup(found, memory_bytes=256 << 20, processes=64)    # doctest: +SKIP
    >>> group.procs_files()  # the judge writes the worker's pid into each  # doctest: +SKIP
    ['/sys/fs/cgroup/memory/.../egmla-sandbox-812-3/cgroup.procs', '/sys/fs/cgroup/pids/...']
    >>> group.oom_kills(), group.remove()                                 # doctest: +SKIP

cgroup v1 needs the `memory` and `pids` hierarchies mounted and writable; v2 needs both
controllers enabled for the children of the cgroup the run is created under (the caller's own
cgroup, else the hierarchy's root). Either way only root can normally write there:
`find_hierarchy()` says why when it cannot (`CgroupUnavailable`), and the sandbox then falls
back to per-process limits with a warning. Run cgroups are named
`egmla-sandbox-<supervisor pid>-<n>` and removed after every run; ones left by a supervisor
that was killed are removed by the next run beside them.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from dataclasses import dataclass

PREFIX = "egmla-sandbox-"
_counter = itertools.count()


class CgroupUnavailable(RuntimeError):
    """This machine gives the sandbox no usable cgroup; the message says why."""


@dataclass(frozen=True)
class Hierarchy:
    """Where run cgroups are created: version 1 (a parent directory per controller) or 2 (one)."""

    version: int
    parents: tuple[tuple[str, str], ...]  # (controller, parent directory); v2: (("", dir),)

    def describe(self) -> str:
        return f"cgroup v{self.version} ({', '.join(p for _, p in self.parents)})"


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount point, root inside the hierarchy, fs type, super options) of each cgroup mount."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            fstype, options = fields[sep + 1], set(fields[sep + 3].split(","))
            if fstype in ("cgroup", "cgroup2"):
                found.append((fields[4].replace("\\040", " "), fields[3], fstype, options))
    return found


def _own_paths() -> dict[str, str]:
    """Controller -> our cgroup's path in its hierarchy ("" for the v2 hierarchy)."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                paths[c] = path
    return paths


def _candidates(mount: str, root: str, own: str | None) -> list[str]:
    """Our own cgroup's directory (so a caller's limits still bind the sandbox), then the root."""
    dirs = []
    if own is not None and (own + "/").startswith(root.rstrip("/") + "/"):
        dirs.append(os.path.join(mount, own[len(root.rstrip("/")):].lstrip("/")))
    dirs.append(mount)
    return [os.path.normpath(d) for d in dict.fromkeys(dirs)]


def _usable(parent: str, needed: tuple[str, ...]) -> bool:
    """Whether a run cgroup created under `parent` has `needed` files and can be removed."""
    probe = os.path.join(parent, f"{PREFIX}{os.getpid()}-probe-{next(_counter)}")
    try:
        os.mkdir(probe)
    except OSError:
        return False
    try:
        return all(os.path.exists(os.path.join(probe, n)) for n in needed)
    finally:
        os.rmdir(probe)


def find_hierarchy() -> Hierarchy:
    """The hierarchy to create run cgroups in: v1 memory + pids, else v2; or CgroupUnavailable."""
    mounts, own = _mounts(), _own_paths()
    v1 = {}
    for controller, needed in (("memory", ("memory.limit_in_bytes", "memory.oom_control")),
                               ("pids", ("pids.max",))):
        for mount, root, fstype, options in mounts:
            if fstype == "cgroup" and controller in options:
                v1[controller] = next((d for d in _candidates(mount, root, own.get(controller))
                                       if _usable(d, needed)), None)
    if v1.get("memory") and v1.get("pids"):
        return Hierarchy(1, tuple(v1.items()))
    reasons = [f"cgroup v1 {c} is {'not writable' if c in v1 else 'not mounted'}"
               for c in ("memory", "pids") if not v1.get(c)]
    for mount, root, fstype, _ in mounts:
        if fstype != "cgroup2":
            continue
        for parent in _candidates(mount, root, own.get("")):
            try:
                with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                    enabled = set(f.read().split())
            except OSError:
                continue
            if {"memory", "pids"} <= enabled and _usable(parent, ("memory.max", "pids.max",
                                                                  "memory.events")):
                return Hierarchy(2, (("", parent),))
        reasons.append(f"cgroup v2 at {mount} has no writable cgroup with the memory and pids "
                       "controllers enabled for its children")
    if not any(fstype == "cgroup2" for _, _, fstype, _ in mounts):
        reasons.append("cgroup v2 is not mounted")
    raise CgroupUnavailable("; ".join(reasons))


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunCgroup:
    """The cgroup(s) of one run, with its limits written; `remove()` always, after the run."""

    def __init__(self, hierarchy: Hierarchy, memory_bytes: int, processes: int) -> None:
        self.hierarchy = hierarchy
        name = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.dirs: dict[str, str] = {}
        try:
            for controller, parent in hierarchy.parents:
                _sweep(parent)
                self.dirs[controller] = os.path.join(parent, name)
                os.mkdir(self.dirs[controller])
            if hierarchy.version == 1:
                memory, pids = self.dirs["memory"], self.dirs["pids"]
                _write(os.path.join(memory, "memory.limit_in_bytes"), str(int(memory_bytes)))
                if os.path.exists(os.path.join(memory, "memory.memsw.limit_in_bytes")):
                    _write(os.path.join(memory, "memory.memsw.limit_in_bytes"),
                           str(int(memory_bytes)))
            else:
                memory = pids = self.dirs[""]
                _write(os.path.join(memory, "memory.max"), str(int(memory_bytes)))
                if os.path.exists(os.path.join(memory, "memory.swap.max")):
                    _write(os.path.join(memory, "memory.swap.max"), "0")
            _write(os.path.join(pids, "pids.max"), str(int(processes)))
        except OSError as e:
            self.remove()
            raise CgroupUnavailable(f"cannot create the run's cgroup "
                                    f"{e.filename or name}: {e.strerror}") from None

    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs.values()]

    def oom_kills(self) -> int:
        """Processes the kernel killed because the run reached its memory limit."""
        memory = self.dirs.get("memory") or self.dirs.get("")
        name = "memory.oom_control" if self.hierarchy.version == 1 else "memory.events"
        try:
            with open(os.path.join(memory, name)) as f:
                fields = dict(line.split() for line in f if line.strip())
        except OSError:
            return 0
        return int(fields.get("oom_kill", 0))

    def remove(self) -> None:
        """Wait for the run's processes to be gone (killing any left), then remove the cgroups.
        The sandbox's pid namespace dies with its judge, so this normally takes no waiting."""
        for d in list(self.dirs.values()):
            _remove(d)
        self.dirs.clear()


def _members(d: str) -> list[int]:
    try:
        with open(os.path.join(d, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _remove(d: str, patience_s: float = 10.0) -> None:
    deadline = time.monotonic() + patience_s
    while True:
        try:
            os.rmdir(d)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline - patience_s + 1.0:  # after a second, help the kernel
            for pid in _members(d):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        time.sleep(0.01)


def _sweep(parent: str) -> None:
    """Remove run cgroups whose supervisor died without removing them (and that are empty)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)) \
                and not _members(os.path.join(parent, name)):
            try:
                os.rmdir(os.path.join(parent, name))
            except OSError:
                pass


__all__ = ["CgroupUnavailable", "Hierarchy", "RunCgroup", "find_hierarchy"]
