"""Tokenize once into a flat token file, then serve fixed-length windows of it.

    tokens = tokenize_to_cache(src.train, tok, {"source": src.fingerprint, "split": "train"})
    data = PackedDataset(tokens, seq_len=256)
    x, y = data[0]          # y is x shifted left by one: y[t] is the token after x[t]

Documents are concatenated with eos after each, so a window may span a document boundary and
the model learns that eos starts something new (GPT-2 / nanoGPT packing). No padding, no waste.

The token file is a plain .npy under cache_dir()/tokens/, keyed by the caller's description of
the data and the tokenizer's fingerprint; later runs (and other ranks) memory-map it instead of
tokenizing again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from egmla import files
from egmla.data.tokenizer import tokenizer_fingerprint
from egmla.paths import cache_dir

TOKEN_FORMAT_VERSION = 1  # bump when what is written changes (e.g. eos placement)
BATCH_DOCS = 256  # texts per call into the Rust tokenizer


def token_cache_path(
    key_parts: dict[str, Any], tokenizer: Any, max_tokens: int | None = None
) -> Path:
    """Where `tokenize_to_cache` keeps (or will keep) the tokens for this data and tokenizer."""
    key = {
        "data": key_parts,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "max_tokens": max_tokens,
        "format": TOKEN_FORMAT_VERSION,
    }
    try:
        text = json.dumps(key, sort_keys=True)
    except TypeError as err:
        raise TypeError(f"key_parts must be JSON-serializable: {key_parts!r} ({err})") from err
    return cache_dir() / "tokens" / f"{hashlib.sha256(text.encode()).hexdigest()}.npy"


def tokenize_to_cache(
    texts: Iterable[str],
    tokenizer: Any,
    key_parts: dict[str, Any],
    max_tokens: int | None = None,
    desc: str = "tokenize",
) -> np.ndarray:
    """All `texts` tokenized, eos after each, as one flat array (memory-mapped from the cache).

    `key_parts` must describe the texts completely (e.g. a source fingerprint and the split):
    it is the cache key, so two different datasets with the same key_parts would collide.
    `max_tokens` stops early (and truncates) so a streaming source can be capped. The dtype is
    uint16 when every id fits, else uint32: half the disk and page cache for vocabularies <= 65,536.
    """
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r}: must be a positive number of tokens or None")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"{type(tokenizer).__name__} has no eos token to separate documents")
    path = token_cache_path(key_parts, tokenizer, max_tokens)
    if path.is_file():
        return np.load(path, mmap_mode="r")

    dtype = np.uint16 if len(tokenizer) <= 2**16 else np.uint32
    chunks = _encode(texts, tokenizer, eos, dtype, max_tokens, desc)
    total = sum(len(c) for c in chunks)
    if total == 0:
        raise ValueError(f"{desc}: no text to tokenize (key_parts={key_parts!r})")

    path.parent.mkdir(parents=True, exist_ok=True)
    with files.atomic_path(path, suffix=".npy") as tmp:  # a reader sees no file or the whole file
        # Filled chunk by chunk: peak memory is the chunks, not chunks + one concatenated copy.
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(total,))
        start = 0
        chunks.reverse()
        while chunks:
            chunk = chunks.pop()
            out[start : start + len(chunk)] = chunk
            start += len(chunk)
        out.flush()
        del out
    return np.load(path, mmap_mode="r")


def _encode(
    texts: Iterable[str], tokenizer: Any, eos: int, dtype: Any, max_tokens: int | None, desc: str
) -> list[np.ndarray]:
    """Token chunks (one per batch of texts), each document followed by eos."""
    from tokenizers import Tokenizer
    from tqdm.auto import tqdm

    # A private copy: transformers may have left truncation/padding switched on in the shared
    # backend after a padded call, which would silently cut documents here.
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # no offsets: faster

    try:
        total_docs: int | None = len(texts)  # type: ignore[arg-type]
    except TypeError:  # a generator or a streaming source
        total_docs = None
    chunks: list[np.ndarray] = []
    count = 0
    with tqdm(total=total_docs, desc=desc, unit="doc", mininterval=1.0) as bar:
        for batch in _batches(iter(texts), BATCH_DOCS):
            ids: list[int] = []
            for encoding in encode(batch, add_special_tokens=False):
                ids.extend(encoding.ids)
                ids.append(eos)
            chunk = np.asarray(ids, dtype=dtype)
            if max_tokens is not None and count + len(chunk) >= max_tokens:
                chunks.append(chunk[: max_tokens - count])
                count = max_tokens
                bar.update(len(batch))
                break
            chunks.append(chunk)
            count += len(chunk)
            bar.update(len(batch))
            bar.set_postfix(tokens=f"{count:,}", refresh=False)
    return chunks


def _batches(texts: Iterator[str], size: int) -> Iterator[list[str]]:
    while batch := list(islice(texts, size)):
        for text in batch:
            if not isinstance(text, str):
                raise TypeError(f"texts must be str, got {type(text).__name__}: {text!r:.80}")
        yield batch


class PackedDataset(Dataset):
    """Non-overlapping windows of a flat token array: item i is (input_ids, labels).

    input_ids = tokens[i*T : i*T + T] and labels = tokens[i*T + 1 : i*T + T + 1], both int64;
    windows share one boundary token, so len = (len(tokens) - 1) // T and nothing is wasted
    but the tail. Works on a memory-mapped array: only the rows read are paged in.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len!r}: must be >= 1")
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"{len(tokens)} tokens are fewer than one window of seq_len={seq_len} "
                f"(needs {seq_len + 1}: inputs plus the shifted label)"
            )
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"window {index} out of range for {n} windows")
        start = index * self.seq_len
        window = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)
        window = torch.from_numpy(window)  # (T + 1,)
        return window[:-1], window[1:]  # (T,), (T,)


class Indexed(Dataset):
    """A dataset whose items carry their index: (*item, index) (distillation's teacher cache
    is keyed by the window)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return (*self.dataset[index], torch.tensor(index))
