"""The sandbox against hostile programs: each must end contained, within its timeout plus a
small margin, with the right verdict, and leave the host as it was."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from sandbox import Limits, Protections, SandboxError, protections, run
from support import ROOT
from support.processes import sandbox_uid_processes

TIMEOUT = 3.0
MARGIN = 3.0  # interpreter start-up and tree kill on a busy 2-core machine
LIMITS = Limits(timeout_s=TIMEOUT)
GOOD = "def f(x):\n    return x + 1\n"


def host_processes(marker: str) -> list[str]:
    """Host processes whose command line contains `marker` (other than pytest itself)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if marker.encode() in cmdline:
                found.append(f"{pid}: {cmdline[:200]!r}")
    return found






def contained(program: str, tests: list[str], limits: Limits = LIMITS, **kw):
    before = set(os.listdir("/tmp"))
    mounts = Path("/proc/self/mountinfo").read_text()
    verdict = run(program, tests, limits=limits, **kw)
    assert Path("/proc/self/mountinfo").read_text() == mounts
    assert verdict.wall_s < limits.timeout_s + MARGIN, verdict
    assert sandbox_uid_processes() == [], "a sandboxed process outlived its run"
    leftovers = {p for p in set(os.listdir("/tmp")) - before if p.startswith("egmla-sandbox")}
    assert not leftovers
    cgroup = protections().cgroup
    assert [n for _, parent in (cgroup.parents if cgroup else ()) for n in os.listdir(parent)
            if n.startswith("egmla-sandbox")] == [], "a run's cgroup outlived it"
    return verdict


def test_protections_on_this_machine_are_reported():
    prot = protections()
    layers = prot.active()
    assert any("resource limits" in x for x in layers)
    assert any("verdict computed outside" in x for x in layers)
    if os.geteuid() == 0:  # these CI machines: the full set, so the hostile tests below are real
        assert prot.uid is not None and set(prot.namespaces) == {"net", "pid", "mount", "ipc"}
        assert prot.root is not None and prot.cgroup is not None and prot.warnings == ()


def test_pass_fail_error_verdicts_with_details():
    v = contained(GOOD + "print('hello')\n",
                  ["assert f(1) == 2", "assert f(2) == 4", "assert f('a') == 1"], trace=True)
    assert v.status == "failed" and v.stdout == "hello\n"
    assert [t["status"] for t in v.tests] == ["passed", "failed", "error"]
    failed, error = v.tests[1], v.tests[2]
    assert (failed["expected"], failed["actual"], failed["call"]) == ("4", "3", "f(2)")
    assert "return f(x=2) -> 3" not in failed["trace"] and "-> 3" in failed["trace"]
    assert error["type"] == "TypeError" and error["line"] == 2
    assert contained(GOOD, ["assert f(1) == 2"]).status == "passed"
    syntax = contained("def f(x):\n    return x +\n", ["assert f(1) == 2"])
    assert syntax.status == "error" and syntax.program_error["type"] == "SyntaxError"
    assert syntax.program_error["line"] == 2


def test_values_cross_the_boundary_as_plain_data():
    program = ("from collections import Counter, namedtuple\n"
               "P = namedtuple('P', 'x y')\n"
               "def f():\n"
               "    return [1, 2.5, float('nan'), 'é', b'\\x00', (1,), {2}, {'a': [None]},\n"
               "            Counter('aab'), P(1, 2), 10**30, 1j, range(3)]\n"
               "def g():\n    return (i for i in range(3))\n"
               "def h():\n    return object()\n")
    v = contained(program, [
        "r = f()\nassert r[0:2] == [1, 2.5] and r[2] != r[2]\n"
        "assert r[3:] == ['é', b'\\x00', (1,), {2}, {'a': [None]}, {'a': 2, 'b': 1}, (1, 2),\n"
        "                 10**30, 1j, range(3)]",
        "assert list(g()) == [0, 1, 2]",
        "assert h() and h() != h()",  # an opaque stand-in: truth value kept, equal to nothing
        "assert h() == 1",
        "assert f(h()) == 1"])
    assert [t["status"] for t in v.tests] == ["passed", "passed", "passed", "failed", "failed"]
    assert v.tests[3]["actual"].startswith("<object object at")
    assert "cannot be sent back" in v.tests[4]["message"]


