"""StepSampler: ranks partition a step, resuming replays the tail, epochs are permutations."""

from __future__ import annotations

import doctest
import itertools
import time

import pytest
import torch

from egmla.data import sampler as sampler_module
from egmla.data.sampler import StepSampler


def steps(s: StepSampler, n: int) -> list[list[int]]:
    """The first n steps of s as lists of per_rank indices (works for infinite samplers too)."""
    it = iter(s)
    return [list(itertools.islice(it, s.per_rank)) for _ in range(n)]


def test_docstring_example():
    result = doctest.testmod(sampler_module, raise_on_error=False)
    assert result.attempted >= 1 and result.failed == 0


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
def test_union_over_ranks_is_the_one_process_step(world_size, shuffle):
    n, batch = 10, 12  # batch > dataset: steps straddle epochs
    one = steps(StepSampler(n, batch, seed=3, shuffle=shuffle), 7)
    per_rank = [steps(StepSampler(n, batch, r, world_size, seed=3, shuffle=shuffle), 7)
                for r in range(world_size)]
    for s in range(7):
        # Contiguous slices in rank order, so concatenation (not just the multiset) matches.
        assert sum((per_rank[r][s] for r in range(world_size)), []) == one[s]


@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_equals_tail_of_uninterrupted_stream(world_size):
    for rank in range(world_size):
        full = list(StepSampler(7, 4, rank, world_size, seed=1, total_steps=20))
        per = 4 // world_size
        for start in [0, 1, 6, 13, 19, 20]:
            resumed = list(StepSampler(7, 4, rank, world_size, seed=1, start_step=start,
                                       total_steps=20))
            assert resumed == full[start * per :]


def test_epochs_are_permutations_and_differ():
    n = 13
    stream = list(StepSampler(n, 1, seed=5, total_steps=4 * n))
    epochs = [stream[e * n : (e + 1) * n] for e in range(4)]
    for e in epochs:
        assert sorted(e) == list(range(n))
    assert len({tuple(e) for e in epochs}) == 4, "each epoch reshuffled"
    assert list(StepSampler(n, 1, shuffle=False, total_steps=2 * n)) == list(range(n)) * 2


def test_seeds_differ_and_same_seed_repeats():
    a = list(StepSampler(100, 10, seed=0, total_steps=10))
    assert a == list(StepSampler(100, 10, seed=0, total_steps=10))
    assert a != list(StepSampler(100, 10, seed=1, total_steps=10))
    assert sorted(a) == list(range(100))


def test_epoch_order_does_not_depend_on_history():
    s = StepSampler(50, 5, seed=9)
    e3 = s.epoch_order(3).copy()
    s.epoch_order(0), s.epoch_order(7)
    assert (s.epoch_order(3) == e3).all()
    assert (StepSampler(50, 5, seed=9).epoch_order(3) == e3).all()


def test_large_start_step_is_cheap():
    s = StepSampler(1000, 64, seed=2, start_step=10**12, total_steps=10**12 + 2)
    t0 = time.perf_counter()
    out = list(s)
    assert time.perf_counter() - t0 < 0.5
    assert len(out) == len(s) == 128
    start = 10**12 * 64
    expected = s.epoch_order(start // 1000)[start % 1000 :].tolist()[:128]
    assert out == expected  # 64e12 % 1000 == 0: both steps sit inside one epoch


def test_len_and_infinite():
    assert len(StepSampler(10, 8, rank=1, world_size=4, start_step=3, total_steps=10)) == 14
    assert len(StepSampler(10, 8, start_step=5, total_steps=5)) == 0
    inf = StepSampler(10, 4)
    with pytest.raises(TypeError, match="infinite"):
        len(inf)
    assert len(list(itertools.islice(iter(inf), 100))) == 100


def test_dataloader_batches_are_steps():
    s = StepSampler(9, 6, rank=1, world_size=2, seed=4, total_steps=5)
    loader = torch.utils.data.DataLoader(list(range(9)), batch_size=s.per_rank, sampler=s)
    assert [b.tolist() for b in loader] == steps(s, 5)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(dataset_len=0, global_batch=4), "dataset_len=0"),
        (dict(dataset_len=10, global_batch=6, world_size=4), "global_batch=6"),
        (dict(dataset_len=10, global_batch=0), "global_batch=0"),
        (dict(dataset_len=10, global_batch=4, rank=2, world_size=2), "rank=2"),
        (dict(dataset_len=10, global_batch=4, world_size=0), "world_size=0"),
        (dict(dataset_len=10, global_batch=4, start_step=-1), "start_step=-1"),
        (dict(dataset_len=10, global_batch=4, start_step=5, total_steps=4), "total_steps=4"),
        (dict(dataset_len=10, global_batch=4, seed=-3), "seed=-3"),
    ],
)
def test_errors_name_the_value(kwargs, name):
    with pytest.raises(ValueError, match=name):
        StepSampler(**kwargs)
