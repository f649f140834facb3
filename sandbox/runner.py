"""The trusted half of the sandbox, run inside it: `python -I -B -S runner.py`.

Two processes. This one (the judge) reads the request on stdin, forks a worker that runs the
untrusted program, and then runs the tests itself. The program's top-level functions that the
tests use reach them as proxies: calling one sends the arguments to the worker, which calls the
real function and sends back the result as plain data (numbers, strings, bytes, lists, tuples,
sets, dicts) or the exception it raised. So the tests, their asserts and the verdict all live in
a process where no untrusted code ever ran; the worker never sees the tests, runs under another
uid where one is available, and cannot inspect the judge (which is not dumpable).

Which names the tests get from the program (`tests_namespace`): only names the test code
(setup and tests) reads as globals and does not define itself, never a dunder, and never the
name of a builtin, so `def abs(x): return 0` changes `abs` for the program alone and the tests
keep the real one. The one exception: when the tests use no other function of the program, a
single function named like a builtin is the function under test (MBPP/126 asks for
`sum(a, b)`) and the tests get it.

The verdict is the one JSON object the judge writes, on a duplicate of its stdout taken before
anything else ran; fd 1 itself then points at stderr, so output of the judge's own (a module's
import-time print, a test's print) never mixes with it, and the worker gets no descriptor to it.
Everything the worker sends is checked: a message the judge cannot use means the program broke
the protocol (status `error`), never a failure of the judge. The worker's exit code and output
are reported, never believed.

Standard library only: this file runs under whichever interpreter the sandbox uid can execute.
"""

from __future__ import annotations

import ast
import builtins
import ctypes
import json
import math
import os
import resource
import selectors
import shutil
import signal
import struct
import symtable
import sys
import tempfile
import time
import traceback

PROGRAM_FILE = "program.py"
MAX_FRAME = 8 << 20  # bytes of one message between judge and worker
MAX_ITEMS = 100_000  # elements of one value crossing the boundary
MAX_DEPTH = 50
TRACE_EVENTS = 80
TRACE_CHARS = 4000
REPR_CHARS = 300

PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 4, 24, 36, 38
CAP_VERSION_3 = 0x20080522
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_NOATIME, MS_NODIRATIME = (
    1, 2, 4, 8, 32, 1024, 2048)
MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 4096, 16384, 1 << 18, 1 << 21, 1 << 24
MNT_DETACH = 2
DEVICES = ("null", "zero", "full", "random", "urandom")
SCRATCH = "/tmp"  # inside the private root: the program's working directory, HOME and TMPDIR


class Unsupported(TypeError):
    """A value that cannot cross the boundary as plain data."""


# ---- plain-data encoding (both directions; decoding never runs code) ----

def encode(value, depth: int = 0, budget: list | None = None):
    budget = [MAX_ITEMS] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0:
        raise Unsupported(f"value has more than {MAX_ITEMS} elements")
    if depth > MAX_DEPTH:
        raise Unsupported(f"value nested deeper than {MAX_DEPTH}")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if value.bit_length() > 4000 * 3.33:
            raise Unsupported("integer with more than 4000 digits")
        return {"int": str(int(value))} if abs(value) >= 2**53 else int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"float": repr(float(value))}
    if isinstance(value, str):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return {"bytes" if isinstance(value, bytes) else "bytearray": bytes(value).hex()}
    if isinstance(value, complex):
        return {"complex": [encode(value.real), encode(value.imag)]}
    sub = lambda items: [encode(v, depth + 1, budget) for v in items]
    if isinstance(value, list):
        return sub(value)
    if isinstance(value, tuple):
        return {"tuple": sub(value)}
    if isinstance(value, (set, frozenset)):
        return {"frozenset" if isinstance(value, frozenset) else "set": sub(value)}
    if isinstance(value, dict):
        return {"dict": [[encode(k, depth + 1, budget), encode(v, depth + 1, budget)]
                         for k, v in value.items()]}
    if isinstance(value, range):
        return {"range": [value.start, value.stop, value.step]}
    if type(value).__name__ in ("generator", "map", "filter", "zip", "enumerate", "reversed",
                                "list_iterator", "tuple_iterator", "dict_keys", "dict_values",
                                "dict_items", "itertools.chain", "chain"):
        items = []
        for item in value:
            items.append(item)
            if len(items) > MAX_ITEMS:
                raise Unsupported(f"iterator yields more than {MAX_ITEMS} items")
        return {"iter": sub(items)}
    if isinstance(value, Opaque):
        raise Unsupported(f"{value!r} came from the program and cannot be sent back to it")
    try:  # anything else arrives as an opaque stand-in: its type, repr and truth value only
        return {"opaque": [type(value).__name__, short_repr(value), bool(value)]}
    except Exception as e:  # noqa: BLE001 - the object's own __repr__ or __bool__ raised
        raise Unsupported(f"a value of type {type(value).__name__} ({type(e).__name__} "
                          "while describing it)") from None