def test_fork_bomb_is_contained():
    bomb = ("import os\n"
            "while True:\n"
            "    try:\n        os.fork()\n"
            "    except OSError:\n        pass\n")
    v = contained(bomb, ["assert True"])
    assert v.status in ("timeout", "killed")
    assert subprocess.run(["true"]).returncode == 0


def test_infinite_loop_ignoring_sigalrm_and_sigxcpu_times_out():
    program = ("import signal\n"
               "for s in (signal.SIGALRM, signal.SIGXCPU, signal.SIGTERM):\n"
               "    signal.signal(s, signal.SIG_IGN)\n"
               "signal.alarm(1)\n"
               "def f(x):\n    while True:\n        pass\n")
    v = contained(program, ["assert f(1) == 2"])
    assert v.status == "timeout"


def test_huge_integer_power_times_out():
    v = contained("def f():\n    return 10**10**8\n", ["assert f() > 0"])
    assert v.status == "timeout"


def test_memory_hog_gets_memory_verdict():
    hog = ("def f():\n    chunks = []\n    while True:\n"
           "        chunks.append(bytearray(50 * 2**20))\n")
    v = contained(hog, ["assert f() is None"], limits=Limits(timeout_s=TIMEOUT,
                                                              memory_bytes=256 << 20))
    assert v.status == "memory" and v.tests[0]["type"] == "MemoryError"
    at_once = contained("x = bytearray(10**12)\n", ["assert True"])
    assert at_once.status == "memory" and at_once.program_error["type"] == "MemoryError"


def test_gigabytes_of_output_are_cut_off():
    spew = "import sys\nchunk = 'x' * 65536\nwhile True:\n    sys.stdout.write(chunk)\n"
    v = contained(spew, ["assert True"], limits=Limits(timeout_s=TIMEOUT, output_bytes=4096))
    assert v.status == "killed" and "output limit" in v.reason
    assert len(v.stdout) == 4096 and v.output_truncated


def test_closing_stdout_and_reading_stdin_do_not_hang_or_break_the_verdict():
    program = ("import os, sys\n"
               "data = sys.stdin.read()\n"
               "os.close(1)\nos.close(0)\n"
               "def f(x):\n    return len(data) + x\n")
    assert contained(program, ["assert f(1) == 1"]).status == "passed"
    v = contained("name = input()\n", ["assert True"])
    assert v.status == "error" and v.program_error["type"] == "EOFError"


@pytest.fixture
def host_dir():
    """A world-writable host directory outside /tmp (which the sandbox replaces)."""
    path = Path(tempfile.mkdtemp(prefix=".sandbox-victim-", dir=Path(__file__).parent))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path)


@pytest.mark.parametrize("where", ["tmp", "repo"])
def test_files_outside_the_scratch_directory_cannot_be_written_or_deleted(where, tmp_path,
                                                                           host_dir):
    root = tmp_path if where == "tmp" else host_dir
    root.chmod(0o777)
    victim = root / "victim.txt"
    victim.write_text("precious")
    victim.chmod(0o666)
    for program in (f"open({str(victim)!r}, 'w').write('pwned')\n",
                    f"import os\nos.remove({str(victim)!r})\n",
                    f"open({str(root / 'new.txt')!r}, 'w').write('x')\n",
                    f"import shutil\nshutil.rmtree({str(root)!r})\n"):
        v = contained(program, ["assert True"])
        assert v.status == "error", program
        assert v.program_error["type"] in ("PermissionError", "OSError", "FileNotFoundError")
    assert victim.read_text() == "precious" and sorted(os.listdir(root)) == ["victim.txt"]


