"""Training data: the embedded corpus, tokenizers, text sources and token packing.

Plain Python + numpy + torch (transformers, tokenizers and datasets are imported where used);
never Lightning or Hydra, so evaluation and notebooks can use the same data code.
"""

from egmla.data.corpus import (
    CorpusError,
    Document,
    corpus_documents,
    corpus_fingerprint,
    split_corpus,
)
from egmla.data.packing import PackedDataset, token_cache_path, tokenize_to_cache
from egmla.data.sources import TextSource, load_text_source
from egmla.data.tokenizer import get_tokenizer, tokenizer_fingerprint, train_bpe

__all__ = [
    "CorpusError",
    "Document",
    "PackedDataset",
    "TextSource",
    "corpus_documents",
    "corpus_fingerprint",
    "get_tokenizer",
    "load_text_source",
    "split_corpus",
    "token_cache_path",
    "tokenize_to_cache",
    "tokenizer_fingerprint",
    "train_bpe",
]
