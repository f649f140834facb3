"""What a converted model has kept of the original (docs/upcycling.md): held-out perplexity and
KL divergence to the original, on the recovery domain and on unseen text, and perplexity
against context length.

    windows = eval_windows(tokenizer, "corpus")          # (16, 513) held-out token ids
    quality(model, original, windows)                    # {"ppl": .., "kl": .., "tokens": ..}
    context_curve(model, long_windows)                   # mean loss per position bucket

Two held-out domains: `recovery` (the recovery mixture's held-out documents: the domain the
recovery trains on, unseen documents of it) and `corpus` (the embedded corpus's held-out
blocks, Shakespeare and the King James Bible: a domain the recovery never sees, so what
carries over there is recovery, not adaptation). KL(original || model) is over the whole
vocabulary, per token, in nats; both models in float32.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from egmla.data.packing import tokenize_to_cache
from egmla.data.sources import load_text_source
from egmla.models import Transformer

DOMAINS = ("recovery", "corpus")
WINDOW = 512
WINDOWS = 16  # 8,192 scored tokens per domain
LONG_WINDOW = 4096
LONG_WINDOWS = 4
BUCKETS = (0, 256, 512, 1024, 2048, 3072, LONG_WINDOW)  # position buckets of the context curve


def eval_windows(tokenizer, domain: str, windows: int = WINDOWS, length: int = WINDOW
                 ) -> torch.Tensor:
    """(windows, length + 1) token ids from the start of `domain`'s held-out split (tokenized
    once and cached): inputs and their next tokens."""
    if domain not in DOMAINS:
        raise ValueError(f"domain={domain!r}: must be one of {', '.join(DOMAINS)}")
    source = load_text_source(domain)
    need = windows * (length + 1)
    flat = tokenize_to_cache(source.val, tokenizer, {"data": source.fingerprint, "split": "val",
                                                     "purpose": "upcycle-eval"},
                             max_tokens=need, desc=f"tokenize {domain} held-out")
    if len(flat) < need:
        raise ValueError(f"{domain}: {len(flat)} held-out tokens, fewer than {windows} windows "
                         f"of {length + 1}")
    return torch.from_numpy(np.asarray(flat[:need], dtype=np.int64)).view(windows, length + 1)


@torch.no_grad()
def quality(model: Transformer, original: Transformer | None, windows: torch.Tensor,
            batch_size: int = 4) -> dict[str, Any]:
    """Perplexity of `model` on `windows` (N, T + 1), and its mean per-token KL divergence
    from `original` (None: not measured)."""
    nll, kl, count = 0.0, 0.0, 0
    for start in range(0, len(windows), batch_size):
        batch = windows[start:start + batch_size]
        inputs, targets = batch[:, :-1], batch[:, 1:]
        log_q = model(inputs).float().log_softmax(-1)  # (B, T, V)
        nll -= log_q.gather(-1, targets[..., None]).sum().item()
        if original is not None:
            log_p = original(inputs).float().log_softmax(-1)
            kl += (log_p.exp() * (log_p - log_q)).sum().item()
        count += targets.numel()
    out = {"ppl": math.exp(nll / count), "loss": nll / count, "tokens": count}
    if original is not None:
        out["kl"] = kl / count
    return out


@torch.no_grad()
def context_curve(model: Transformer, windows: torch.Tensor, buckets=BUCKETS) -> list[dict]:
    """Mean next-token loss of `model` by position bucket over long windows (N, T + 1), one at
    a time: [{"from": a, "to": b, "loss": .., "ppl": ..}, ...]."""
    losses = []
    for row in windows:
        log_q = model(row[None, :-1]).float().log_softmax(-1)[0]  # (T, V)
        losses.append(-log_q.gather(-1, row[1:, None])[:, 0])
    losses = torch.stack(losses)  # (N, T)
    out = []
    for a, b in zip(buckets[:-1], buckets[1:]):
        if a >= losses.shape[1]:
            break
        mean = losses[:, a:b].mean().item()
        out.append({"from": a, "to": min(b, losses.shape[1]), "loss": mean, "ppl": math.exp(mean)})
    return out