def test_the_program_has_a_private_writable_tmp_and_scratch_directory():
    escape = Path("/tmp/egmla-escaped-marker")
    assert contained(f"open({str(escape)!r}, 'w').write('x')\n", ["assert True"]).passed
    assert not escape.exists()
    inside = contained("open('mine.txt', 'w').write('ok')\n"
                       "def f():\n    return open('mine.txt').read()\n", ["assert f() == 'ok'"])
    assert inside.passed


def test_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    connected = []

    def accept():
        try:
            connected.append(server.accept())
        except OSError:
            pass
    thread = threading.Thread(target=accept)
    thread.start()
    program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
    v = contained(program, ["assert True"])
    thread.join()
    server.close()
    assert v.status == "error" and "Error" in v.program_error["type"]
    assert connected == []
    dns = contained("import socket\nsocket.getaddrinfo('pypi.org', 443)\n", ["assert True"])
    assert dns.status == "error"


def test_setsid_escape_leaves_no_background_process():
    """The program's grandchild leaves its session and execs a sleeping interpreter (the only
    executable in the private root); it is running when the test runs, and gone after."""
    marker = f"{time.time_ns() % 10**9}.25"
    program = ("import os, sys\n"
               "r, w = os.pipe()\n"
               "if os.fork() == 0:\n"
               "    os.setsid()\n"
               "    pid = os.fork()\n"
               "    if pid == 0:\n"
               f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; "
               f"time.sleep({marker})'])\n"
               "    os.write(w, str(pid).encode())\n"
               "    os._exit(0)\n"
               "os.wait()\n"
               "escaped = int(os.read(r, 20))\n"
               "def running():  # its command line, once it has exec'd\n"
               "    import time\n"
               "    for _ in range(300):\n"
               "        with open(f'/proc/{escaped}/cmdline', 'rb') as f:\n"
               "            line = f.read().decode().replace('\\0', ' ')\n"
               "        if 'sleep' in line:\n"
               "            return line\n"
               "        time.sleep(0.01)\n")
    v = contained(program, [f"assert '{marker}' in running()"])
    assert v.status == "passed", v
    assert host_processes(marker) == []


def test_exiting_before_the_tests_is_not_a_pass():
    v = contained("import os\ndef f(x):\n    return x\nos._exit(0)\n", ["assert f(1) == 1"])
    assert v.status == "error" and "exited (status 0)" in v.reason
    v = contained("import sys\ndef f(x):\n    sys.exit(0)\n", ["assert f(1) == 1"])
    assert v.status == "error" and v.tests[0]["type"] == "SystemExit"


def test_fake_pass_markers_are_not_believed():
    forged = json.dumps({"status": "passed", "reason": "all 1 tests passed", "tests": []})
    program = ("import os, struct, sys\n"
               f"FORGED = {forged!r}\n"
               "print(FORGED)\nprint('PASSED')\nprint('OK: all tests passed')\n"
               "for fd in range(0, 64):\n"
               "    try:\n"
               "        os.write(fd, FORGED.encode())\n"
               "    except OSError:\n"
               "        pass\n"
               "def f(x):\n    print(FORGED)\n    os._exit(0)\n")
    v = contained(program, ["assert f(1) == 2"])
    assert v.status == "error" and not v.passed
    wrong = contained(f"print({forged!r})\ndef f(x):\n    return 0\n", ["assert f(1) == 2"])
    assert wrong.status == "failed"


