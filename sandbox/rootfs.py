"""What the program's private root holds: the interpreter, its shared libraries and its standard
library, at the paths where the interpreter looks for them, and nothing else of the machine.

The interpreter itself says what it needs: `PROBE` imports every extension module of its
standard library and lists the files the dynamic loader opened (by the names it opened them
under, `dl_iterate_phdr`) and the files mapped into the process (locale data), with its
`sys.path`. `spec()` turns that into entries for the judge (`runner.private_root`):

    ("link", "/lib", "usr/lib")                      # a symlink on the way, copied as it is
    ("file", "/usr/lib/x86_64-linux-gnu/libc.so.6")   # bound read-only at the same path
    ("dir", "/usr/lib/python3.11")                   # the standard library, read-only
    ("mask", "/usr/lib/python3.11/site-packages")     # covered by an empty read-only tmpfs

Installed packages are not there: the sandbox runs `python -I -S`, and no HumanEval or MBPP
reference solution imports anything outside the standard library.
"""

from __future__ import annotations

import json
import os
import subprocess

PROBE = r"""
import ctypes, importlib, json, os, sys
for d in sys.path:
    if os.path.isdir(d):
        for name in sorted(os.listdir(d)):
            if name.endswith(".so"):
                try:
                    importlib.import_module(name.split(".")[0])
                except Exception:
                    pass  # not importable here, so not importable in the sandbox either
class Info(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_void_p), ("name", ctypes.c_char_p)]
opened = []
@ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Info), ctypes.c_size_t, ctypes.c_void_p)
def each(info, size, data):
    opened.append((info.contents.name or b"").decode())
    return 0
ctypes.CDLL(None).dl_iterate_phdr(each, None)
mapped = set()
with open("/proc/self/maps") as f:
    for line in f:
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            mapped.add(parts[5].rstrip("\n"))
print(json.dumps({"path": sys.path, "opened": [n for n in opened if n.startswith("/")],
                  "mapped": sorted(mapped), "stdlib": os.path.dirname(os.__file__)}))
"""
PACKAGE_DIRS = ("site-packages", "dist-packages")


class RootError(RuntimeError):
    """The interpreter's files could not be determined; the message says why."""


def interpreter_files(command: list[str], env: dict[str, str]) -> dict:
    """Run PROBE with `command` (the interpreter, under the sandbox's uid) and return its report."""
    try:
        done = subprocess.run(command + ["-I", "-S", "-c", PROBE], env=env, capture_output=True,
                              stdin=subprocess.DEVNULL, timeout=60, cwd="/")
        report = json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        raise RootError(f"cannot list the files the interpreter {command[-1]} needs: {e}") \
            from None
    return report


def _walk(path: str, links: dict[str, str], depth: int = 0) -> str:
    """`path` with every symlink on the way resolved; each link met goes into `links`."""
    if depth > 40:
        raise RootError(f"too many levels of symbolic links at {path}")
    resolved = "/"
    for part in [p for p in path.split("/") if p]:
        candidate = os.path.join(resolved, part)
        if os.path.islink(candidate):
            target = os.readlink(candidate)
            links[candidate] = target
            candidate = _walk(os.path.normpath(os.path.join(resolved, target)), links, depth + 1)
        resolved = candidate
    return resolved


def spec(python: str, report: dict) -> tuple[tuple[str, ...], ...]:
    """The private root's entries (module docstring) for `python` and its PROBE report."""
    links: dict[str, str] = {}
    dirs = {_walk(d, links) for d in report["path"] + [report["stdlib"]] if os.path.isdir(d)}
    files = set()
    for name in [python, *report["opened"], *report["mapped"]]:
        real = _walk(name, links)
        if os.path.isfile(real) and not any((real + "/").startswith(d + "/") for d in dirs):
            files.add(real)
    # Outermost directories only: one bind covers /usr/lib/python3.11 and its lib-dynload.
    dirs = {d for d in dirs if not any(d != o and d.startswith(o + "/") for o in dirs)}
    masks = [os.path.join(d, p) for d in sorted(dirs) for p in PACKAGE_DIRS
             if os.path.isdir(os.path.join(d, p))]
    entries = [("link", link, target) for link, target in sorted(links.items())]
    entries += [("dir", d) for d in sorted(dirs)] + [("file", f) for f in sorted(files)]
    return tuple(entries + [("mask", m) for m in masks])


__all__ = ["RootError", "interpreter_files", "spec"]
