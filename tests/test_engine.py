"""The engine against the plain model: greedy outputs equal a full-recompute reference for every
variant, with prefix caching on/off, chunked prefill on/off, and a pool small enough to preempt."""

from __future__ import annotations

import random

import pytest
import torch
from test_models import VARIANTS, build

from serve.engine import EngineConfig, LLMEngine, SamplingParams


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat((ids, model(ids)[:, -1].argmax(-1, keepdim=True)), dim=1)
    return ids[0, len(prompt):].tolist()


def mixed_prompts(vocab: int, count: int = 16, seed: int = 0) -> list[list[int]]:
    """Mixed lengths (1-40), half of them sharing a 24-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(24)]
    prompts = []
    for i in range(count):
        tail = [rng.randrange(vocab) for _ in range(rng.randint(1, 16))]
        prompts.append(shared + tail if i % 2 else [rng.randrange(vocab) for _ in range(rng.randint(1, 40))])
    return prompts


SETTINGS = {
    "prefix+chunked": dict(enable_prefix_caching=True, enable_chunked_prefill=True),
    "no-prefix+chunked": dict(enable_prefix_caching=False, enable_chunked_prefill=True),
    "prefix+no-chunk": dict(enable_prefix_caching=True, enable_chunked_prefill=False,
                            max_num_batched_tokens=256),
    "preempt": dict(enable_prefix_caching=True, enable_chunked_prefill=True, num_blocks=14),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", ["mha", "gqa", "mla-naive", "mla-absorbed", "egmla-kv",
                                  "egmla-latent-absorbed"])
def test_greedy_equals_full_recompute(name, setting):
    model = build(VARIANTS[name])
    prompts = mixed_prompts(model.config.vocab_size)
    config = EngineConfig(**{"block_size": 4, "num_blocks": 64, "max_num_batched_tokens": 32,
                             **SETTINGS[setting]})
    engine = LLMEngine(model, config)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=8))
    for prompt, out in zip(prompts, outputs):
        assert out == reference_greedy(model, prompt, 8)
    if setting == "preempt":
        assert engine.stats.preemptions > 0
    if setting == "prefix+chunked":
        assert engine.stats.cached_prompt_tokens > 0
    assert engine.blocks.num_used() == 0  # every block back: free or evictable cache