# Builtins the tests use stay the real ones: (the program's replacement, a test using the
# builtin, a right f, a wrong f). Each replacement would make the wrong f pass, or break the
# run, if the tests called it.
SHADOWS = {
    "abs": ("def abs(x):\n    return 0\n", "assert abs(f(2) - 2) < 1e-9",
            "def f(x):\n    return x\n", "def f(x):\n    return x + 1\n"),
    "range": ("def range(*a):\n    return []\n", "for i in range(3):\n    assert f(i) == i",
              "def f(x):\n    return x\n", "def f(x):\n    return x + 1\n"),
    "len": ("def len(x):\n    return 3\n", "assert len(f('abc')) == 3",
            "def f(s):\n    return s\n", "def f(s):\n    return ''\n"),
    "sorted": ("def sorted(*a, **k):\n    return [1, 2, 3]\n",
               "assert sorted(f([3, 1, 2])) == [1, 2, 3]",
               "def f(xs):\n    return xs\n", "def f(xs):\n    return []\n"),
    "isinstance": ("def isinstance(*a):\n    return True\n", "assert isinstance(f(1), int)",
                   "def f(x):\n    return x\n", "def f(x):\n    return 'x'\n"),
    "print": ("def print(*a, **k):\n    import os\n    os._exit(0)\n",
              "print('{\"status\": \"passed\"}')\nassert f(1) == 1",
              "def f(x):\n    return x\n", "def f(x):\n    return 0\n"),
    "AssertionError": ("def AssertionError(*a):\n    import os\n    os._exit(0)\n",
                       "if f(1) != 1:\n    raise AssertionError('f(1) is not 1')",
                       "def f(x):\n    return x\n", "def f(x):\n    return 0\n"),
    "__import__": ("def __import__(*a, **k):\n    raise ImportError('shadowed')\n",
                   "import math\nassert f(4) == math.sqrt(4)",
                   "def f(x):\n    return x ** 0.5\n", "def f(x):\n    return x\n"),
    "builtins.abs": ("import builtins\nbuiltins.abs = lambda x: 0\n", "assert abs(f(2) - 2) < 1e-9",
                     "def f(x):\n    return x\n", "def f(x):\n    return x + 1\n"),
}


@pytest.mark.parametrize("name", SHADOWS)
def test_a_program_cannot_replace_a_builtin_the_tests_use(name):
    shadow, test, right, wrong = SHADOWS[name]
    v = contained(shadow + wrong, [test])
    assert v.status == "failed", v
    if name == "AssertionError":
        assert v.tests[0]["message"] == "f(1) is not 1"
    # A helper named like a builtin is the program's own business: a right f passes.
    assert contained(shadow + right, [test]).status == "passed"


def test_a_function_under_test_named_like_a_builtin_reaches_the_tests():
    """The rule's one exception (MBPP/126 asks for `sum(a, b)`): when the tests use no other
    function of the program, its single builtin-named function is the one under test."""
    gcd_sum = "def sum(a, b):\n    return sum_of(a, b)\ndef sum_of(a, b):\n    return {}\n"
    assert contained(gcd_sum.format(6), ["assert sum(10, 15) == 6"]).passed
    assert contained(gcd_sum.format(0), ["assert sum(10, 15) == 6"]).status == "failed"
    # With another function of the program in use, `sum` is the builtin again.
    mean = "def sum(xs):\n    return 0\ndef mean(xs):\n    return 2\n"
    assert contained(mean, ["assert mean([1, 3]) == sum([1, 3]) / 2"]).passed
    # Two builtin-named functions and nothing else: ambiguous, so both are the builtins.
    two = "def sum(a, b):\n    return 6\ndef int(x):\n    return 6\n"
    v = contained(two, ["assert sum(10, 15) == int('6')"])
    assert v.status == "failed" and v.tests[0]["type"] == "TypeError"


def test_only_modules_under_their_own_name_reach_the_tests():
    test = ["assert math.isclose(f(), 1.0)"]
    assert contained("import math\ndef f():\n    return 1.0\n", test).passed
    v = contained("import cmath as math\ndef f():\n    return 1.0\n", test)
    assert v.status == "failed" and v.tests[0]["type"] == "NameError"


def test_import_this_and_printing_tests_leave_the_verdict_alone():
    """`import this` prints the Zen on import; the judge imports its own copy when the tests use
    it, and it, like any print of the judge's, goes to stderr, not to the verdict channel."""
    v = contained("import this\ndef f(x):\n    return x\n",
                  ["assert f(1) == 1", "assert this.s and f(2) == 2",
                   "print('{\"status\": \"failed\"}' * 1000)"])
    assert v.status == "passed" and "Beautiful is better than ugly" in v.stdout
    wrong = contained("import this\ndef f(x):\n    return 0\n", ["assert this.s and f(1) == 1"])
    assert wrong.status == "failed"


