"""The engine against the plain model: greedy outputs equal a full-recompute reference for every
variant, with prefix caching on/off, chunked prefill on/off, and a pool small enough to preempt."""

from __future__ import annotations

import random

import pytest
import torch

from serve.engine import EngineConfig, InvalidRequest, LLMEngine, SamplingParams, StepFailed
from support.engine import FailingRequest, HistorySumModel, mixed_prompts, reference_greedy
from support.models import VARIANTS, build

SETTINGS = {
    "prefix+chunked": dict(enable_prefix_caching=True, enable_chunked_prefill=True),
    "no-prefix+chunked": dict(enable_prefix_caching=False, enable_chunked_prefill=True),
    "prefix+no-chunk": dict(enable_prefix_caching=True, enable_chunked_prefill=False,
                            max_num_batched_tokens=256),
    "preempt": dict(enable_prefix_caching=True, enable_chunked_prefill=True, num_blocks=14),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", ["mha", "gqa", "mla-naive", "mla-absorbed", "egmla-kv",
                                  "egmla-latent-absorbed", "egmla-const-gate-absorbed",
                                  "egmla-hidden-gate", "mla-value-embed-absorbed"])
def test_greedy_equals_full_recompute(name, setting):
    model = build(VARIANTS[name])
    prompts = mixed_prompts(model.config.vocab_size)
    config = EngineConfig(**{"block_size": 4, "num_blocks": 64, "max_num_batched_tokens": 32,
                             **SETTINGS[setting]})
    engine = LLMEngine(model, config)
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
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


def test_no_block_leaks_after_1000_random_requests_with_aborts():
    """Random prompts (some sharing prefixes), lengths, n, and aborts at random moments, on a
    pool small enough to preempt: afterwards every block is free or an evictable cache entry.
    Scheduler-only, so over the fake model (the parity tests above run the real ones)."""
    model = HistorySumModel(vocab_size=256)
    rng = random.Random(0)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=40, max_num_seqs=16,
                                           max_num_batched_tokens=48))
    prefixes = [[rng.randrange(256) for _ in range(rng.randint(4, 12))] for _ in range(8)]
    live: list[int] = []
    for i in range(1000):
        prompt = rng.choice(prefixes) + [rng.randrange(256) for _ in range(rng.randint(1, 10))]
        params = SamplingParams(max_tokens=rng.randint(1, 6), temperature=1.0, seed=i,
                                n=rng.choice([1, 1, 1, 2, 3]))
        live.append(engine.add_request(prompt, params))
        if rng.random() < 0.5:
            engine.step()
        if rng.random() < 0.15:
            engine.abort(live.pop(rng.randrange(len(live))))
        pool = engine.blocks.pool
        held = sum(len(engine.blocks.block_table(s.seq_id)) for s in (*engine.running, *engine.waiting)
                   if engine.blocks.has(s.seq_id))
        assert sum(b.ref_count for b in pool.blocks) == held  # no leak, no double count
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.preemptions > 0
    assert engine.blocks.num_used() == 0 and engine.blocks.num_free() == 40
    reasons = {s.finish_reason for s in engine.finished.values()}
    assert {"abort", "length"} <= reasons


def test_metrics_are_consistent():
    model = build(VARIANTS["mla-absorbed"], dtype=torch.float32)
    engine = LLMEngine(model, EngineConfig(block_size=8, num_blocks=64, max_num_batched_tokens=64))
    prompts = mixed_prompts(model.config.vocab_size)
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=5))
    m = engine.metrics()
    assert m["requests_finished"] == 16 and m["output_tokens"] == 16 * 5
    assert m["output_tokens_per_s"] > 0 and 0 < m["ttft_mean_s"] and 0 < m["tpot_mean_s"]
    assert 0 < m["prefix_cache_hit_rate"] < 1  # half the prompts share a 24-token prefix
    assert 0 < m["fragmentation_mean"] < 0.5  # only each sequence's last block is part-empty
    assert m["kv_blocks_used"] == 0 and m["fragmentation_now"] == 0.0
    for s in engine.finished.values():
        assert s.ttft <= s.finish_time - s.arrival