class Opaque:
    """An object that is not plain data: it keeps its type name, repr and truth value, and
    equals only itself."""

    def __init__(self, type_name: str, text: str, truth: bool) -> None:
        self.type_name, self.text, self.truth = type_name, text, truth

    def __repr__(self) -> str:
        return self.text

    def __bool__(self) -> bool:
        return self.truth


def decode(data, depth: int = 0):
    if depth > MAX_DEPTH + 2:
        raise ValueError("value nested too deeply")
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode(v, depth + 1) for v in data]
    if not isinstance(data, dict) or len(data) != 1:
        raise ValueError("malformed value")
    (tag, v), = data.items()
    if tag == "int" and isinstance(v, str) and len(v) <= 4100:
        return int(v)
    if tag == "float" and v in ("nan", "inf", "-inf"):
        return float(v)
    if tag in ("bytes", "bytearray") and isinstance(v, str):
        return (bytes if tag == "bytes" else bytearray).fromhex(v)
    if tag == "complex" and isinstance(v, list) and len(v) == 2:
        return complex(decode(v[0], depth + 1), decode(v[1], depth + 1))
    if tag == "opaque" and isinstance(v, list) and len(v) == 3:
        return Opaque(str(v[0])[:100], str(v[1])[:REPR_CHARS + 3], bool(v[2]))
    if tag == "range" and isinstance(v, list) and len(v) == 3 and all(type(x) is int for x in v):
        return range(*v)
    if isinstance(v, list):
        if tag == "dict":
            return {decode(k, depth + 1): decode(x, depth + 1) for k, x in v}
        items = [decode(x, depth + 1) for x in v]
        kinds = {"tuple": tuple, "set": set, "frozenset": frozenset, "iter": iter}
        if tag in kinds:
            return kinds[tag](items)
    raise ValueError(f"malformed value tagged {tag!r}")


def short_repr(value) -> str:
    try:
        text = repr(value)
    except Exception as e:  # noqa: BLE001 - repr of a test value must not fail the judge
        text = f"<unrepresentable {type(value).__name__}: {type(e).__name__}>"
    return text if len(text) <= REPR_CHARS else text[:REPR_CHARS] + "..."


# ---- framed messages over pipes ----

def write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def send(fd: int, message) -> None:
    data = json.dumps(message).encode()
    if len(data) > MAX_FRAME:
        raise Unsupported(f"message of {len(data)} bytes exceeds {MAX_FRAME}")
    write_all(fd, struct.pack(">I", len(data)) + data)


def recv_exact(fd: int, n: int) -> bytes:
    chunks = b""
    while len(chunks) < n:
        chunk = os.read(fd, n - len(chunks))
        if not chunk:
            raise EOFError
        chunks += chunk
    return chunks


# ---- the worker: runs the untrusted program, never sees the tests ----

def program_error(exc: BaseException) -> dict:
    tb = traceback.extract_tb(exc.__traceback__)
    frames = [f for f in tb if f.filename == PROGRAM_FILE]
    line = frames[-1].lineno if frames else getattr(exc, "lineno", None)
    if isinstance(exc, SyntaxError) and exc.filename == PROGRAM_FILE:
        line = exc.lineno
    text = "".join(traceback.format_list(frames)) + "".join(
        traceback.format_exception_only(type(exc), exc))
    return {"type": type(exc).__name__, "message": str(exc)[:2000], "line": line,
            "traceback": text[-TRACE_CHARS:]}