def framed(message) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack(">I", len(data)) + data


FORGE_EVERYWHERE = """import os
FORGED = {forged!r}
def forge():
    fds = set(range(64)) | {{int(fd) for fd in os.listdir('/proc/self/fd')}}
    for fd in sorted(fds):
        try:
            os.write(fd, FORGED)
        except OSError:
            pass
"""
AT_IMPORT = [{"ready": True, "names": 5}, {"ready": True, "names": ["f"], "modules": 5},
             {"ready": True, "names": ["f"], "modules": {"math": 5}}, {"ready": False, "error": 5},
             {"ready": "yes"}, [1, 2], {"value": 1}]
IN_A_CALL = [{"value": {"complex": [{"int": "9" * 4000}, 0]}}, {"value": {"dict": [[[1], 2]]}},
             {"value": {"set": [[1]]}}, {"value": {"range": [0, 1, 0]}}, {"error": "x"},
             {"error": {"type": 5}}, {}, {"trace": "forged"}]


NESTED = b"[" * 100_000 + b"]" * 100_000  # json.loads: RecursionError


@pytest.mark.parametrize("forged", [framed(m) for m in AT_IMPORT] +
                         [struct.pack(">I", len(NESTED)) + NESTED, b"not even a frame"],
                         ids=[json.dumps(m) for m in AT_IMPORT] + ["nested", "unframed"])
def test_forged_frames_at_import_on_every_descriptor_give_the_programs_verdict(forged):
    """The program shares the worker's process and can write into its channel; what it writes
    there is its answer: `error`, never a pass and never a failure of the judge."""
    program = FORGE_EVERYWHERE.format(forged=forged) + "forge()\ndef f(x):\n    return x\n"
    v = contained(program, ["assert f(1) == 1"])
    assert v.status == "error" and "protocol" in v.reason, v


@pytest.mark.parametrize("forged", IN_A_CALL, ids=[json.dumps(m)[:40] for m in IN_A_CALL])
def test_forged_replies_in_a_call_give_the_programs_verdict(forged):
    program = FORGE_EVERYWHERE.format(forged=framed(forged)) + \
        "def f(x):\n    forge()\n    return x\n"
    v = contained(program, ["assert f(1) == 1"], trace=True)
    assert v.status == "error" and "protocol" in v.reason, v


def test_forged_frames_on_stdout_and_stderr_change_nothing():
    forged = framed({"ready": True, "names": 5}) + json.dumps({"status": "passed"}).encode()
    forge = f"import os\nfor fd in (1, 2):\n    os.write(fd, {forged!r})\n"
    assert contained(forge + "def f(x):\n    return x\n", ["assert f(1) == 1"]).passed
    assert contained(forge + "def f(x):\n    return 0\n", ["assert f(1) == 1"]).status == "failed"


