"""Files written whole or not at all (standard library only).

Every writer of a record, a cache entry or a report writes into a temporary sibling and renames
it into place: a reader, a crash or a concurrent writer sees the old file or the new one, never
a torn one. The temporary name is hidden and unique (`.NAME.tmp-1a2b3c4d5e6f`), so two
writers never share it, and it is removed when the write fails.

    write_text(path, "...")                      # a text file
    write_bytes(path, png, mode=0o644)           # bytes, with explicit permissions
    write_json(path, record)                     # JSON, indent 1, a final newline
    write_text(path, text, fsync=True)           # durable too: on disk before the rename
    with atomic_path(path, suffix=".npy") as tmp:   # a file another writer fills (a memmap,
        fill(tmp)                                   # a compiler's output)
    with atomic_directory(target, keep_existing=True) as tmp:   # a directory, filled in tmp
        build(tmp)
    with atomic_directory(export, replace_existing=True) as tmp:  # a new one for the old
        tmp.mkdir()
        fill(tmp)
    write_files(out, {"a.md": b"...", "a.png": png})  # several files, none until all are ready

And where a command will write, checked before its work (so a mistyped --out fails at once,
not after an hour of it): `check_writable(directory)`, and as argparse `type=`s
`output_directory` (results written into it) and `output_prefix` (a file, or a prefix that
.json and .md are added to).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


def temporary_sibling(path: Path, suffix: str = "") -> Path:
    """A hidden, unique name beside `path`: `.NAME.tmp-<12 hex><suffix>`."""
    return path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}{suffix}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, suffix: str = "", fsync: bool = False,
                mode: int | None = None, parents: bool = False) -> Iterator[Path]:
    """A temporary sibling of `path` for the caller to write; when the block ends without an
    error it is (fsynced, given `mode`, and) renamed onto `path`, else removed. The sibling
    does not exist yet: the caller creates it (open, a memmap, a compiler's -o)."""
    path = Path(path)
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path, suffix)
    try:
        yield tmp
        if fsync:
            fsync_path(tmp)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes(path: str | os.PathLike, data: bytes, *, fsync: bool = False,
                mode: int | None = None, parents: bool = False) -> None:
    """`data` at `path`, atomically. The file gets `mode`, or what open() would give it (0o666
    less the umask); `fsync`: flushed to disk before the rename; `parents`: create the
    directories above it."""
    with atomic_path(path, fsync=fsync, mode=mode, parents=parents) as tmp:
        with open(tmp, "xb") as f:
            f.write(data)


def write_text(path: str | os.PathLike, text: str, *, fsync: bool = False,
               mode: int | None = None, parents: bool = False) -> None:
    """`text` (UTF-8) at `path`, atomically; the options as `write_bytes`."""
    write_bytes(path, text.encode(), fsync=fsync, mode=mode, parents=parents)


def write_json(path: str | os.PathLike, data: Any, *, indent: int | None = 1,
               fsync: bool = False, mode: int | None = None, parents: bool = False) -> None:
    """`data` as JSON (`indent`, a final newline) at `path`, atomically."""
    write_text(path, json.dumps(data, indent=indent) + "\n", fsync=fsync, mode=mode,
               parents=parents)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, keep_existing: bool = False,
                     replace_existing: bool = False) -> Iterator[Path]:
    """A temporary directory beside `path` for the caller to fill (it does not exist yet);
    renamed onto `path` when the block ends without an error, removed in every case.
    `keep_existing`: when the rename fails because `path` exists already (another writer won
    the race), theirs stays and ours is dropped, without an error. `replace_existing`: an
    existing `path` is moved aside, ours renamed in, and the old one removed only then (put
    back if the rename fails): readers see the old directory or the new, never a mix."""
    path = Path(path)
    tmp = temporary_sibling(path)
    try:
        yield tmp
        if replace_existing and path.exists():
            _swap_in(tmp, path)
            return
        try:
            os.replace(tmp, path)
        except OSError:
            if not (keep_existing and path.is_dir()):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _swap_in(new: Path, path: Path) -> None:
    """Rename the finished `new` onto the existing directory `path`, the old one removed last."""
    old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
    os.replace(path, old / path.name)  # a same-filesystem rename, never a copy
    try:
        os.replace(new, path)
    except BaseException:
        os.replace(old / path.name, path)  # put the previous one back
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def write_files(directory: str | os.PathLike, files: Mapping[str, bytes]) -> None:
    """Several files into `directory` (created if absent): every file is written into a
    temporary folder beside it first, then each is renamed into place, so an interrupted
    write leaves no half-written file, and a failure before the renames leaves none new."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        for name, data in files.items():
            (staging / name).write_bytes(data)
        directory.mkdir(exist_ok=True)
        for name in files:
            os.replace(staging / name, directory / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a rename is durable once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_writable(directory: str | os.PathLike) -> None:
    """Raise OSError unless an entry can be made in `directory`, or, where it is missing, in
    its nearest existing ancestor (where it would be made). Tried, not guessed from permission
    bits: a directory is made there and removed, so nothing is left; a file in the way, a
    read-only mount or missing rights all fail it."""
    place = Path(os.path.abspath(directory))
    while not place.exists():
        place = place.parent
    os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=place))


def output_directory(text: str) -> Path:
    """argparse `type=` for a directory a command writes its results into: `check_writable`
    when the command line is read."""
    return _writable(text, Path(text))


def output_prefix(text: str) -> Path:
    """argparse `type=` for a file a command writes, or a path prefix (.json, .md added): its
    directory checked by `check_writable` when the command line is read."""
    return _writable(text, Path(text).parent)


def _writable(text: str, directory: Path) -> Path:
    if not text.strip():  # Path("") is the working directory: never what was meant
        raise argparse.ArgumentTypeError(f"{text!r}: an empty path")
    try:
        check_writable(directory)
    except OSError as err:
        raise argparse.ArgumentTypeError(
            f"{text!r}: cannot be written ({err.strerror or err})") from None
    return Path(text)
