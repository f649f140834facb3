"""The text sources a profile reads (the embedded corpus's two halves, GSM8K questions,
HumanEval prompts), tokenized into windows of a sequence length."""

from __future__ import annotations

import json

import torch


BATCH = 16  # sequences per forward pass: the largest union batch
SOURCES = ("corpus-a", "corpus-b", "gsm8k", "humaneval")


class UsageError(ValueError):
    """A bad command-line value or input; `main` prints it as one line and exits 2."""


def source_texts(name: str) -> list[str]:
    """The texts of one source (see the module doc); offline, from installed packages."""
    if name in ("corpus-a", "corpus-b"):
        from egmla.data.corpus import corpus_documents, stable_fraction

        first = name == "corpus-a"
        return [d.text for d in corpus_documents() if (stable_fraction(d.name) < 0.5) == first]
    if name == "gsm8k":
        from eval.tasks.gsm8k.utils import data_file

        with open(data_file()) as f:
            return ["\n\n".join(json.loads(line)["question"] for line in f if line.strip())]
    if name == "humaneval":
        from eval.selfdebug.datasets import load_humaneval

        return ["\n\n".join(problem.prompt for problem in load_humaneval())]
    raise UsageError(f"unknown source {name!r}; known: {', '.join(SOURCES)}")


def token_stream(tokenizer, texts: list[str], needed: int, piece: int = 50_000) -> list[int]:
    """The texts' token ids, in order, tokenized a piece of characters at a time until there are
    `needed` (a piece boundary may split a word: a few tokens in tens of thousands)."""
    ids: list[int] = []
    for text in texts:
        for start in range(0, len(text), piece):
            ids += tokenizer.encode(text[start:start + piece])
            if len(ids) >= needed:
                return ids
    return ids


def windows(token_ids: list[int], seq_len: int, tokens: int) -> torch.Tensor:
    """(n, seq_len) consecutive windows of the token stream, n * seq_len <= tokens, n a
    multiple of BATCH (at least one batch)."""
    n = min(len(token_ids) // seq_len, max(tokens // seq_len, BATCH)) // BATCH * BATCH
    if n == 0:
        raise UsageError(f"the source has {len(token_ids)} tokens, fewer than one batch of "
                         f"{BATCH} x {seq_len}; lower --seq-len")
    return torch.tensor(token_ids[: n * seq_len]).view(n, seq_len)
