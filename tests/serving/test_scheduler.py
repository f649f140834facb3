"""The scheduler alone, over a fake model whose every output has a plain-Python reference
(support.engine.HistorySumModel): thousands of requests in seconds, each token checked."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from serve.engine import EngineConfig, LLMEngine, SamplingParams
from support.engine import HistorySumModel, history_sum_greedy

VOCAB = 97


def workload(count: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) pairs: lengths 1-60, a third sharing one of four prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(8, 24))] for _ in range(4)]
    out = []
    for _ in range(count):
        tail = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 36))]
        prompt = rng.choice(prefixes) + tail if rng.random() < 1 / 3 else tail
        out.append((prompt, rng.randint(1, 24)))
    return out


def test_the_fake_model_equals_its_reference_without_a_cache():
    model, prompt = HistorySumModel(VOCAB), [5, 90, 13, 2]
    ids = torch.tensor([prompt])
    for _ in range(6):
        nxt = model(ids, torch.arange(ids.shape[1]))[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat((ids, nxt), 1)
    assert ids[0, len(prompt):].tolist() == history_sum_greedy(prompt, 6, VOCAB)


SETTINGS = {
    "roomy": dict(num_blocks=400),
    "preempting": dict(num_blocks=24),
    "no-prefix-cache": dict(num_blocks=24, enable_prefix_caching=False),
    "no-chunking": dict(num_blocks=40, enable_chunked_prefill=False, max_num_batched_tokens=96),
    "one-row": dict(num_blocks=40, max_num_seqs=1),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_every_token_of_a_random_workload_matches_the_reference(setting):
    """Arrivals between steps, preemption by recompute, prefix hits and chunked prefill: the
    engine's greedy output equals the model's reference for every request, and every step's
    plan keeps within the budgets and adds up to the engine's own counters."""
    config = EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
    config = dataclasses.replace(config, **SETTINGS[setting])
    engine, rng = LLMEngine(HistorySumModel(VOCAB), config), random.Random(1)
    requests, plans = {}, []
    pending = workload(300, seed=2)
    while pending or engine.has_unfinished():
        for _ in range(rng.randint(0, 3) if pending else 0):
            prompt, max_tokens = pending.pop()
            requests[engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))] = (
                prompt, max_tokens)
        engine.step()
        if engine.last_plan.rows:
            plans.append(engine.last_plan)
    for rid, (prompt, max_tokens) in requests.items():
        assert engine.sequence(rid).output == history_sum_greedy(prompt, max_tokens, VOCAB)
    for plan in plans:
        assert 0 < plan.num_batched_tokens <= config.max_num_batched_tokens
        assert len(plan.rows) <= config.max_num_seqs
        assert len({r.seq_id for r in plan.rows}) == len(plan.rows)
    st = engine.stats
    assert sum(len(p.preempted) for p in plans) == st.preemptions
    assert sum(r.num_new_tokens for p in plans for r in p.rows if r.is_prefill) == st.prefill_tokens
    assert sum(r.num_new_tokens for p in plans for r in p.rows if not r.is_prefill) == st.decode_tokens
    if setting == "preempting":
        assert st.preemptions > 0 and engine.blocks.hit_rate > 0
    assert engine.blocks.num_used() == 0


def test_the_per_step_snapshot_is_the_metrics_without_the_walk():
    engine = LLMEngine(HistorySumModel(VOCAB), EngineConfig(block_size=4, num_blocks=64))
    for prompt, max_tokens in workload(12, seed=3):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    for _ in range(4):
        engine.step()
    full, cheap = engine.metrics(), dataclasses.asdict(engine.snapshot(now=False))
    now = {k for k in full if k.endswith("_now")}
    assert all(cheap[k] is None for k in now) and all(full[k] is not None for k in now)
    assert {k: v for k, v in cheap.items() if k not in now} == {
        k: v for k, v in full.items() if k not in now}
    assert full["running"] + full["waiting"] == 12 - full["requests_finished"]
    assert full["kv_bytes_used_now"] > 0
