"""Text sources: where training text comes from, as (train, val) texts plus a fingerprint.

    src = load_text_source("corpus")                                  # embedded, offline
    src = load_text_source("recovery")                # stdlib + READMEs (egmla.data.recovery)
    src = load_text_source("hf", path="json", data_files="data/*.jsonl", text_field="content")
    src = load_text_source("hf", path="HuggingFaceFW/fineweb-edu", name="sample-10BT",
                           streaming=True)                            # needs network
    for text in src.train: ...

The fingerprint names the data, not the tokenizer: packing combines the two into its cache key,
so changed files (size or mtime) or a changed split are tokenized again.

Validation is either a named split (`val_split`) or a deterministic held-out fraction of `split`
chosen by a hash of the example index, so it is the same on every machine and every rank.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from egmla.data.corpus import corpus_fingerprint, is_held_out, split_corpus
from egmla.data.recovery import recovery_texts

KINDS = ("corpus", "hf", "recovery")
_HF_OPTIONS = {
    "path": None,  # required: hub name, local directory, or a builder ("json", "text", ...)
    "name": None,
    "data_files": None,
    "split": "train",
    "val_split": None,
    "val_fraction": 0.05,
    "text_field": "text",
    "streaming": False,
    "revision": None,
}
_CORPUS_OPTIONS = {"val_fraction": 0.05}
_GLOB_CHARS = set("*?[")
_REMOTE_PREFIXES = ("hf://", "http://", "https://", "s3://", "gs://", "gcs://", "az://")


@dataclass
class TextSource:
    """Training and validation texts (each re-iterable) and a string naming the data."""

    train: Iterable[str]
    val: Iterable[str]
    fingerprint: str


class _Texts:
    """A re-iterable view: each `iter()` starts over (a generator could be consumed only once)."""

    def __init__(self, make: Callable[[], Iterator[str]], length: int | None = None) -> None:
        self._make = make
        self._length = length

    def __iter__(self) -> Iterator[str]:
        return self._make()

    def __len__(self) -> int:  # examples (not tokens), when known: progress bars use it
        if self._length is None:
            raise TypeError("the length of a streaming text source is unknown")
        return self._length


def load_text_source(kind: str, **options: Any) -> TextSource:
    """Texts of `kind` ("corpus", "hf" or "recovery"); an unknown kind or option raises naming
    it."""
    if kind == "corpus":
        opts = _options(kind, options, _CORPUS_OPTIONS)
        return _corpus_source(float(opts["val_fraction"]))
    if kind == "recovery":
        opts = _options(kind, options, _CORPUS_OPTIONS)
        train, val, fingerprint = recovery_texts(float(opts["val_fraction"]))
        return TextSource(train, val, _digest({"kind": "recovery", "mixture": fingerprint,
                                               "val_fraction": opts["val_fraction"]}))
    if kind == "hf":
        return _hf_source(**_options(kind, options, _HF_OPTIONS))
    raise ValueError(f"unknown text source kind {kind!r}; choose one of {', '.join(KINDS)}")


def _options(kind: str, given: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for text source {kind!r}; "
            f"allowed: {', '.join(defaults)}"
        )
    return {**defaults, **given}


def _digest(description: dict[str, Any]) -> str:
    text = json.dumps(description, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _check_fraction(val_fraction: float) -> None:
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction!r}: must be in [0, 1)")


# --------------------------------------------------------------------------------------------
# The embedded corpus


def _corpus_source(val_fraction: float) -> TextSource:
    _check_fraction(val_fraction)
    train, val = split_corpus(val_fraction)
    fingerprint = _digest(
        {"kind": "corpus", "corpus": corpus_fingerprint(), "val_fraction": val_fraction}
    )
    return TextSource(train, val, fingerprint)


# --------------------------------------------------------------------------------------------
# Anything datasets.load_dataset reads


def _hf_source(
    path: str | None,
    name: str | None,
    data_files: str | list[str] | dict[str, str | list[str]] | None,
    split: str,
    val_split: str | None,
    val_fraction: float,
    text_field: str,
    streaming: bool,
    revision: str | None,
) -> TextSource:
    if not path:
        raise ValueError("text source 'hf' needs path= (a hub name, a directory, or a builder "
                         "such as 'json', 'text', 'parquet')")
    _check_fraction(val_fraction)
    try:
        import datasets
    except ImportError as err:
        raise ImportError("text source 'hf' needs datasets: pip install 'egmla[train]'") from err

    builder = path in _packaged_builders()
    local_path = not builder and Path(path).exists()
    if data_files is not None and builder:
        data_files = _resolve_data_files(data_files)  # relative to the cwd, checked to exist

    def load(which: str) -> Any:
        try:
            return datasets.load_dataset(
                path, name=name, data_files=data_files, split=which, streaming=streaming,
                revision=revision,
            )
        except ValueError as err:  # e.g. 'Unknown split "validation". Should be one of [...]'
            raise ValueError(f"text source 'hf' path={path!r} split={which!r}: {err}") from err

    data = load(split)
    _check_text_field(data, text_field, path, split)
    if val_split is not None:
        val_data = load(val_split)
        _check_text_field(val_data, text_field, path, val_split)
        train = _texts(data, text_field)
        val = _texts(val_data, text_field)
    else:
        train = _held_out_texts(data, text_field, val_fraction, want_val=False)
        val = _held_out_texts(data, text_field, val_fraction, want_val=True)

    description: dict[str, Any] = {
        "kind": "hf", "path": path, "name": name, "split": split, "val_split": val_split,
        "val_fraction": None if val_split is not None else val_fraction,
        "text_field": text_field, "revision": revision,
    }
    if builder and data_files is not None:
        description["files"] = _file_stats(data_files)
    elif local_path:
        description["files"] = _file_stats(str(Path(path).resolve()))
    else:  # hub data: files are identified by the repository, its revision and the patterns
        description["data_files"] = data_files
    return TextSource(train, val, _digest(description))


def _packaged_builders() -> set[str]:
    try:
        from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES
        return set(_PACKAGED_DATASETS_MODULES)
    except ImportError:  # a private name; keep the common ones if it moves
        return {"json", "csv", "text", "parquet", "arrow", "pandas", "webdataset", "xml"}


def _is_remote(pattern: str) -> bool:
    return pattern.startswith(_REMOTE_PREFIXES)


def _resolve_one(pattern: str) -> str:
    """An absolute path (or glob) that exists; a missing file raises instead of a hub lookup."""
    if _is_remote(pattern):
        return pattern
    absolute = os.path.abspath(os.path.expanduser(pattern))
    if _GLOB_CHARS & set(pattern):
        if not glob.glob(absolute, recursive=True):
            raise FileNotFoundError(f"data_files pattern {pattern!r} matches no file ({absolute})")
    elif not os.path.exists(absolute):
        raise FileNotFoundError(f"data_files entry {pattern!r} does not exist ({absolute})")
    return absolute


def _resolve_data_files(data_files: Any) -> Any:
    if isinstance(data_files, (str, os.PathLike)):
        return _resolve_one(str(data_files))
    if isinstance(data_files, dict):
        return {split: _resolve_data_files(files) for split, files in data_files.items()}
    if isinstance(data_files, (list, tuple)):
        return [_resolve_one(str(f)) for f in data_files]
    raise TypeError(f"data_files={data_files!r}: expected a str, a list or a dict of them")


def _file_stats(data_files: Any) -> list[tuple[str, int, int]]:
    """(path, size, mtime_ns) of every local file named or matched: changes when a file does."""
    patterns: list[str] = []

    def collect(value: Any) -> None:
        if isinstance(value, dict):
            for v in value.values():
                collect(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                collect(v)
        else:
            patterns.append(str(value))

    collect(data_files)
    files: set[str] = set()
    for pattern in patterns:
        if _is_remote(pattern):
            files.add(pattern)
            continue
        for match in glob.glob(pattern, recursive=True) or [pattern]:
            if os.path.isdir(match):
                files.update(str(p) for p in Path(match).rglob("*") if p.is_file())
            else:
                files.add(match)
    stats = []
    for f in sorted(files):
        if _is_remote(f) or not os.path.exists(f):
            stats.append((f, -1, -1))
        else:
            st = os.stat(f)
            stats.append((f, st.st_size, st.st_mtime_ns))
    return stats


def _columns(data: Any) -> list[str]:
    columns = getattr(data, "column_names", None)
    if columns is None:  # a streaming dataset whose features are unknown until read
        first = next(iter(data), None)
        columns = list(first) if first is not None else []
    return list(columns)


def _check_text_field(data: Any, text_field: str, path: str, split: str) -> None:
    columns = _columns(data)
    if text_field not in columns:
        raise ValueError(
            f"text_field={text_field!r} is not a column of {path!r} split {split!r}; "
            f"available columns: {', '.join(map(repr, columns)) or '(none)'}"
        )


def _field_values(data: Any, text_field: str) -> Iterator[str | None]:
    """The text of each example (None kept, so indices stay aligned), read in batches."""
    for batch in data.select_columns([text_field]).iter(batch_size=1000):
        for text in batch[text_field]:
            if text is not None and not isinstance(text, str):
                raise TypeError(f"text_field={text_field!r} holds {type(text).__name__}, not str")
            yield text


def _strings(data: Any, text_field: str) -> Iterator[str]:
    return (text for text in _field_values(data, text_field) if text is not None)


def _texts(data: Any, text_field: str) -> _Texts:
    length = None if _is_streaming(data) else len(data)
    return _Texts(lambda: _strings(data, text_field), length)


def _is_streaming(data: Any) -> bool:
    return not hasattr(data, "__len__")


def _held_out_texts(data: Any, text_field: str, val_fraction: float, want_val: bool) -> _Texts:
    """Examples whose index hashes under `val_fraction` (validation) or the others (training)."""
    if not _is_streaming(data):
        indices = [i for i in range(len(data)) if _example_held_out(i, val_fraction) == want_val]
        subset = data.select(indices)
        return _Texts(lambda: _strings(subset, text_field), len(indices))

    def stream() -> Iterator[str]:
        for index, text in enumerate(_field_values(data, text_field)):
            if text is not None and _example_held_out(index, val_fraction) == want_val:
                yield text

    return _Texts(stream)


def _example_held_out(index: int, val_fraction: float) -> bool:
    return val_fraction > 0 and is_held_out(f"example\0{index}", val_fraction)