def trace_call(fn, args, kwargs) -> str:
    """A bounded line-by-line trace of one call, the program's own frames only."""
    events: list[str] = []

    def tracer(frame, event, arg):
        if frame.f_code.co_filename != PROGRAM_FILE:
            return None
        if len(events) >= TRACE_EVENTS:
            sys.settrace(None)
            events.append("... (trace truncated)")
            return None
        where = f"{frame.f_code.co_name}:{frame.f_lineno}"
        if event == "call":
            shown = ", ".join(f"{k}={short_repr(v)[:60]}" for k, v in frame.f_locals.items())
            events.append(f"call {frame.f_code.co_name}({shown})")
        elif event == "line":
            shown = ", ".join(f"{k}={short_repr(v)[:40]}" for k, v in frame.f_locals.items())
            events.append(f"line {where}  {shown}")
        elif event == "return":
            events.append(f"return {where} -> {short_repr(arg)[:80]}")
        elif event == "exception":
            events.append(f"exception {where}: {arg[0].__name__}: {str(arg[1])[:80]}")
        return tracer

    sys.settrace(tracer)
    try:
        fn(*args, **kwargs)
    except BaseException:  # noqa: BLE001 - the exception is already in the trace
        pass
    finally:
        sys.settrace(None)
    text = "\n".join(events)
    return text if len(text) <= TRACE_CHARS else text[:TRACE_CHARS] + "\n... (trace truncated)"


def worker(program: str, req_fd: int, resp_fd: int) -> None:
    """Run the program, then answer calls until the judge closes the pipe."""
    scope = {"__name__": "__program__", "__builtins__": __builtins__}
    try:
        code = compile(program, PROGRAM_FILE, "exec")
        exec(code, scope)  # noqa: S102 - the untrusted program, contained by the sandbox
    except BaseException as e:  # noqa: BLE001 - reported to the judge
        send(resp_fd, {"ready": False, "error": program_error(e)})
        return
    names = sorted(k for k, v in scope.items() if callable(v) and not k.startswith("__"))
    modules = {k: v.__name__ for k, v in scope.items() if type(v) is type(sys)}
    send(resp_fd, {"ready": True, "names": names, "modules": modules})
    while True:
        try:
            (size,) = struct.unpack(">I", recv_exact(req_fd, 4))
            request = json.loads(recv_exact(req_fd, size))
        except EOFError:
            return
        fn = scope.get(request["name"])
        args = decode(request["args"])
        kwargs = {k: decode(v) for k, v in request["kwargs"].items()}
        if request.get("trace"):
            send(resp_fd, {"trace": trace_call(fn, args, kwargs)})
            continue
        try:
            result = fn(*args, **kwargs)
            reply = {"value": encode(result)}
        except Unsupported as e:
            reply = {"unsupported": str(e)}
        except BaseException as e:  # noqa: BLE001 - reported to the judge
            reply = {"error": program_error(e)}
        send(resp_fd, reply)


def start_worker(program: str, limits: dict, scratch: str, uid: int | None):
    """Fork the worker with its limits and identity; returns (pid, go_w, req_w, resp_r, out_r,
    err_r). The worker waits for a byte on `go_w` before anything else: the judge first moves
    it into the run's cgroup, so not one instruction of the program runs outside it."""
    go_r, go_w = os.pipe()
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid:
        for fd in (go_r, req_r, resp_w, out_w, err_w):
            os.close(fd)
        return pid, go_w, req_w, resp_r, out_r, err_r
    if os.read(go_r, 1) != b"g":  # the judge could not place us: never run the program
        os._exit(70)
    try:  # the child: from here on nothing is trusted
        os.setpgid(0, 0)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        # The worker keeps only its two pipe ends, moved to 3 and 4; everything else (the
        # verdict channel, the request, the other ends) is closed before the program runs.
        os.dup2(req_r, 3)
        os.dup2(resp_w, 4)
        os.closerange(5, 1 << 20)
        os.chdir(scratch)
        set_limits(limits)
        drop_capabilities(bounding=True)  # while we may still (needs CAP_SETPCAP)
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        drop_capabilities(bounding=False)
        os.environ.clear()
        os.environ.update({"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch,
                           "LANG": "C.UTF-8"})
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        sys.stdin = open(0, "r", closefd=False)
        sys.setrecursionlimit(1000)
        worker(program, 3, 4)
        code = 0
    except BaseException:  # noqa: BLE001 - the worker's own failure; the judge sees EOF
        code = 70
    os._exit(code)