def test_cli_gives_the_programs_verdict_not_bad_input_for_hostile_output(tmp_path):
    (tmp_path / "tests.py").write_text("assert f(1) == 1\n")
    programs = {"this.py": ("import this\ndef f(x):\n    return x\n", 0, "passed"),
                "forged.py": (FORGE_EVERYWHERE.format(forged=framed({"ready": True, "names": 5}))
                              + "forge()\ndef f(x):\n    return x\n", 1, "error")}
    for name, (source, code, status) in programs.items():
        (tmp_path / name).write_text(source)
        cmd = [sys.executable, "-m", "sandbox", str(tmp_path / name),
               "--tests", str(tmp_path / "tests.py"), "--timeout", "5", "--json"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert out.returncode == code, out.stderr
        assert json.loads(out.stdout)["status"] == status


@pytest.mark.parametrize("flag, value, named", [
    ("--memory-mb", "99999999999999", "Limits.memory_bytes is beyond what setrlimit takes"),
    ("--timeout", "1e300", "Limits.cpu_s (or timeout_s) is beyond what setrlimit takes"),
    ("--timeout", "nan", "Limits.timeout_s must be a positive number"),
])
def test_cli_refuses_a_limit_the_kernel_cannot_take_as_bad_input(tmp_path, flag, value, named):
    """Not a verdict on the program: before this, a limit setrlimit could not take killed the
    worker as it set it, and the program was reported as having exited before its tests."""
    (tmp_path / "prog.py").write_text(GOOD)
    (tmp_path / "tests.py").write_text("assert f(1) == 2\n")
    out = subprocess.run([sys.executable, "-m", "sandbox", str(tmp_path / "prog.py"), "--tests",
                          str(tmp_path / "tests.py"), flag, value], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("error:") and named in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_a_limit_above_the_machines_is_refused_before_anything_runs():
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    ceiling = int(Path("/proc/sys/fs/nr_open").read_text())
    if hard != resource.RLIM_INFINITY and os.geteuid() != 0:
        ceiling = min(ceiling, hard)
    with pytest.raises(SandboxError, match=f"Limits.open_files: {ceiling + 1} is above this "
                                           f"machine's limit for RLIMIT_NOFILE \\({ceiling}\\)"):
        run(GOOD, ["assert f(1) == 2"], limits=Limits(timeout_s=TIMEOUT, open_files=ceiling + 1))
    assert run(GOOD, ["assert f(1) == 2"], limits=Limits(timeout_s=TIMEOUT,
                                                         open_files=min(ceiling, 4096))).passed


def test_deep_recursion():
    v = contained("def f(n):\n    return f(n + 1)\n", ["assert f(0) == 1"])
    assert v.status == "error" and v.tests[0]["type"] == "RecursionError"
    unbounded = ("import sys\nsys.setrecursionlimit(10**7)\n"
                 "def f(n):\n    return f(n + 1) + 1\n")
    v = contained(unbounded, ["assert f(0) == 1"])
    assert v.status in ("error", "memory", "timeout")  # C stack, heap or time: whichever first


def test_the_parents_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("EGMLA_TEST_SECRET", "hunter2-secret")
    program = ("import os\n"
               "def env():\n    return dict(os.environ)\n"
               "def scan():\n"
               "    found = []\n"
               "    for pid in os.listdir('/proc'):\n"
               "        try:\n"
               "            if b'hunter2' in open(f'/proc/{pid}/environ', 'rb').read():\n"
               "                found.append(pid)\n"
               "        except OSError:\n"
               "            pass\n"
               "    return found\n")
    v = contained(program, ["assert 'EGMLA_TEST_SECRET' not in env()", "assert scan() == []",
                            "assert sorted(env()) == ['HOME', 'LANG', 'PATH', 'TMPDIR']"])
    assert v.status == "passed", v.tests


def test_a_weaker_machine_warns_instead_of_failing_silently():
    prot = protections()
    weaker = Protections(python=prot.python, uid=None, namespaces=(), user_namespace=False,
                         warnings=("no namespaces (test): programs can open network "
                                   "connections",))
    with pytest.warns(RuntimeWarning, match="no namespaces"):
        v = run(GOOD, ["assert f(1) == 2", "assert f(1) == 3"], limits=LIMITS,
                isolation=weaker)
    assert v.status == "failed" and v.warnings == list(weaker.warnings)
    assert not any("network namespace" in x for x in v.protections)


def test_cli_prints_one_json_verdict(tmp_path):
    (tmp_path / "prog.py").write_text(GOOD)
    (tmp_path / "tests.py").write_text("import math\n\ndef test_one():\n    assert f(0) == 1\n\n"
                                       "assert f(1) == 2\nassert f(2) == math.pi\n")
    cmd = [sys.executable, "-m", "sandbox", str(tmp_path / "prog.py"),
           "--tests", str(tmp_path / "tests.py"), "--timeout", "5", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    verdict = json.loads(out.stdout)
    assert verdict["status"] == "failed"
    assert [t["status"] for t in verdict["tests"]] == ["passed", "passed", "failed"]
    bad = subprocess.run(cmd[:4] + ["--tests", str(tmp_path / "missing.py")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error:") and "missing.py" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


NON_ROOT_CHECKS = """
import json, sys, warnings
sys.path.insert(0, sys.argv[1])
from sandbox import protections, run
victim = sys.argv[2]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    prot = protections()
    remount = ("import ctypes\\n"
               "c = ctypes.CDLL(None, use_errno=True)\\n"
               "assert c.mount(None, b'/', None, 32 | 4096, None) == 0, 'remount refused'\\n")
    verdicts = {
        "write": run(f"open({victim!r}, 'w').write('pwned')\\n", ["assert True"]).status,
        "network": run("import socket\\nsocket.create_connection(('127.0.0.1', 22), 1)\\n",
                       ["assert True"]).status,
        "remount": run(remount, ["assert True"]).status,
        "good": run("def f(x):\\n    return x + 1\\n", ["assert f(1) == 2"]).status,
        "wrong": run("print('PASSED')\\ndef f(x):\\n    return x\\n", ["assert f(1) == 2"]).status,
    }
print(json.dumps({"user_namespace": prot.user_namespace, "uid": prot.uid,
                  "warnings": [str(w.message) for w in caught], "verdicts": verdicts}))
"""


def test_an_unprivileged_user_gets_namespaces_and_a_read_only_filesystem(host_dir):
    """Most users are not root: the sandbox then runs in a user namespace. Checked for real, as
    uid nobody when these tests run as root."""
    victim = host_dir / "victim.txt"
    victim.write_text("precious")
    victim.chmod(0o666)  # writable by anyone: only the read-only remount protects it
    repo = str(ROOT)
    cmd = [protections().python, "-c", NON_ROOT_CHECKS, repo, str(victim)]
    if os.geteuid() == 0:
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] + cmd
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd="/",
                         env={"PATH": "/usr/bin:/bin", "HOME": "/"})
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["uid"] is None and any("no uid drop" in w for w in result["warnings"])
    assert result["user_namespace"], "this machine allows unprivileged user namespaces"
    assert result["verdicts"] == {"write": "error", "network": "error", "remount": "error",
                                  "good": "passed", "wrong": "failed"}
    assert victim.read_text() == "precious"


BLOCK_TESTS = """import contextlib
CASES = []
for n in range(4):
    CASES.append((n, n + 1))
TABLE = dict(CASES)  # runs after the loop above, so it sees the four cases
for n, want in TABLE.items():
    assert f(n) == want
if TABLE:
    assert f(10) == 11
with contextlib.suppress(KeyError):
    assert f(1) == 2
try:
    assert f(2) == 3
except ZeroDivisionError:
    pass
def test_last():
    assert f(0) == 1
"""


def test_cli_asserts_inside_top_level_blocks_are_tests_in_file_order(tmp_path):
    """Every top-level statement that can fail is a test: asserts inside `for`, `if`, `with`
    and `try` count (a file of only those was "no tests found"), and the file runs in order."""
    tests = tmp_path / "tests.py"
    tests.write_text(BLOCK_TESTS)
    only_loop = tmp_path / "loop.py"
    only_loop.write_text("for n in range(3):\n    assert f(n) == n + 1\n")

    def cli(program: str, tests_file) -> dict:
        (tmp_path / "prog.py").write_text(program)
        cmd = [sys.executable, "-m", "sandbox", str(tmp_path / "prog.py"),
               "--tests", str(tests_file), "--timeout", "5", "--json"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert out.returncode in (0, 1), out.stderr
        return json.loads(out.stdout)

    right = cli(GOOD, tests)
    assert right["status"] == "passed" and len(right["tests"]) == 6, right["tests"]
    wrong = cli("def f(x):\n    return x + 2\n", tests)
    assert [t["status"] for t in wrong["tests"]] == ["passed"] + ["failed"] * 5
    assert wrong["tests"][1]["source"].startswith("TABLE = dict(CASES)")
    assert (wrong["tests"][1]["expected"], wrong["tests"][1]["actual"]) == ("1", "2")
    assert cli(GOOD, only_loop)["status"] == "passed"
    assert cli("def f(x):\n    return x\n", only_loop)["status"] == "failed"