@pytest.mark.parametrize(
    "prompt_len, params, config, message",
    [
        (0, {}, {}, "prompt is empty"),
        (250, {"max_tokens": 10}, {}, "exceeds the model's context"),
        (40, {"max_tokens": 8}, {"num_blocks": 4}, "the pool has 4"),
        (40, {}, {"enable_chunked_prefill": False, "max_num_batched_tokens": 16},
         "chunked prefill is off"),
    ],
)
def test_requests_that_can_never_run_are_refused_up_front(prompt_len, params, config, message):
    model = build(VARIANTS["mha"], dtype=torch.float32)
    engine = LLMEngine(model, EngineConfig(**{"block_size": 4, "num_blocks": 64, **config}))
    with pytest.raises(ValueError, match=message):
        engine.add_request([1] * prompt_len, SamplingParams(**params))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("bad, message", [
    ({"max_tokens": 0}, "max_tokens=0"), ({"temperature": -1}, "temperature=-1"),
    ({"top_p": 0}, "top_p=0"), ({"n": 0}, "n=0"),
    ({"max_tokens": True}, "max_tokens=True: must be an integer"),
    ({"max_tokens": 4.0}, "max_tokens=4.0: must be an integer"),
    ({"temperature": float("nan")}, "temperature=nan: must be a finite"),
    ({"temperature": float("inf")}, "temperature=inf: must be a finite"),
    ({"temperature": "0.5"}, "temperature='0.5'"),
    ({"top_k": -2}, "top_k=-2"), ({"seed": "1"}, "seed='1'"),
    ({"min_p": 1.5}, "min_p=1.5"), ({"presence_penalty": 2.5}, "presence_penalty=2.5"),
    ({"frequency_penalty": -3}, "frequency_penalty=-3"),
    ({"repetition_penalty": 0}, "repetition_penalty=0"), ({"logprobs": 21}, "logprobs=21"),
    ({"logprobs": -1}, "logprobs=-1"), ({"min_tokens": 5, "max_tokens": 4}, "min_tokens=5"),
    ({"ignore_eos": 1}, "ignore_eos=1: must be true or false"),
    ({"stop": 5}, "stop=5: must be a string or a list"), ({"stop": ["a", 1]}, "stop="),
    ({"best_of": 2}, "best_of: vLLM's or OpenAI's, not implemented here"),
    ({"prompt_logprobs": 21}, "prompt_logprobs=21"),
    ({"temprature": 0.5}, "unknown field.s. temprature"),
    ({"seed": 2**64}, "seed=18446744073709551616"), ({"seed": -2**63 - 1}, "seed="),
    ({"seed": 2**64 - 1, "n": 2}, r"seed \+ n - 1"),
    ({"stop_token_ids": (1, "x")}, "stop_token_ids"),
])
def test_bad_sampling_params_name_the_field(bad, message):
    with pytest.raises(InvalidRequest, match=message) as caught:
        SamplingParams(**bad)
    assert caught.value.param in (next(iter(bad)), "seed", "min_tokens")


def test_seeds_at_the_edges_of_the_64_bit_range_run():
    """Every sample's seed (seed + i) reaches torch.Generator.manual_seed, which takes
    [-2**63, 2**64 - 1]."""
    model = build(VARIANTS["mha"], dtype=torch.float32)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64))
    for seed, n in ((2**64 - 2, 2), (-2**63, 3), (2**64 - 1, 1)):
        [samples] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=1.0,
                                                                seed=seed, n=n))
        assert [len(s) for s in (samples if n > 1 else [samples])] == [3] * n
    assert engine.blocks.num_used() == 0


@pytest.mark.parametrize("field, ids", [("prompt", [1, 256]), ("prompt", [-1]), ("prompt", [2**70]),
                                        ("prompt", [1, True]), ("stop_token_ids", [300])])
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_field(field, ids):
    model = build(VARIANTS["mha"], dtype=torch.float32)  # vocabulary of 256
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64))
    prompt, params = (ids, SamplingParams()) if field == "prompt" else (
        [1, 2], SamplingParams(stop_token_ids=tuple(ids)))
    with pytest.raises(InvalidRequest, match=rf"{field}\[\d+\]=.*\[0, 256\)") as caught:
        engine.add_request(prompt, params)
    assert caught.value.param == field and not engine.has_unfinished()


class FaultyForward:
    """Makes the engine's forward raise where `fails(call number from 1, rows)` holds, else
    runs it; `rows` records the number of rows of each forward that raised."""

    def __init__(self, engine: LLMEngine, fails) -> None:
        self.forward, self.fails, self.calls, self.rows = engine._forward, fails, 0, []
        engine._forward = self

    def __call__(self, rows):
        self.calls += 1
        if self.fails(self.calls, rows):
            self.rows.append(len(rows))
            raise RuntimeError(f"injected fault in forward call {self.calls}")
        return self.forward(rows)


