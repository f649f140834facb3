"""A request's state in the engine: one `Sequence` per sample (vLLM's `v1/request.py`).

The engine and its scheduler change a sequence as it runs (its output, its computed count, its
finish); everyone else reads it (`LLMEngine.samples`). A step's plan (serve/scheduler.py)
copies what the forward needs out of it, so the forward reads no live sequence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from serve import sampling
from serve.sampling import SamplingParams


@dataclass
class Sequence:
    """One sample of a request: its tokens, how far its KV is computed, its timings, its
    logprobs; a request of n samples is n sequences sharing the prompt's blocks."""

    seq_id: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache on admission
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    preemptions: int = 0
    request_id: int = -1  # the request this sample belongs to (its first sample's seq_id)
    arrival: float = field(default_factory=time.perf_counter)
    scheduled_time: float | None = None  # first admitted to the running batch
    first_token_time: float | None = None
    finish_time: float | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # With params.logprobs: per output token {token id: (logprob, rank)} (the top-N and the
    # sampled token), and the sum of the sampled tokens' logprobs.
    logprobs: list[dict[int, tuple[float, int]]] | None = None
    cumulative_logprob: float | None = None
    # With params.prompt_logprobs: the same for each prompt token (None for the first).
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def e2e(self) -> float | None:
        """Seconds from arrival to the last token (vLLM's end-to-end request latency)."""
        return None if self.finish_time is None else self.finish_time - self.arrival

    @property
    def queue_time(self) -> float | None:
        """Seconds waiting before first scheduled (vLLM's request queue time)."""
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (n - 1), as vLLM reports it."""
        if self.finish_time is None or self.first_token_time is None or len(self.output) < 2:
            return None
        return (self.finish_time - self.first_token_time) / (len(self.output) - 1)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def record_logprobs(self, logits: torch.Tensor, token: int) -> None:
        """Add this step's logprobs (params.logprobs: the top N and the sampled `token`)."""
        entry, logprob = sampling.token_logprobs(logits, token, self.params.logprobs)
        if self.logprobs is None:
            self.logprobs, self.cumulative_logprob = [], 0.0
        self.logprobs.append(entry)
        self.cumulative_logprob += logprob

    def record_prompt_logprobs(self, start: int, logits: torch.Tensor) -> None:
        """Add the prompt logprobs that a prefill chunk's logits (n, V) at positions start ..
        start + n - 1 give (a chunk computed again after a preemption adds nothing twice)."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # the first token has no context to be scored in
        self.prompt_logprobs += sampling.prompt_logprobs(
            logits, self.prompt, start, len(self.prompt_logprobs), self.params.prompt_logprobs)

    def wants_prompt_logprobs(self, start: int, num_new_tokens: int) -> bool:
        """A chunk of `num_new_tokens` from `start` holds prompt positions whose logprobs this
        request asked for and has not recorded yet."""
        done = len(self.prompt_logprobs or ())  # recorded so far (the first token's None counts)
        return (self.params.prompt_logprobs is not None and done < len(self.prompt)
                and start < len(self.prompt) and start + num_new_tokens >= done)
