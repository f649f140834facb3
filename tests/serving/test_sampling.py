"""The sampler is numerically safe for every value SamplingParams accepts.

Property tests: hypothesis draws every sampling parameter from the whole range that validation
accepts (`serve.sampling.RANGES`, so a widened range is a tested range), both ends and beyond
included, with logits in float32 and bfloat16, large (+-1e4 and beyond), equal, or partly
-inf. Each draw must give a token id of the vocabulary that is not masked, and where the
sampler exposes its distribution (`next_token_probs`), finite probabilities that sum to 1 and
keep the most likely token. Seeded draws repeat. Hypothesis runs derandomized and without an
example database, so every run (and CI) tries the same examples.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from egmla.generate import next_token_probs, sample_next
from serve import EngineConfig, LLMEngine
from serve.engine import StepFailed
from serve.sampling import RANGES, SEED_RANGE, InvalidRequest, SamplingParams, sampling_scores
from support.models import VARIANTS, build

FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty")
VOCAB = 48
REPRODUCIBLE = dict(derandomize=True, database=None, deadline=None)


def edges(name: str) -> list[float]:
    """The accepted values at and next to both ends of a field's range."""
    r = RANGES[name]
    high = sys.float_info.max if r.high == math.inf else r.high
    values = [math.nextafter(r.low, math.inf), math.nextafter(high, -math.inf), high]
    if not r.low_open:
        values.append(r.low)
    if r.high_open:
        values.remove(high)
    return sorted({v for v in values if v in r})


def accepted(name: str) -> st.SearchStrategy[float]:
    """Any finite number validation accepts for a float field, its edges drawn often."""
    r = RANGES[name]
    anywhere = st.floats(min_value=r.low, max_value=None if r.high == math.inf else r.high,
                         exclude_min=r.low_open, exclude_max=r.high_open,
                         allow_nan=False, allow_infinity=False)
    return st.one_of(st.sampled_from(edges(name)), anywhere)


def top_ks() -> st.SearchStrategy[int | None]:
    low = int(RANGES["top_k"].low)
    return st.one_of(st.none(), st.integers(low, low + 3), st.integers(low, 2 * VOCAB),
                     st.integers(min_value=low))


def seeds() -> st.SearchStrategy[int | None]:
    low, high = SEED_RANGE
    return st.one_of(st.none(), st.sampled_from([low, high]), st.integers(low, high))


@st.composite
def params(draw, vocab: int = VOCAB, max_stops: int = VOCAB) -> SamplingParams:
    """SamplingParams with every field that shapes a draw taken from its accepted range (and
    up to `max_stops` stop token ids besides the EOS)."""
    max_tokens = draw(st.integers(1, 6))
    stop_ids = draw(st.lists(st.integers(0, vocab - 1), max_size=max_stops, unique=True))
    fields = {name: draw(accepted(name)) for name in FLOATS}
    return SamplingParams(**fields, top_k=draw(top_ks()), seed=draw(seeds()),
                          max_tokens=max_tokens, min_tokens=draw(st.integers(0, max_tokens)),
                          stop_token_ids=stop_ids, eos_token_id=draw(st.integers(0, vocab - 1)))


# Logit values a model (or a hostile checkpoint) can produce: ordinary, large, at the edge of
# float32 (bfloat16 shares its range), and -inf (a masked token).
SPECIAL = [1e4, -1e4, 0.0, 1e30, -1e30, 3.0e38, -3.0e38, float("-inf")]


@st.composite
def logits(draw, vocab: int = VOCAB) -> torch.Tensor:
    """(vocab,) logits in float32 or bfloat16, at least one finite: random, large, one value
    everywhere (a row of equals), or mixed with extremes and -inf."""
    kind = draw(st.sampled_from(["random", "equal", "extreme"]))
    if kind == "equal":
        row = [draw(st.sampled_from(SPECIAL[:-1]))] * vocab
    else:
        scale = draw(st.sampled_from([1.0, 1e4])) if kind == "random" else 1.0
        values = st.floats(-1.0, 1.0) if kind == "random" else st.sampled_from(SPECIAL)
        row = [scale * v for v in draw(st.lists(values, min_size=vocab, max_size=vocab))]
        row[draw(st.integers(0, vocab - 1))] = draw(st.floats(-1e4, 1e4))  # one finite at least
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return torch.tensor(row, dtype=torch.float32).to(dtype)


