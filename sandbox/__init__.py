"""Run untrusted Python against tests and get a verdict the program cannot forge.

    >>> v = run("def add(a, b):\\n    return a + b\\n", ["assert add(1, 2) == 3"])  # doctest: +SKIP
    >>> v.status                                                                    # doctest: +SKIP
    'passed'

Each run is a fresh interpreter in its own session (`python -I -B -S`), started through
`unshare` in new network, pid, mount and IPC namespaces where the machine allows it. Inside, the
trusted judge (`runner.py`) switches to a private root that holds the interpreter, its libraries
and its standard library and nothing else of the machine (`rootfs.py`), with a size-capped tmpfs
scratch, and forks a worker. The worker joins the run's cgroup (`cgroup.py`: memory and
processes for the whole run), drops to an unprivileged uid, gets CPU, address-space, file-size
and open-file limits and a four-variable environment, and runs the program; the judge runs the
tests itself, calling the program's functions through proxies that carry plain data across
(see runner.py). The tests get only the program's names they use and never one that would hide
a builtin, and the verdict comes back on a channel the program has no descriptor for. The
wall-clock limit is enforced by the judge and again here, and the whole process tree is killed
at the end of every run, normal or not. `protections()` says what this machine allows; each
missing layer is a warning, never silent. docs/selfdebug.md ("The sandbox") has the threat
model.

Statuses: passed; failed (a test's assertion, with expected and actual where the assert is
`==`); error (the program raised: type, message, line; or it exited or crashed early);
timeout (wall clock or CPU); memory (MemoryError under the address-space limit, or the kernel
killed a process of the run at its memory limit); killed (output limit, or the program died of
a signal).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sandbox import rootfs
from sandbox.cgroup import CgroupUnavailable, Hierarchy, RunCgroup, find_hierarchy

RUNNER = Path(__file__).resolve().parent / "runner.py"
STATUSES = ("passed", "failed", "error", "timeout", "memory", "killed")
SANDBOX_UID = 65534  # nobody
STARTUP_GRACE_S = 5.0  # for the interpreter to start, on top of the program's own timeout
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


class SandboxError(RuntimeError):
    """The sandbox itself could not run (bad limits, no usable interpreter)."""


RLIMIT_MAX = (1 << 63) - 1  # the largest limit Python's setrlimit converts
RLIMIT_FIELDS = {"cpu": "cpu_s (or timeout_s)", "as": "memory_bytes", "fsize": "file_size_bytes",
                 "nofile": "open_files", "nproc": "processes", "core": "core"}


@dataclass(frozen=True)
class Limits:
    """Per-run limits. `cpu_s` defaults to the timeout rounded up plus one second.

    `memory_bytes` and `processes` bound the whole run, all its processes together, where the
    machine gives the sandbox a cgroup (`Protections.cgroup`); `memory_bytes` is also every
    process's address-space limit. `scratch_bytes` caps what the program can store in its
    scratch directory (/tmp, which /dev/shm points to) in all."""

    timeout_s: float = 10.0
    memory_bytes: int = 1 << 30
    file_size_bytes: int = 16 << 20
    open_files: int = 64
    processes: int = 64
    output_bytes: int = 64 << 10  # kept of each of stdout and stderr; 64x this in all kills
    scratch_bytes: int = 64 << 20
    cpu_s: int | None = None

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_bytes", "file_size_bytes", "open_files", "processes",
                     "output_bytes", "scratch_bytes"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
                raise SandboxError(f"Limits.{name} must be a positive number, got {value!r}")
        if self.cpu_s is not None and not self.cpu_s >= 1:
            raise SandboxError(f"Limits.cpu_s must be >= 1, got {self.cpu_s!r}")
        for name, value in self.rlimits(whole_run=False).items():  # what setrlimit can take
            if value > RLIMIT_MAX:
                raise SandboxError(f"Limits.{RLIMIT_FIELDS[name]} is beyond what setrlimit "
                                   f"takes ({float(value):.3g}; at most 2**63 - 1)")

    def check_machine(self) -> None:
        """Refuse (SandboxError) a limit this machine would not let the worker set, before any
        process starts: else the worker dies setting it, and that reads as the program's
        failure. Raising a hard limit takes real root; open files stop at fs.nr_open."""
        import resource

        for name, value in self.rlimits(whole_run=False).items():
            hard = resource.getrlimit(getattr(resource, "RLIMIT_" + name.upper()))[1]
            ceiling = None if hard == resource.RLIM_INFINITY or os.geteuid() == 0 else hard
            if name == "nofile":
                with contextlib.suppress(OSError, ValueError):
                    nr_open = int(Path("/proc/sys/fs/nr_open").read_text())
                    ceiling = nr_open if ceiling is None else min(ceiling, nr_open)
            if ceiling is not None and value > ceiling:
                raise SandboxError(f"Limits.{RLIMIT_FIELDS[name]}: {value} is above this "
                                   f"machine's limit for RLIMIT_{name.upper()} ({ceiling})")

    def rlimits(self, whole_run: bool) -> dict[str, int]:
        """Per-process limits; `whole_run`: a cgroup counts the run's processes, so no
        RLIMIT_NPROC (which counts every process of the uid, other runs' included)."""
        limits = {"cpu": self.cpu_s or math.ceil(self.timeout_s) + 1, "as": self.memory_bytes,
                  "fsize": self.file_size_bytes, "nofile": self.open_files, "core": 0}
        return limits if whole_run else {**limits, "nproc": self.processes}


@dataclass(frozen=True)
class Protections:
    """What isolation this machine gives the sandbox; `warnings` names each missing layer."""

    python: str
    uid: int | None  # the worker's uid, None when it keeps ours
    namespaces: tuple[str, ...]  # of "net", "pid", "mount", "ipc"
    user_namespace: bool  # the namespaces come from an unprivileged user namespace
    root: tuple[tuple[str, ...], ...] | None = None  # the private root (sandbox/rootfs.py)
    cgroup: Hierarchy | None = None  # where each run's cgroup is made; None: rlimits only
    warnings: tuple[str, ...] = ()

    def active(self) -> list[str]:
        per_process = "CPU, address space, file size, open files, core"
        layers = ["separate process per run (fresh interpreter, -I -B -S)",
                  f"resource limits per process ({per_process}"
                  f"{'' if self.cgroup else ', processes of the uid'})",
                  "wall-clock timeout and whole-tree kill", "size-capped scratch directory",
                  "minimal environment", "verdict computed outside the program's process"]
        if self.uid is not None:
            layers.append(f"unprivileged uid {self.uid}")
        if "net" in self.namespaces:
            layers.append("no network (network namespace)")
        if "pid" in self.namespaces:
            layers.append("own pid namespace")
        if "ipc" in self.namespaces:
            layers.append("own IPC namespace (System V and POSIX IPC private to the run)")
        if self.root is not None:
            layers.append("private root: the interpreter and its standard library read-only, "
                          "a tmpfs /tmp, nothing else of the machine")
        if self.cgroup is not None:
            layers.append(f"memory and process limits for the whole run "
                          f"({self.cgroup.describe()})")
        return layers


@dataclass
class Verdict:
    status: str
    reason: str
    tests: list[dict] = field(default_factory=list)
    program_error: dict | None = None
    stdout: str = ""
    stderr: str = ""
    output_truncated: bool = False
    wall_s: float = 0.0
    protections: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def first_failure(self) -> dict | None:
        """The first test that did not pass, or the program's own error as a pseudo-test."""
        failing = next((t for t in self.tests if t["status"] != "passed"), None)
        if failing is None and self.program_error:
            return {"status": self.status, **self.program_error}
        return failing

    def to_dict(self) -> dict:
        return asdict(self)


def _output(cmd: list[str]) -> str | None:
    """What `cmd` prints, or None when it fails."""
    try:
        done = subprocess.run(cmd, env=ENV, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.decode(errors="replace") if done.returncode == 0 else None


def _runs(cmd: list[str]) -> bool:
    return _output(cmd) is not None


NAMESPACES = ("--net", "--pid", "--mount", "--ipc", "--fork", "--kill-child", "--mount-proc")


@functools.cache
def protections(python: str | None = None) -> Protections:
    """Probe (once per process and interpreter) which isolation layers this machine allows."""
    notes: list[str] = []
    is_root = os.geteuid() == 0
    probe = ["-I", "-S", "-c", "import ctypes, json, resource, selectors, math, re, collections, "
             "sys; print(sys.version, sys.prefix)"]
    candidates = [python] if python else [sys.executable, shutil.which("python3"),
                                          "/usr/bin/python3"]
    candidates = [c for c in dict.fromkeys(candidates) if c]
    chosen, uid, drop = None, None, []
    setpriv = shutil.which("setpriv")
    if is_root and setpriv:
        drop = [setpriv, f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups"]
        # The judge runs as root and forks the worker, which then imports as the sandbox uid:
        # the interpreter must be the same one (version and stdlib) for both.
        for c in candidates:
            as_uid = _output(drop + [c] + probe)
            if as_uid and as_uid == _output([c] + probe):
                chosen = c
                break
        uid = SANDBOX_UID if chosen else None
    if chosen is None:
        drop = []
        chosen = next((c for c in candidates if _runs([c] + probe)), None)
        if chosen is None:
            raise SandboxError(f"no usable Python interpreter for the sandbox among {candidates}")
        if is_root:
            notes.append(f"programs run as root: no interpreter among {candidates} is runnable "
                         f"by uid {SANDBOX_UID}, so files outside the scratch directory are "
                         "writable unless the program has a private root")
    namespaces: tuple[str, ...] = ()
    user_ns = False
    unshare = shutil.which("unshare")
    if unshare:
        if is_root and _runs([unshare, *NAMESPACES, "true"]):
            namespaces = ("net", "pid", "mount", "ipc")
        elif _runs([unshare, "--user", "--map-root-user", *NAMESPACES, "true"]):
            namespaces, user_ns = ("net", "pid", "mount", "ipc"), True
    root = None
    if namespaces:
        try:
            root = rootfs.spec(chosen, rootfs.interpreter_files(drop + [chosen], ENV))
        except rootfs.RootError as e:
            raise SandboxError(str(e)) from None
    else:
        notes.append("no namespaces (unshare unavailable or not permitted): the program sees "
                     "the machine's files, System V and POSIX IPC, and the network; processes "
                     "that escape the session are only found through the child-subreaper scan")
    if user_ns:
        notes.append("no uid drop (not root): the program keeps this user's identity inside "
                     "the sandbox")
    try:
        hierarchy = find_hierarchy()
    except CgroupUnavailable as e:
        hierarchy = None
        notes.append(f"no cgroup ({e}): the memory limit holds per process, not for the run, "
                     "and the process limit counts every process of the program's uid on the "
                     "machine, other runs' included")
    return Protections(python=chosen, uid=uid, namespaces=namespaces, user_namespace=user_ns,
                       root=root, cgroup=hierarchy, warnings=tuple(notes))


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(f"sandbox: {message}", RuntimeWarning, stacklevel=3)


def _command(prot: Protections) -> list[str]:
    cmd = []
    if prot.namespaces:
        cmd = [shutil.which("unshare") or "unshare"]
        if prot.user_namespace:
            cmd += ["--user", "--map-root-user"]
        cmd += list(NAMESPACES)
    return cmd + [prot.python, "-I", "-B", "-S", str(RUNNER)]


def _frame(message: dict) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack(">I", len(data)) + data


def run(program: str, tests: list[str], setup: str = "", limits: Limits | None = None,
        trace: bool = False, isolation: Protections | None = None) -> Verdict:
    """Run `program`, then each test (Python source, usually one assert) against it.

    `setup` is trusted test code run before the tests in the tests' namespace (imports,
    helpers such as HumanEval's `check`). `trace=True` adds a bounded line trace of the first
    failing call. `isolation` overrides the probed protections (tests use it to check that a
    weaker configuration warns).
    """
    limits = limits or Limits()
    limits.check_machine()
    prot = isolation or protections()
    for note in prot.warnings:
        _warn_once(note)
    started = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="egmla-sandbox-")
    if prot.uid is not None:
        os.chmod(workdir, 0o711)
    group, oom_kills = None, 0
    try:
        if prot.cgroup is not None:
            try:
                group = RunCgroup(prot.cgroup, limits.memory_bytes, limits.processes)
            except CgroupUnavailable as e:
                raise SandboxError(str(e)) from None
        first = {"program": program, "limits": limits.rlimits(whole_run=group is not None),
                 "uid": prot.uid, "workdir": workdir, "scratch_bytes": limits.scratch_bytes,
                 "root": None if prot.root is None else [list(e) for e in prot.root],
                 "cgroup_procs": group.procs_files() if group else []}
        second = {"tests": list(tests), "setup": setup, "timeout": limits.timeout_s,
                  "max_output": limits.output_bytes, "trace": trace}
        proc = subprocess.Popen(_command(prot), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=ENV, cwd=workdir,
                                start_new_session=True)
        try:
            out, err = proc.communicate(_frame(first) + _frame(second),
                                        timeout=limits.timeout_s + STARTUP_GRACE_S)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_tree(proc, "pid" in prot.namespaces)
            out, err = proc.communicate()
            timed_out = True
        finally:
            _kill_tree(proc, "pid" in prot.namespaces)
        oom_kills = group.oom_kills() if group else 0
    finally:
        try:
            if group is not None:
                group.remove()
        except OSError as e:
            raise SandboxError(f"cannot remove the run's cgroup {e.filename}: {e.strerror}") \
                from None
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    base = {"wall_s": round(time.monotonic() - started, 4), "protections": prot.active(),
            "warnings": list(prot.warnings)}
    verdict = _verdict(proc, out, err, timed_out, limits, base)
    if oom_kills:  # whatever the tests said: a process of the run died for want of memory
        verdict.status = "memory"
        verdict.reason = (f"the run's processes together reached its memory limit "
                          f"({limits.memory_bytes} bytes): the kernel killed {oom_kills} of them")
    return verdict


def _verdict(proc: subprocess.Popen, out: bytes, err: bytes, timed_out: bool, limits: Limits,
             base: dict) -> Verdict:
    if timed_out:
        return Verdict("timeout", f"no verdict within {limits.timeout_s + STARTUP_GRACE_S:g} s",
                       **base)
    try:
        raw = json.loads(out)
    except ValueError:
        tail = err.decode("utf-8", "replace")[-1500:]
        if proc.returncode and proc.returncode < 0:
            reason = f"the sandbox was killed by {signal.Signals(-proc.returncode).name}"
            return Verdict("killed", reason, **base)
        raise SandboxError(f"the sandbox's judge failed (exit {proc.returncode}): {tail}")
    return Verdict(raw["status"], raw["reason"], tests=raw["tests"],
                   program_error=raw.get("program_error"), stdout=raw["stdout"]["text"],
                   stderr=raw["stderr"]["text"],
                   output_truncated=raw["stdout"]["truncated"] or raw["stderr"]["truncated"],
                   **base)


def _kill_tree(proc: subprocess.Popen, pid_namespace: bool) -> None:
    """Kill the sandbox and return once every process of it is gone.

    With namespaces `proc` is `unshare`, whose child is the judge, pid 1 of the sandbox's pid
    namespace. Killed, the judge cannot be reaped before the kernel has killed and reaped every
    other process of the namespace, and `unshare` exits only after reaping the judge: so once
    `proc` has exited, nothing of the run is left (killing `unshare` first would orphan the
    judge, and its namespace would die on its own time). Then the session, for whatever else
    is in it, but only while `proc` is unreaped, so that its process group id cannot have
    been reused."""
    if proc.returncode is None and pid_namespace:
        for pid in _children(proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


__all__ = ["STATUSES", "Limits", "Protections", "SandboxError", "Verdict", "protections", "run"]
