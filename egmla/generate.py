"""A simple generator over the contiguous cache: one prefill, then one token per step.

For tests and examples; the serving engine (serve/) is the fast path for many requests.

    >>> import torch
    >>> from egmla.models import Transformer
    >>> from egmla.presets import preset
    >>> model = Transformer(preset("tiny-mla")).eval()
    >>> out = generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=4)
    >>> out.shape
    torch.Size([1, 7])
"""

from __future__ import annotations

import math

import torch
from torch import nn


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    min_p: float = 0.0,
) -> torch.Tensor:
    """logits (B, V) -> next token ids (B,). temperature 0 is greedy (argmax). After the
    temperature, min_p drops the tokens whose probability is below min_p x the most likely
    one's, then top_k and top_p cut."""
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p={min_p}: must be in [0, 1]")
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: must be >= 0")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k}: must be >= 1")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p}: must be in (0, 1]")
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    # Shift the maximum to 0 and keep the divisor a normal float32: a tiny temperature then sends
    # the other logits to -inf (greedy in the limit) instead of overflowing them all to inf (or
    # dividing by a flushed-to-zero subnormal) and making softmax NaN.
    logits = logits.float()
    divisor = max(temperature, torch.finfo(torch.float32).tiny)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / divisor
    if min_p > 0.0:  # the top logit is 0 now: p_i / p_max = exp(logit_i)
        logits = logits.masked_fill(logits < math.log(min_p), float("-inf"))
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p (keeps at least one).
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Continue each row of `prompt_ids` (B, T), all rows the same length.

    Returns (B, T + n) with n <= max_new_tokens; generation stops early once every row has
    produced `eos_token_id`, and rows that finished earlier are padded with it.
    """
    if prompt_ids.dim() == 1:
        prompt_ids = prompt_ids[None]
    B, T = prompt_ids.shape
    if T == 0:
        raise ValueError("prompt_ids is empty: generation needs at least one prompt token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 0")
    limit = model.config.max_seq_len
    if T + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({T}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len={limit}"
        )
    cache = model.new_cache(B, T + max_new_tokens)
    tokens, done = prompt_ids, torch.zeros(B, dtype=torch.bool, device=prompt_ids.device)
    step_input = prompt_ids
    for _ in range(max_new_tokens):
        logits = model(step_input, cache=cache)[:, -1]  # (B, V)
        nxt = sample_next(logits, temperature, top_k, top_p, generator)
        if eos_token_id is not None:
            nxt = nxt.masked_fill(done, eos_token_id)
            done |= nxt == eos_token_id
        tokens = torch.cat((tokens, nxt[:, None]), dim=1)
        if done.all():
            break
        step_input = nxt[:, None]
    return tokens