histories = st.lists(st.integers(0, VOCAB - 1), max_size=12)


def test_the_drawn_ranges_are_the_ones_validation_accepts():
    """The strategies above draw from `RANGES`; this holds `RANGES` to what SamplingParams
    accepts: every edge value passes, the values just past an edge and non-finite ones are
    refused naming the field."""
    for name in FLOATS:
        r = RANGES[name]
        for value in edges(name):
            assert getattr(SamplingParams(**{name: value}), name) == value
        outside = [math.nextafter(r.low, -math.inf), float("nan"), float("inf"), -float("inf")]
        outside += [r.low] if r.low_open else []
        if r.high != math.inf:
            outside += [r.high] if r.high_open else [math.nextafter(r.high, math.inf)]
        for value in outside:
            with pytest.raises(InvalidRequest) as caught:
                SamplingParams(**{name: value})
            assert caught.value.param == name
    low, high = SEED_RANGE
    assert RANGES["seed"].low == low and RANGES["seed"].high == high
    for field, good, bad in (("top_k", RANGES["top_k"].low, RANGES["top_k"].low - 1),
                             ("seed", high, high + 1), ("seed", low, low - 1)):
        SamplingParams(**{field: int(good)})
        with pytest.raises(InvalidRequest) as caught:
            SamplingParams(**{field: int(bad)})
        assert caught.value.param == field


@settings(max_examples=250, **REPRODUCIBLE)
@given(p=params(), row=logits(), prompt=histories, output=histories)
def test_every_accepted_value_gives_a_valid_draw(p, row, prompt, output):
    """Penalties, the min_tokens mask, temperature, min_p, top_k and top_p, in the engine's
    order (`sampling_scores`, then `sample_next`), on any logits: a valid, unmasked token, and
    a finite distribution summing to 1 that keeps the most likely token."""
    scores = sampling_scores(row, prompt, output, p)
    assert not scores.isnan().any() and not (scores == float("inf")).any()
    finite = scores > float("-inf")
    masked_stops = len(output) < p.min_tokens and p.stops_at()
    top_p = p.top_p if p.top_p < 1 else None
    generator = None if p.seed is None else torch.Generator().manual_seed(p.seed)
    if not finite.any():  # the stops masked every token these logits left finite
        with pytest.raises(ValueError, match="no token has a finite score"):
            sample_next(scores[None], p.temperature, p.top_k_or_none, top_p, generator, p.min_p)
        return
    token = int(sample_next(scores[None], p.temperature, p.top_k_or_none, top_p, generator,
                            p.min_p)[0])
    assert 0 <= token < VOCAB and finite[token]
    if masked_stops:
        assert token not in p.stops_at()
    best = int(scores.float().argmax())
    if p.temperature == 0:
        assert token == best
        return
    probs = next_token_probs(scores[None], p.temperature, p.top_k_or_none, top_p, p.min_p)[0]
    assert probs.dtype == torch.float32 and torch.isfinite(probs).all() and (probs >= 0).all()
    assert abs(float(probs.sum()) - 1) < 1e-5
    assert probs[token] > 0 and probs[best] > 0  # drawn from it; the most likely kept
    assert probs[~finite].sum() == 0  # masked tokens have no mass


@settings(max_examples=60, **REPRODUCIBLE)
@given(p=params(), rows=st.lists(logits(), min_size=2, max_size=4))
def test_a_batch_of_rows_draws_valid_tokens_and_a_seed_repeats_them(p, rows):
    """sample_next over several rows at once (egmla.generate's batched use), twice from the
    same seed: valid tokens, the same both times."""
    batch = torch.stack([r.float() for r in rows]).to(rows[0].dtype)
    top_p = p.top_p if p.top_p < 1 else None
    draws = [sample_next(batch, p.temperature, p.top_k_or_none, top_p,
                         torch.Generator().manual_seed(p.seed or 0), p.min_p) for _ in range(2)]
    assert torch.equal(draws[0], draws[1])
    for row, token in zip(batch, draws[0].tolist()):
        assert 0 <= token < VOCAB and row.float()[token] > float("-inf")