@pytest.mark.parametrize("fail_from", [1, 3], ids=["in-prefill", "in-decode"])
def test_a_failing_request_fails_alone_and_frees_its_blocks(fail_from):
    model = build(VARIANTS["mla-absorbed"], dtype=torch.float32)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64, max_num_seqs=2))
    first = engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=6, n=2, seed=0,
                                                                temperature=1.0))
    faulty = FaultyForward(engine, lambda call, rows: call >= fail_from)  # from then on
    with pytest.raises(StepFailed, match="injected fault in forward call") as caught:
        while engine.has_unfinished():
            engine.step()
    assert caught.value.request_ids == [first]
    if fail_from == 3:  # the samples' decode failed, then sample 0's alone: the request fails
        assert faulty.rows == [2, 1]  # (and its sample 1 is not run again)
    del engine._forward
    assert engine.is_finished(first)
    assert {s.finish_reason for s in engine.release(first)} == {"error"}
    assert engine.blocks.num_used() == 0 and not engine.has_unfinished()
    # the engine serves on: the next request gives the reference tokens
    assert engine.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=5)) == [
        reference_greedy(model, [7, 8, 9], 5)]
    assert engine.stats.failed == (1 if fail_from == 1 else 2)  # a prompt that failed never forked
    assert engine.blocks.num_used() == 0


# Requests of every kind that share steps with the failing one: greedy, seeded (top-k, min-p,
# penalties), two seeded samples of one prompt, a prompt sharing the failing one's first two
# blocks (prefix cache) and one long enough to be prefilled in chunks alongside decodes.
INNOCENT = [
    ([1, 2, 3, 4, 5], dict(temperature=0, max_tokens=8)),
    ([7, 8, 9], dict(temperature=10.0, top_k=20, min_p=0.01, seed=3, max_tokens=9)),
    ([20, 21, 22, 23, 24, 25, 26, 27, 28], dict(temperature=8.0, n=2, seed=5, max_tokens=7,
                                                 repetition_penalty=1.3, presence_penalty=0.5)),
    ([40, 41, 42, 43, 44, 45, 46, 47, 90], dict(temperature=0, max_tokens=6)),
    (list(range(30, 80)), dict(temperature=0, max_tokens=5)),
]
CULPRIT = ([40, 41, 42, 43, 44, 45, 46, 47, 60, 61], dict(temperature=0, max_tokens=8))
# HistorySumModel's next token is a sum over every cached token: a K/V slot left wrong changes
# every later token. The real model is there for a real forward (its attention is too smooth to
# tell a wrong slot by its tokens).
ISOLATION_MODELS = {"history-sum": HistorySumModel,
                    "egmla-kv": lambda: build(VARIANTS["egmla-kv"], dtype=torch.float32)}


def run_to_end(engine: LLMEngine, requests) -> tuple[dict[int, list], dict[int, str]]:
    """Add `requests` (prompt, params dict) together and step until done: (outputs by request
    id (every sample's tokens), reasons by failed request id)."""
    ids = [engine.add_request(prompt, SamplingParams(**kw)) for prompt, kw in requests]
    failed = {}
    while engine.has_unfinished():
        try:
            engine.step()
        except StepFailed as error:
            failed.update(error.reasons)
    outputs = {i: [engine.finished[s].output for s in engine.requests[i]]
               for i in ids if i not in failed}
    return outputs, failed


@pytest.mark.parametrize("model_name", list(ISOLATION_MODELS))
@pytest.mark.parametrize("after", [0, 3], ids=["from-prefill", "mid-decode"])
@pytest.mark.parametrize("where", ["forward", "sample"])
def test_a_request_failing_in_its_forward_or_sampling_leaves_the_others_their_own_tokens(
        where, after, model_name):
    """The others' tokens equal their tokens alone, though the fault struck batches they were
    in and the failing forward first wrote wrong K/V into their new slots (rewritten when their
    rows ran again)."""
    model = ISOLATION_MODELS[model_name]()
    config = EngineConfig(block_size=4, num_blocks=96, max_num_batched_tokens=24)
    alone = [run_to_end(LLMEngine(model, config), [request])[0] for request in INNOCENT]
    engine = LLMEngine(model, config)
    fault = FailingRequest(engine, CULPRIT[0], where, after=after)
    outputs, failed = run_to_end(engine, [CULPRIT, *INNOCENT])
    culprit = 0  # the first request added
    assert list(failed) == [culprit] and "injected fault" in failed[culprit]
    assert list(outputs.values()) == [next(iter(a.values())) for a in alone]
    assert max(fault.fired) > 1  # it failed in a batch with other requests' rows
    assert len(engine.finished[culprit].output) == after  # nothing appended twice, or after
    assert engine.finished[culprit].finish_reason == "error" and engine.stats.failed == 1
    assert engine.blocks.num_used() == 0 and not engine.has_unfinished()


