"""Held-out tasks over the embedded corpus (Shakespeare + KJV), the validation split of training.

The documents are exactly `egmla.data.corpus.split_corpus(0.05)`'s validation texts (239 runs of
held-out blocks, 498k characters), so a model trained on the default corpus never saw them.

- `corpus_perplexity`: rolling log-likelihood of each held-out text; word and byte perplexity and
  bits per byte, which compare across tokenizers (unlike token perplexity).
- `corpus_cloze`: a HellaSwag-shaped multiple choice. The context is the held-out text up to a
  line break (at most ~400 characters, cut at a line start); the choices are the true next line
  and three lines from other held-out documents of the same source (KJV or Shakespeare), so style
  alone does not give the answer away.
"""

from __future__ import annotations

import random
import re

CONTEXT_CHARS = 400
MIN_LINE_CHARS = 25


def _held_out() -> list[tuple[str, str]]:
    """(source, text) for every held-out text, in `split_corpus(0.05)` order; source is the
    document name's prefix ("kjv" or "shakespeare")."""
    from egmla.data.corpus import corpus_documents, split_documents

    return [(doc.name.split("/")[0], text) for doc in corpus_documents()
            for text in split_documents([doc], 0.05)[1]]


def load_perplexity(**_kwargs):
    """{"test": rows with `text`}, one per held-out text."""
    import datasets

    texts = [text for _, text in _held_out()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": texts})})


def perplexity_results(doc, results):
    """lm-eval's weighted perplexities: (log-likelihood, words or bytes of the text)."""
    (loglikelihood,) = results
    words = len(re.split(r"\s+", doc["text"]))
    num_bytes = len(doc["text"].encode("utf-8"))
    return {"word_perplexity": (loglikelihood, words), "byte_perplexity": (loglikelihood, num_bytes),
            "bits_per_byte": (loglikelihood, num_bytes)}


def _is_line(line: str) -> bool:
    """A line of verse or prose: long enough, not a speaker name or a stage heading in capitals."""
    return (len(line) >= MIN_LINE_CHARS and not line.isupper()
            and not line.startswith(("ACT ", "SCENE ")))


def cloze_items(size: int = 500, seed: int = 0) -> list[dict]:
    """`size` items, the same ones on every machine for a given seed."""
    sources, texts = zip(*_held_out())
    rng = random.Random(seed)
    # Candidate answers: (document index, line start offset, line).
    candidates, by_source = [], {}
    for d, text in enumerate(texts):
        offset = 0
        for line in text.split("\n"):
            if _is_line(line) and offset >= CONTEXT_CHARS // 2:
                candidates.append((d, offset, line))
            offset += len(line) + 1
    for d, _, line in candidates:
        by_source.setdefault(sources[d], []).append((d, line))
    items = []
    for d, offset, line in rng.sample(candidates, min(size, len(candidates))):
        window = texts[d][max(0, offset - CONTEXT_CHARS):offset]
        context = window[window.index("\n") + 1:] if offset > CONTEXT_CHARS else window
        pool = by_source[sources[d]]
        wrong: list[str] = []
        while len(wrong) < 3:
            other_doc, other = pool[rng.randrange(len(pool))]
            if other_doc != d and other not in wrong and other != line:
                wrong.append(other)
        label = rng.randrange(4)
        items.append({"context": context, "choices": wrong[:label] + [line] + wrong[label:],
                      "label": label, "source": sources[d]})
    return items


def load_cloze(size: int = 500, seed: int = 0, **_kwargs):
    """{"test": rows with `context`, `choices`, `label`, `source`}."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(cloze_items(size, seed))})
