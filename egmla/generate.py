"""The token draw, and a simple generator over the contiguous cache (one prefill, then one
token per step).

`next_token_probs` and `draw` are the one implementation of temperature, min_p, top_k, top_p
and the greedy argmax: the serving sampler (serve/sampling.py: penalties, min_tokens, logprobs,
the batched greedy path, on top of these) draws through them, and so does `generate`, which
tests, examples and the training report use; the serving engine (serve/) is the fast path for
many requests.

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


_F32 = torch.finfo(torch.float32)


def next_token_probs(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float = 0.0,
) -> torch.Tensor:
    """logits (B, V) -> float32 probabilities (B, V) of the next token at `temperature` > 0: each
    row finite, >= 0, summing to 1, its most likely token always kept (min_p, top_k and top_p
    cut below it, never it). NaN scores count as -inf (never drawn), +inf as float32's largest
    number; a row with no finite score (every token masked) is a ValueError.

    Why each step is safe for any finite temperature, top_p and min_p: the top score is shifted
    to 0 before dividing, so nothing overflows to +inf; the divisor is a normal float32 (a tiny
    temperature sends the other scores to -inf: greedy in the limit; a huge one makes them 0:
    uniform), so it neither flushes to zero nor becomes inf (-inf / inf would be NaN); every cut
    keeps the top token, so softmax always has a term exp(0) = 1 in its sum. A temperature
    above 8.5e37 divides by 8.5e37 (both are uniform for any logits a model produces)."""
    scores = _scores(logits)
    top = _top_scores(scores)  # (B, 1)
    # Within [tiny, 1 / tiny], so the divisor and its reciprocal (a division by a scalar may
    # run as a multiplication by it) are normal float32 numbers: 1.2e-38 to 8.5e37.
    divisor = min(max(temperature, _F32.tiny), 1 / _F32.tiny)
    scores = (scores - top) / divisor  # (B, V): the top token at 0, the rest in [-inf, 0]
    if min_p > 0.0:  # the top logit is 0 now: p_i / p_max = exp(logit_i); log(min_p) <= 0
        scores = scores.masked_fill(scores < math.log(min_p), float("-inf"))
    if top_k is not None and top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True, stable=True)
        probs = sorted_scores.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p; the first is always
        # kept (a top_p that rounds to 0 in float32, such as 1e-46, would otherwise drop all).
        drop = probs.cumsum(dim=-1) - probs >= top_p
        drop[:, 0] = False
        scores = scores.scatter(-1, order, sorted_scores.masked_fill(drop, float("-inf")))
    return scores.softmax(dim=-1)


def _scores(logits: torch.Tensor) -> torch.Tensor:
    """logits in float32 with NaN as -inf and +inf as float32's largest number (-inf stays)."""
    return torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=_F32.max,
                            neginf=float("-inf"))


def _top_scores(scores: torch.Tensor) -> torch.Tensor:
    """(B, V) float32 scores without NaN or +inf -> (B, 1) row maxima; ValueError naming the
    first row in which every score is -inf (nothing can be drawn from it)."""
    top = scores.amax(dim=-1, keepdim=True)
    dead = top.squeeze(-1) == float("-inf")
    if bool(dead.any()):
        row = int(dead.nonzero()[0, 0])
        raise ValueError(f"logits row {row}: no token has a finite score (every token is masked, "
                         "or the logits are -inf or NaN): nothing to sample")
    return top


def check_draw(temperature: float, top_k: int | None, top_p: float | None,
               min_p: float) -> None:
    """ValueError, naming the value, for a draw setting outside what `draw` takes (serve's
    SamplingParams checks its own fields once, at construction, and calls `draw` directly)."""
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p={min_p}: must be in [0, 1]")
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: must be >= 0")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k}: must be >= 1")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p}: must be in (0, 1]")


def draw(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
    min_p: float,
) -> torch.Tensor:
    """`sample_next` without its range checks, for callers that checked their settings."""
    if temperature == 0.0:
        scores = _scores(logits)
        _top_scores(scores)
        return scores.argmax(dim=-1)
    probs = next_token_probs(logits, temperature, top_k, top_p, min_p)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    min_p: float = 0.0,
) -> torch.Tensor:
    """logits (B, V) -> next token ids (B,). temperature 0 is greedy (argmax, the lowest id
    among equals). After the temperature, min_p drops the tokens whose probability is below
    min_p x the most likely one's, then top_k and top_p cut (`next_token_probs`). Any finite
    value in the accepted ranges gives a valid draw; a value outside them, or a row with no
    finite score, is a ValueError."""
    check_draw(temperature, top_k, top_p, min_p)
    return draw(logits, temperature, top_k, top_p, generator, min_p)


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