def drop_capabilities(bounding: bool) -> None:
    """No capabilities, now or after any exec: first the bounding set, then the rest (matters
    where the worker keeps uid 0 of a user namespace: it could remount the filesystem)."""
    c = libc()
    if bounding:
        for cap in range(64):
            c.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
        return

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    if c.capset(ctypes.byref(Header(CAP_VERSION_3, 0)), (Data * 2)()) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")
    c.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def set_limits(limits: dict) -> None:
    for name, value in limits.items():
        which = getattr(resource, "RLIMIT_" + name.upper())
        soft = int(value)
        hard = soft + 1 if name == "cpu" else soft  # SIGXCPU at the soft limit, SIGKILL after
        resource.setrlimit(which, (soft, hard))


# ---- the judge: runs the tests against proxies ----

class WorkerGone(Exception):
    """The worker died, hung or broke the protocol; `status` says how."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


def broken_protocol(what: str) -> WorkerGone:
    """The worker's process sent something the judge cannot use: the program wrote into the
    sandbox's channel (it shares the worker's process, so it can). Its verdict, not ours."""
    return WorkerGone("error", f"the program broke the sandbox's protocol: {what}")


def error_info(info) -> dict:
    """The worker's report of an exception, as strings and a line number."""
    if not isinstance(info, dict) or not isinstance(info.get("type"), str):
        raise broken_protocol("an exception report without a type")
    line = info.get("line")
    return {"type": info["type"][:200], "message": as_text(info.get("message"))[:2000],
            "line": line if type(line) is int else None,
            "traceback": as_text(info.get("traceback"))[-TRACE_CHARS:]}


def as_text(value) -> str:
    """A string the worker sent, or a short repr of whatever came instead."""
    return value if isinstance(value, str) else "" if value is None else short_repr(value)


class ProgramError(Exception):
    """The program raised inside a call made by a test."""

    def __init__(self, info: dict) -> None:
        super().__init__(f"{info['type']}: {info['message']}")
        self.info = info


class Judge:
    def __init__(self, pid: int, req_w: int, resp_r: int, out_r: int, err_r: int,
                 deadline: float, max_output: int, cpu_limit: float) -> None:
        self.pid, self.req_w, self.resp_r = pid, req_w, resp_r
        self.deadline, self.max_output, self.cpu_limit = deadline, max_output, cpu_limit
        self.output = {out_r: bytearray(), err_r: bytearray()}
        self.output_total = {out_r: 0, err_r: 0}
        self.out_r, self.err_r = out_r, err_r
        self.sel = selectors.DefaultSelector()
        for fd in (resp_r, out_r, err_r):
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ)
        self.buffer = bytearray()
        self.last_call: tuple | None = None
        self.calls = 0

    def receive(self) -> dict:
        """The worker's next message, draining its output meanwhile."""
        while True:
            if len(self.buffer) >= 4:
                (size,) = struct.unpack(">I", self.buffer[:4])
                if size > MAX_FRAME:
                    raise broken_protocol(f"a {size}-byte message")
                if len(self.buffer) >= 4 + size:
                    frame = bytes(self.buffer[4:4 + size])
                    del self.buffer[:4 + size]
                    try:
                        message = json.loads(frame)
                    except (ValueError, RecursionError):
                        raise broken_protocol("a message that is not JSON") from None
                    if not isinstance(message, dict):
                        raise broken_protocol("a message that is not a JSON object")
                    return message
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise WorkerGone("timeout", "wall-clock timeout")
            for key, _ in self.sel.select(timeout=min(left, 1.0)):
                try:
                    data = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                if key.fd == self.resp_r:
                    if not data:
                        raise self.worker_died()
                    self.buffer += data
                    continue
                if not data:
                    self.sel.unregister(key.fd)
                    continue
                self.output_total[key.fd] += len(data)
                keep = self.output[key.fd]
                keep += data[:max(0, self.max_output - len(keep))]
                if sum(self.output_total.values()) > 64 * self.max_output:
                    raise WorkerGone("killed", f"output limit: the program wrote more than "
                                               f"{64 * self.max_output} bytes")

    def worker_died(self) -> WorkerGone:
        """The channel from the worker closed: say why, from how the worker ended."""
        for _ in range(50):
            pid, status, usage = os.wait4(self.pid, os.WNOHANG)
            if pid:
                break
            time.sleep(0.01)
        else:
            os.kill(self.pid, signal.SIGKILL)
            os.wait4(self.pid, 0)
            return WorkerGone("error", "the program closed its channel to the sandbox")
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            cpu = usage.ru_utime + usage.ru_stime
            if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= self.cpu_limit):
                return WorkerGone("timeout", f"CPU time limit ({self.cpu_limit} s)")
            name = signal.Signals(sig).name
            return WorkerGone("killed" if sig == signal.SIGKILL else "error",
                              f"the program died of {name}")
        code = os.WEXITSTATUS(status)
        return WorkerGone("error", f"the program exited (status {code}) before its tests finished")

    def call(self, name: str, args: tuple, kwargs: dict, trace: bool = False):
        try:
            request = {"name": name, "args": encode(list(args)),
                       "kwargs": {str(k): encode(v) for k, v in kwargs.items()}}
        except Unsupported as e:
            raise Unsupported(f"the test passes an argument the sandbox cannot send: {e}") from None
        if trace:
            request["trace"] = True
        else:
            self.last_call = (name, args, kwargs)
            self.calls += 1
        try:
            send(self.req_w, request)
        except (BrokenPipeError, OSError):
            raise self.worker_died() from None
        reply = self.receive()
        if trace:
            return as_text(reply.get("trace"))[:TRACE_CHARS + 100]
        if "unsupported" in reply:
            raise Unsupported(f"{name} returned {as_text(reply['unsupported'])[:300]}")
        if "error" in reply:
            raise ProgramError(error_info(reply["error"]))
        if "value" not in reply:
            raise broken_protocol("a reply with neither a value nor an error")
        try:
            return decode(reply["value"])
        except Exception:  # noqa: BLE001 - whatever the bytes make decoding raise
            raise broken_protocol("a malformed value") from None

    def proxy(self, name: str):
        def call(*args, **kwargs):
            return self.call(name, args, kwargs)
        call.__name__ = call.__qualname__ = name
        return call

    def captured(self, fd: int) -> dict:
        data = bytes(self.output[fd])
        return {"text": data.decode("utf-8", "replace"), "bytes": self.output_total[fd],
                "truncated": self.output_total[fd] > len(data)}


