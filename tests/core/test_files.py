"""egmla.files: every record, cache entry and report is written whole or not at all; and
egmla.units: the sizes a command line takes."""

from __future__ import annotations

import argparse
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from egmla import files
from egmla.units import parse_bytes


def leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "record.json"
    path.write_text("old")
    files.write_json(path, {"a": 1})
    assert path.read_text() == '{\n "a": 1\n}\n' and leftovers(tmp_path) == []
    files.write_text(path, "new", fsync=True)
    assert path.read_text() == "new"


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path, monkeypatch):
    path = tmp_path / "record.json"
    path.write_text("old")

    def crash(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        files.write_bytes(path, b"new")
    monkeypatch.undo()
    assert path.read_text() == "old" and leftovers(tmp_path) == []
    with pytest.raises(RuntimeError):  # a writer that fails midway: the same
        with files.atomic_path(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert path.read_text() == "old" and leftovers(tmp_path) == []


def test_the_mode_is_the_umasks_unless_asked(tmp_path):
    old = os.umask(0o022)
    try:
        files.write_bytes(tmp_path / "a", b"x")
        files.write_bytes(tmp_path / "b", b"x", mode=0o600)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o644  # as open() gives
    assert stat.S_IMODE((tmp_path / "b").stat().st_mode) == 0o600


def test_parents_are_made_only_when_asked(tmp_path):
    with pytest.raises(FileNotFoundError):
        files.write_text(tmp_path / "x" / "y.txt", "a")
    files.write_text(tmp_path / "x" / "y.txt", "a", parents=True)
    assert (tmp_path / "x" / "y.txt").read_text() == "a"


def test_a_directory_lands_whole_and_a_lost_race_keeps_the_winners(tmp_path):
    target = tmp_path / "tok"
    with files.atomic_directory(target) as tmp:
        tmp.mkdir()
        (tmp / "tokenizer.json").write_text("mine")
    assert (target / "tokenizer.json").read_text() == "mine"
    with files.atomic_directory(target, keep_existing=True) as tmp:  # another writer won
        tmp.mkdir()
        (tmp / "tokenizer.json").write_text("late")
    assert (target / "tokenizer.json").read_text() == "mine" and leftovers(tmp_path) == []
    with pytest.raises(OSError):
        with files.atomic_directory(target) as tmp:
            tmp.mkdir()
            (tmp / "tokenizer.json").write_text("late")
    assert leftovers(tmp_path) == []


def test_a_directory_replaces_the_old_one_whole_or_leaves_it_as_it_was(tmp_path):
    target = tmp_path / "export"
    hidden = lambda d: [p.name for p in d.iterdir() if p.name.startswith(".")]  # tmp and old
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with files.atomic_directory(target, replace_existing=True) as tmp:
            tmp.mkdir()
            (tmp / "new.txt").write_text("half")
            raise RuntimeError("the writer failed")
    assert sorted(p.name for p in target.iterdir()) == ["old.txt"] and hidden(tmp_path) == []
    with files.atomic_directory(target, replace_existing=True) as tmp:
        tmp.mkdir()
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"] and hidden(tmp_path) == []


def test_several_files_arrive_together_or_not_at_all(tmp_path):
    out = tmp_path / "comparison"
    files.write_files(out, {"a.md": b"a", "a.png": b"png"})
    assert sorted(p.name for p in out.iterdir()) == ["a.md", "a.png"]

    class Broken(dict):
        def items(self):
            yield "b.md", b"b"
            raise RuntimeError("the plot failed")

    with pytest.raises(RuntimeError):
        files.write_files(out, Broken({"b.md": b"b"}))
    assert sorted(p.name for p in out.iterdir()) == ["a.md", "a.png"]  # nothing new
    assert sorted(p.name for p in tmp_path.iterdir()) == ["comparison"]


@pytest.mark.parametrize("text, value", [("512MiB", 512 * 2**20), ("1.5G", 3 * 2**29),
                                         ("2GB", 2 * 10**9), ("100000", 100_000), (" 8 kib ", 8192)])
def test_sizes_read_as_people_write_them(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "12 parsecs", "0", "-1MiB"])
def test_a_bad_size_is_an_argparse_error(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes(text)


# ---- where a command will write, checked before its work --------------------------------------

def test_a_place_that_cannot_be_written_is_found_before_anything_is_made(tmp_path):
    (tmp_path / "file").write_text("in the way")
    for bad in (tmp_path / "file", tmp_path / "file" / "deeper" / "out"):
        with pytest.raises(NotADirectoryError):
            files.check_writable(bad)
        with pytest.raises(argparse.ArgumentTypeError, match="cannot be written"):
            files.output_directory(str(bad))
    with pytest.raises(argparse.ArgumentTypeError, match="cannot be written"):
        files.output_prefix(str(tmp_path / "file" / "report"))  # report.json, report.md
    assert files.output_directory(str(tmp_path / "new" / "out")) == tmp_path / "new" / "out"
    assert files.output_prefix(str(tmp_path / "file.d" / "report")) == tmp_path / "file.d" / "report"
    assert [p.name for p in tmp_path.iterdir()] == ["file"]  # checked, nothing made or left
    for empty in ("", "  "):  # Path("") is the working directory, never what was meant
        for kind in (files.output_directory, files.output_prefix):
            with pytest.raises(argparse.ArgumentTypeError, match="an empty path"):
                kind(empty)



@pytest.mark.parametrize("command", [
    ["benchmarks/quickstart.py", "--out", "{file}/quickstart.json"],  # else: a clone, a training
    ["-m", "studies.gating", "--results", "{file}/results", "--dry-run"],
    ["-m", "eval.compare", "benchmarks/results/study", "--out", "{file}/comparison"],
])
def test_a_command_told_to_write_under_a_file_stops_before_its_work(tmp_path, command):
    (tmp_path / "file").write_text("in the way")
    args = [a.format(file=tmp_path / "file") for a in command]
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 2, done.stderr[-2000:]
    assert "cannot be written" in done.stderr and "Traceback" not in done.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["file"]