def test_a_forward_that_fails_once_is_run_again_and_fails_nobody():
    """A fault that goes with the batch, not with a request (say, memory for one large
    forward): the halves succeed, and every request gets its own tokens."""
    model = build(VARIANTS["mha"], dtype=torch.float32)
    config = EngineConfig(block_size=4, num_blocks=96)
    alone = [run_to_end(LLMEngine(model, config), [request])[0] for request in INNOCENT]
    engine = LLMEngine(model, config)
    faulty = FaultyForward(engine, lambda call, rows: len(rows) == 6 and not faulty.rows)
    outputs, failed = run_to_end(engine, INNOCENT)
    assert not failed and faulty.rows == [6]  # a decode of all six samples, run again in halves
    assert list(outputs.values()) == [next(iter(a.values())) for a in alone]
    assert engine.blocks.num_used() == 0


def test_a_failing_step_leaves_the_requests_it_did_not_run_alone():
    model = build(VARIANTS["mha"], dtype=torch.float32)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64, max_num_seqs=1))
    a = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=8))
    b = engine.add_request([4, 5, 6], SamplingParams(temperature=0, max_tokens=4))  # waits: one row per step
    FaultyForward(engine, lambda call, rows: call == 1)
    with pytest.raises(StepFailed) as caught:
        engine.step()
    assert caught.value.request_ids == [a]
    while engine.has_unfinished():
        engine.step()
    assert engine.finished[b].output == reference_greedy(model, [4, 5, 6], 4)
    assert engine.finished[a].finish_reason == "error" and engine.blocks.num_used() == 0


def test_pool_sized_from_a_kv_memory_budget():
    model = build(VARIANTS["egmla-kv"], dtype=torch.float32)
    per_block = model.cache_spec().bytes_per_token(torch.float32) * 16
    budget = 10 * per_block + per_block // 2  # ten and a half blocks
    engine = LLMEngine(model, EngineConfig(block_size=16, kv_cache_memory=budget))
    assert engine.config.num_blocks == 10
    assert engine.cache.nbytes() == 10 * per_block <= budget  # measured, not just computed
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLMEngine(model, EngineConfig(block_size=16, kv_cache_memory=per_block - 1))


def test_forward_groups_keep_decodes_together_and_bound_prefill_padding():
    from serve.executor import forward_groups as _forward_groups

    lengths = [1, 512, 1, 30, 500, 1, 28, 2]
    groups = _forward_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert groups[0] == [0, 2, 5]  # every decode in one forward
    for g in groups[1:]:
        assert len(g) * max(lengths[i] for i in g) <= 1.25 * sum(lengths[i] for i in g)


def test_packed_prefill_chunks_run_in_one_forward_beside_the_decodes():
    from serve.executor import forward_groups as _forward_groups

    lengths = [1, 512, 1, 30, 500, 7, 28, 2]
    assert _forward_groups(lengths, pack=True) == [[0, 2], [1, 3, 4, 5, 6, 7]]
    assert _forward_groups([1, 1], pack=True) == [[0, 1]]
    assert _forward_groups([40, 3], pack=True) == [[0, 1]]


@pytest.mark.parametrize("name", ["mha", "gqa"])
def test_packed_steps_decode_as_the_full_recompute(name, monkeypatch):
    from serve.executor import Executor

    packed_rows, real = [], Executor._packed
    monkeypatch.setattr(Executor, "_packed",
                        lambda self, rows: packed_rows.append(len(rows)) or real(self, rows))
    model = build(VARIANTS[name])
    prompts = mixed_prompts(model.config.vocab_size)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=96, max_num_batched_tokens=48))
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    assert packed_rows and max(packed_rows) > 2  # the packed path ran, several rows at once
    for prompt, out in zip(prompts, outputs):
        assert out == reference_greedy(model, prompt, 6)