class AssertEq(ast.NodeTransformer):
    """`assert A == B` -> `__assert_eq__(A, B, line)`, so a failure reports actual and expected."""

    def visit_Assert(self, node: ast.Assert):
        t = node.test
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq):
            call = ast.Call(func=ast.Name("__assert_eq__", ast.Load()),
                            args=[t.left, t.comparators[0], ast.Constant(node.lineno)],
                            keywords=[])
            return ast.copy_location(ast.Expr(call), node)
        return node


class EqFailure(AssertionError):
    def __init__(self, actual, expected, line: int) -> None:
        super().__init__(f"expected {short_repr(expected)}, got {short_repr(actual)}")
        self.actual, self.expected, self.line = actual, expected, line


def assert_eq(actual, expected, line: int) -> None:
    if not actual == expected:
        raise EqFailure(actual, expected, line)


def compile_test(source: str, filename: str):
    tree = AssertEq().visit(ast.parse(source, filename))
    return compile(ast.fix_missing_locations(tree), filename, "exec")


def test_line(exc: BaseException, filename: str) -> int | None:
    lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == filename]
    return lines[-1] if lines else None


def run_case(judge: Judge, scope: dict, index: int, source: str) -> dict:
    result = {"index": index, "source": source[:2000], "status": "passed"}
    filename = f"<test {index}>"
    judge.last_call = None
    try:
        exec(compile_test(source, filename), scope)  # noqa: S102 - trusted test code
    except WorkerGone:
        raise
    except ProgramError as e:
        result.update(status="error", **{k: e.info[k] for k in ("type", "message", "line")},
                      traceback=e.info["traceback"])
        if e.info["type"] == "MemoryError":
            result["status"] = "memory"
    except EqFailure as e:
        result.update(status="failed", message=str(e), expected=short_repr(e.expected),
                      actual=short_repr(e.actual), line=e.line)
    except AssertionError as e:
        result.update(status="failed", message=str(e) or "assertion failed",
                      line=test_line(e, filename))
    except Unsupported as e:
        result.update(status="failed", type="TypeError", message=str(e))
    except Exception as e:  # noqa: BLE001 - the test failed on what the program returned
        result.update(status="failed", type=type(e).__name__, message=str(e)[:2000],
                      line=test_line(e, filename))
    if result["status"] != "passed" and judge.last_call:
        name, args, kwargs = judge.last_call
        shown = ", ".join([short_repr(a) for a in args] +
                          [f"{k}={short_repr(v)}" for k, v in kwargs.items()])
        result["call"] = f"{name}({shown})"
        result["_call"] = judge.last_call
    return result


