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


@pytest.mark.parametrize("name", ["mha", "mla-absorbed", "egmla-kv"])
def test_n_samples_share_the_prompt_blocks_and_equal_independent_runs(name):
    model = build(VARIANTS[name])
    prompt = mixed_prompts(model.config.vocab_size)[1]  # 25-40 tokens: a partial last block
    params = dict(max_tokens=6, temperature=1.0, top_k=20)
    config = EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=64)

    engine = LLMEngine(model, config)
    request = engine.add_request(prompt, SamplingParams(n=4, seed=100, **params))
    engine.step()  # the prompt's prefill; samples 1-3 fork from sample 0
    samples = engine.requests[request]
    tables = [engine.blocks.block_table(s) for s in samples]
    assert len(samples) == 4 and all(t == tables[0] for t in tables)  # every block shared
    prompt_blocks = len(tables[0])
    assert engine.blocks.num_used() == prompt_blocks  # measured: one copy for four samples
    engine.step()  # first decode: each fork copies the shared partial block before writing
    assert engine.blocks.num_used() <= prompt_blocks + 3 + 4
    assert engine.blocks.num_used() < 4 * prompt_blocks
    while engine.has_unfinished():
        engine.step()
    together = [engine.finished[s].output for s in samples]

    alone = [LLMEngine(model, config).generate([prompt], SamplingParams(seed=100 + i, **params))[0]
             for i in range(4)]
    assert together == alone
    assert len({tuple(o) for o in together}) > 1  # sampling actually varied across seeds
    assert engine.blocks.num_used() == 0