def test_the_reported_values_sample_as_their_limits():
    """The three values of the hostile-client probe, at their limit meaning: a top_p that is 0
    in float32 keeps the most likely token only; a huge temperature with the stop tokens masked
    samples among the others; a tiny repetition penalty raises every seen positive logit above
    the rest, so only seen tokens are drawn."""
    torch.manual_seed(0)
    row = torch.randn(VOCAB)
    best = int(row.argmax())
    g = torch.Generator().manual_seed(0)
    assert float(torch.tensor(1e-46, dtype=torch.float32)) == 0.0
    tiny_top_p = {int(sample_next(row[None], 1.0, None, 1e-46, g)[0]) for _ in range(50)}
    assert tiny_top_p == {best}

    hot = SamplingParams(temperature=sys.float_info.max, min_tokens=3, max_tokens=4,
                         stop_token_ids=[best, 0])
    scores = sampling_scores(row, [1], [], hot)
    probs = next_token_probs(scores[None], hot.temperature)[0]
    assert probs[best] == 0 and probs[0] == 0
    assert torch.allclose(probs[probs > 0], torch.full_like(probs[probs > 0], 1 / (VOCAB - 2)))

    seen = [i for i in range(VOCAB) if row[i] > 0][:3]
    keen = SamplingParams(repetition_penalty=5e-324, temperature=1.0)
    scores = sampling_scores(row, seen, [], keen)
    draws = {int(sample_next(scores[None], 1.0, generator=g)[0]) for _ in range(60)}
    assert draws <= set(seen) and len(draws) > 1  # they tie at float32's largest number


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_every_accepted_value_runs_through_the_engine(dtype):
    """Whole requests through the engine (forks, greedy batching, penalties over real outputs,
    chunked prompts) with parameters from the accepted ranges, batched together on one model in
    `dtype`: every request finishes with valid tokens, none fails."""
    model = build(VARIANTS["mla-absorbed"], dtype=dtype)
    vocab = model.config.vocab_size
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=256, max_num_batched_tokens=32))

    @settings(max_examples=8, **REPRODUCIBLE)
    @given(batch=st.lists(st.tuples(params(vocab, max_stops=16), st.lists(st.integers(0, vocab - 1),
                                                               min_size=1, max_size=20),
                                    st.integers(1, 2)), min_size=1, max_size=4))
    def run(batch):
        ids = []
        for p, prompt, n in batch:
            if p.seed is not None and p.seed + n - 1 > SEED_RANGE[1]:
                n = 1
            ids.append(engine.add_request(prompt, SamplingParams(**{**vars(p), "n": n})))
        while engine.has_unfinished():
            try:
                engine.step()
            except StepFailed as error:  # the assertion below, with the reason
                raise AssertionError(f"a request failed: {error}") from error
        for rid, (p, _, _) in zip(ids, batch):
            for seq in engine.release(rid):
                assert seq.finish_reason in ("stop", "length")
                assert 1 <= len(seq.output) <= p.max_tokens
                assert all(0 <= t < vocab for t in seq.output)
                stops = set(p.stops_at())
                assert not stops & set(seq.output[: p.min_tokens])  # none before min_tokens
        assert engine.blocks.num_used() == 0

    run()


def test_min_tokens_with_every_token_a_stop_token_is_refused():
    """The one mask that would leave nothing to draw: refused when the request arrives."""
    model = build(VARIANTS["mha"], dtype=torch.float32)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=16))
    vocab = model.config.vocab_size
    every = SamplingParams(min_tokens=1, max_tokens=2, stop_token_ids=list(range(vocab)))
    with pytest.raises(InvalidRequest, match="min_tokens=1: every token") as caught:
        engine.add_request([1, 2], every)
    assert caught.value.param == "min_tokens" and not engine.has_unfinished()
    almost = SamplingParams(min_tokens=2, max_tokens=2, stop_token_ids=list(range(1, vocab)),
                            temperature=1.0, seed=0)
    assert engine.generate([[1, 2]], almost) == [[0, 0]]  # the one token left, then it again


def test_a_row_with_nothing_to_draw_is_an_error_naming_it():
    """Logits that are all -inf or NaN (a broken model, or a caller's mask over everything)
    have no distribution: a ValueError, never a NaN draw."""
    rows = torch.tensor([[0.0, 1.0], [float("-inf"), float("nan")]])
    for temperature in (0.0, 1.0):
        with pytest.raises(ValueError, match="logits row 1: no token has a finite score"):
            sample_next(rows, temperature)
    assert sample_next(rows[:1], 1.0, generator=torch.Generator().manual_seed(0)).tolist() in ([0], [1])
    assert sample_next(torch.tensor([[float("nan"), 2.0, float("inf")]]), 0.0).tolist() == [2]