def add_trace(judge: Judge, case: dict) -> None:
    """Re-run a failing case's last call under a line tracer, for `trace` feedback."""
    name, args, kwargs = case["_call"]
    try:
        case["trace"] = judge.call(name, args, kwargs, trace=True)
    except (WorkerGone, Unsupported) as e:
        case["trace"] = f"(no trace: {e})"


# ---- the tests' namespace ----

BUILTIN_NAMES = frozenset(vars(builtins))


def global_reads(source: str) -> tuple[set[str], set[str]]:
    """(names `source` reads as globals, in any of its scopes; names it binds at top level).
    Source that does not parse gives neither: compiling it reports the error later."""
    try:
        top = symtable.symtable(source, "<tests>", "exec")
    except (SyntaxError, ValueError):
        return set(), set()
    reads, tables = set(), [top]
    while tables:
        table = tables.pop()
        tables += table.get_children()
        reads |= {s.get_name() for s in table.get_symbols()
                  if s.is_referenced() and (table is top or s.is_global())}
    binds = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    return reads, binds


def tests_namespace(judge: Judge, ready: dict, sources: list[str]) -> dict:
    """The tests' globals: a proxy for each of the program's functions the test code uses
    (`sources`: the setup and the tests), and the standard-library modules the program imported
    that the test code uses under their own name. Builtins stay the real ones (module docstring).

        program `def abs(x): return 0` + `def mad(xs): ...`, test `abs(mad(xs) - 0.5) < 1e-6`
        -> the test calls the proxy `mad` and the real `abs`
    """
    names, modules = ready.get("names", []), ready.get("modules", {})
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise broken_protocol("'names' is not a list of names")
    if not (isinstance(modules, dict) and all(isinstance(m, str) for m in modules.values())):
        raise broken_protocol("'modules' is not a table of module names")
    reads, binds = set(), set()
    for source in sources:
        r, b = global_reads(source)
        reads, binds = reads | r, binds | b
    wanted = {n for n in reads - binds if not n.startswith("__")}
    functions = wanted & set(names)
    exposed = functions - BUILTIN_NAMES
    if not exposed and len(functions) == 1:  # the function under test is named like a builtin
        exposed = functions
    scope: dict = {"__name__": "__tests__", "__assert_eq__": assert_eq}
    for name in sorted(wanted - BUILTIN_NAMES - exposed):
        # The judge imports its own copy, and only under the module's own name: the program's
        # `import cmath as math` does not give the tests a `math`.
        if modules.get(name) == name and name in sys.stdlib_module_names:
            try:
                scope[name] = __import__(name)
            except Exception:  # noqa: BLE001 - not in this interpreter: the test sees no name
                pass
    for name in sorted(exposed):
        scope[name] = judge.proxy(name)
    return scope


def judge_program(request: dict, pid: int, pipes: tuple, started: float) -> dict:
    deadline = started + float(request["timeout"])
    judge = Judge(pid, *pipes, deadline=deadline, max_output=int(request["max_output"]),
                  cpu_limit=request["limits"].get("cpu", math.inf))
    tests = request["tests"]
    verdict: dict = {"tests": [], "program_error": None}
    try:
        ready = judge.receive()
        if ready.get("ready") is False:
            verdict["program_error"] = error_info(ready.get("error"))
            status = "memory" if verdict["program_error"]["type"] == "MemoryError" else "error"
            verdict.update(status=status, reason="the program raised before the tests ran")
        elif ready.get("ready") is not True:
            raise broken_protocol("its first message is not the ready message")
        else:
            scope = tests_namespace(judge, ready, [request.get("setup", ""), *tests])
            setup_error = None
            try:
                exec(compile_test(request.get("setup", ""), "<setup>"), scope)  # noqa: S102
            except WorkerGone:
                raise
            except Exception as e:  # noqa: BLE001 - trusted setup failing is the caller's error
                setup_error = f"{type(e).__name__}: {e}"
            if setup_error:
                verdict.update(status="error", reason=f"the test setup failed: {setup_error}")
            else:
                for i, source in enumerate(tests):
                    verdict["tests"].append(run_case(judge, scope, i, source))
                first = next((t for t in verdict["tests"] if t["status"] != "passed"), None)
                if first and "_call" in first and request.get("trace"):
                    add_trace(judge, first)
                verdict["status"] = first["status"] if first else "passed"
                verdict["reason"] = (f"test {first['index']} {first['status']}" if first
                                     else f"all {len(tests)} tests passed")
    except WorkerGone as e:
        verdict.update(status=e.status, reason=e.reason)
        done = len(verdict["tests"])
        if done < len(tests):
            verdict["tests"].append({"index": done, "source": tests[done][:2000],
                                     "status": e.status, "message": e.reason})
    verdict["stdout"] = judge.captured(judge.out_r)
    verdict["stderr"] = judge.captured(judge.err_r)
    verdict["calls"] = judge.calls
    for case in verdict["tests"]:
        case.pop("_call", None)
    verdict["tests_total"] = len(tests)
    verdict["tests_passed"] = sum(t["status"] == "passed" for t in verdict["tests"])
    return verdict


# ---- isolation inside the namespaces ----

def libc():
    return ctypes.CDLL(None, use_errno=True)


def mount(source: str | None, target: str, fstype: str | None, flags: int,
          data: str | None = None) -> None:
    c = libc()
    c.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    enc = lambda s: None if s is None else s.encode()
    if c.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source or fstype or ''} on {target}: {os.strerror(err)}")


def kept_flags(path: str) -> int:
    """The flags of the mount holding `path` that a bind of it must keep: in a user namespace
    the kernel refuses a remount that would drop them (they are locked)."""
    f = os.statvfs(path).f_flag
    flags = sum(ms for st, ms in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV),
                                  (os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME, MS_NOATIME),
                                  (os.ST_NODIRATIME, MS_NODIRATIME)) if f & st)
    return flags | (MS_RELATIME if f & os.ST_RELATIME else 0 if f & os.ST_NOATIME
                    else MS_STRICTATIME)


def bind_read_only(source: str, target: str, extra: int = MS_NOSUID | MS_NODEV) -> None:
    mount(source, target, None, MS_BIND)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | extra | kept_flags(source))


def pivot_root() -> None:
    """pivot_root(".", "."): the current directory becomes `/` and the old root is stacked on
    top of it, to be detached (man 2 pivot_root). glibc has no wrapper."""
    number = {"x86_64": 155, "aarch64": 41, "riscv64": 41}.get(os.uname().machine)
    if number is None:
        raise OSError(0, f"pivot_root: no syscall number for {os.uname().machine}")
    c = libc()
    if c.syscall(number, b".", b".") != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pivot_root: {os.strerror(err)}")
    c.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    if c.umount2(b".", MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"detaching the old root: {os.strerror(err)}")
    os.chdir("/")


def private_root(entries: list, scratch_bytes: int, uid: int | None) -> None:
    """Make a new root of the interpreter's files (`entries`, see sandbox/rootfs.py), devices,
    /proc and a size-capped tmpfs scratch at /tmp, and switch this mount namespace to it; the
    machine's own tree is then gone from the namespace, not merely read-only.

    Built on a tmpfs mounted over the current directory (the supervisor's empty work
    directory), which is ours alone once every mount is private to this namespace."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    new = os.getcwd()
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=755")
    at = lambda path: new + path

    def parent(path: str) -> None:
        os.makedirs(os.path.dirname(at(path)), mode=0o755, exist_ok=True)

    # The scratch first: an entry under it (an interpreter in a checkout under /tmp) is then
    # bound inside the scratch instead of being hidden by it.
    os.makedirs(at(SCRATCH), mode=0o755)
    owner = "" if uid is None else f",uid={uid},gid={uid}"
    mount("tmpfs", at(SCRATCH), "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={scratch_bytes},mode={'700' if uid is not None else '1777'}{owner}")
    for kind, path, *rest in entries:
        if kind == "link":
            parent(path)
            os.symlink(rest[0], at(path))
        elif kind == "dir":
            os.makedirs(at(path), mode=0o755, exist_ok=True)
            bind_read_only(path, at(path))
        elif kind == "file":
            parent(path)
            os.close(os.open(at(path), os.O_CREAT | os.O_WRONLY, 0o644))
            bind_read_only(path, at(path))
        elif kind == "mask":  # e.g. site-packages inside a bound standard library
            mount("tmpfs", at(path), "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                  "size=4k,mode=755")
        else:
            raise ValueError(f"unknown root entry {kind!r}")
    os.makedirs(at("/dev"), mode=0o755)
    for name in DEVICES:
        os.close(os.open(at(f"/dev/{name}"), os.O_CREAT | os.O_WRONLY, 0o666))
        bind_read_only(f"/dev/{name}", at(f"/dev/{name}"), extra=MS_NOSUID)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2"),
                         ("shm", "/tmp")):  # POSIX shared memory and semaphores: the scratch
        os.symlink(target, at(f"/dev/{name}"))
    os.makedirs(at("/proc"), mode=0o555)
    mount("proc", at("/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(new)
    pivot_root()
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def reap_all(worker_pid: int) -> None:
    """Kill the worker and everything it started, including processes that left its session."""
    for target in (-worker_pid, worker_pid):
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if os.getpid() == 1:  # init of our own pid namespace: everything else here is the program's
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for _ in range(200):
        children = descendants()
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            if not children:
                return
        if not children and not descendants():
            return
        time.sleep(0.01)


def descendants() -> list[int]:
    """Our children (as subreaper, orphans of the program's tree come back to us)."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                found.append(int(entry))
    return found


def read_message(fd: int) -> dict:
    """One framed message, read unbuffered so nothing beyond it sits in our memory."""
    (size,) = struct.unpack(">I", recv_exact(fd, 4))
    return json.loads(recv_exact(fd, size))


def fail(message: str) -> None:
    """The judge's own failure, as one line (the supervisor reports it as a SandboxError)."""
    print(f"sandbox judge: {message}", file=sys.stderr)
    sys.exit(3)


def main() -> None:
    started = time.monotonic()
    # The verdict channel: a private duplicate of stdout (not inherited by the worker, which
    # keeps only fds 0-4 of its own). fd 1 then points at stderr, so whatever else in this
    # process writes to stdout (a module's import-time print, a test's print) stays out of it.
    verdict_fd = os.dup(1)
    os.dup2(2, 1)
    request = read_message(0)  # limits and the program; the tests are read after the fork
    program = request["program"]
    uid = request.get("uid")
    c = libc()
    c.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    c.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:  # opened while /sys/fs/cgroup is still in view; the private root has no /sys
        cgroups = [os.open(path, os.O_WRONLY) for path in request.get("cgroup_procs", [])]
    except OSError as e:
        fail(f"cannot open {e.filename}: {e.strerror}")
    private = request.get("root") is not None
    try:
        if private:
            private_root(request["root"], int(request["scratch_bytes"]), uid)
            scratch = SCRATCH
        else:
            scratch = tempfile.mkdtemp(prefix="egmla-sandbox-", dir=request.get("workdir"))
            if uid is not None:
                os.chown(scratch, uid, uid)
    except OSError as e:
        fail(f"cannot build the program's private root: {e.strerror or e}")
    with open(os.path.join(scratch, PROGRAM_FILE), "w") as f:
        f.write(program)
    pid, go, *pipes = start_worker(program, request["limits"], scratch, uid)
    try:
        for fd in cgroups:
            os.write(fd, str(pid).encode())
            os.close(fd)
        os.write(go, b"g")
    except OSError as e:
        reap_all(pid)
        fail(f"cannot move the worker into the run's cgroup: {e.strerror}")
    os.close(go)
    request.update(read_message(0))
    try:
        verdict = judge_program(request, pid, tuple(pipes), started)
    finally:
        reap_all(pid)
        for fd in pipes:
            os.close(fd)
        if not private:  # the private root's scratch is a tmpfs that dies with the namespace
            shutil.rmtree(scratch, ignore_errors=True)
    verdict["judge_wall_s"] = round(time.monotonic() - started, 4)
    sys.stdout.flush()
    write_all(verdict_fd, json.dumps(verdict).encode())


if __name__ == "__main__":
    main()
