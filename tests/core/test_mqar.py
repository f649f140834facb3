"""MQAR: the documented layout, Zoology's invariants, determinism, validation and the metric."""

from __future__ import annotations

import doctest
import math
import time

import pytest
import torch

from egmla.data import mqar
from egmla.data.mqar import (
    IGNORE_INDEX,
    MQARAccuracy,
    MQARConfig,
    MQARDataset,
    assemble_mqar,
    generate_mqar,
    mqar_accuracy,
)


def test_docstring_example():
    result = doctest.testmod(mqar, raise_on_error=False)
    assert result.attempted >= 6 and result.failed == 0


def test_worked_example_table():
    """The table in the module docstring, checked position by position."""
    inputs, labels = assemble_mqar(
        torch.tensor([[2, 4]]), torch.tensor([[8, 7]]), torch.tensor([[3, 0]]),
        torch.zeros(1, 12, dtype=torch.long),
    )
    assert inputs[0].tolist() == [2, 8, 4, 7, 4, 0, 0, 0, 0, 0, 2, 0]
    expected = [IGNORE_INDEX] * 12
    expected[4], expected[10] = 7, 8
    assert labels[0].tolist() == expected


def _pairs(cfg, inputs):
    k = cfg.num_kv_pairs
    return inputs[:, 0 : 2 * k : 2], inputs[:, 1 : 2 * k : 2]  # (N, K) keys, values


CONFIGS = [
    MQARConfig(vocab_size=64, seq_len=64, num_kv_pairs=8, num_examples=300, seed=1),
    MQARConfig(vocab_size=20, seq_len=33, num_kv_pairs=4, num_examples=300, seed=2),  # odd L
    MQARConfig(vocab_size=10, seq_len=16, num_kv_pairs=4, num_examples=300, seed=3),  # all keys
    MQARConfig(vocab_size=8192, seq_len=256, num_kv_pairs=64, num_examples=50, power_a=1.0),
]


def _cfg_id(c: MQARConfig) -> str:
    return f"V{c.vocab_size}_L{c.seq_len}_K{c.num_kv_pairs}"


@pytest.mark.parametrize("cfg", CONFIGS, ids=_cfg_id)
def test_layout_invariants(cfg):
    inputs, labels = generate_mqar(cfg)
    n, k, half = cfg.num_examples, cfg.num_kv_pairs, cfg.vocab_size // 2
    assert inputs.shape == labels.shape == (n, cfg.seq_len)
    assert inputs.dtype == labels.dtype == torch.long
    assert int(inputs.min()) >= 0 and int(inputs.max()) < cfg.vocab_size
    keys, values = _pairs(cfg, inputs)
    assert ((keys >= 1) & (keys < half)).all()
    assert ((values >= half) & (values < cfg.vocab_size)).all()
    for row in range(n):
        ks, vs = keys[row].tolist(), values[row].tolist()
        assert len(set(ks)) == k and len(set(vs)) == k, "keys and values distinct within a row"
        pair = dict(zip(ks, vs))
        labelled = (labels[row] != IGNORE_INDEX).nonzero().flatten().tolist()
        # Labels only in the query region, at even offsets, one per key, each the paired value.
        assert len(labelled) == k
        assert all(p >= 2 * k and (p - 2 * k) % 2 == 0 for p in labelled)
        queried = [int(inputs[row, p]) for p in labelled]
        assert sorted(queried) == sorted(ks), "every key queried exactly once"
        assert all(int(labels[row, p]) == pair[int(inputs[row, p])] for p in labelled)
        # No unlabelled repeat of a key after the pairs: a key there is always a labelled query.
        rest = inputs[row, 2 * k :].tolist()
        assert sum(tok in pair for tok in rest) == k


def test_fillers_cover_everything_but_the_rows_keys():
    cfg = MQARConfig(vocab_size=16, seq_len=64, num_kv_pairs=2, num_examples=200, seed=5)
    inputs, labels = generate_mqar(cfg)
    keys, _ = _pairs(cfg, inputs)
    fill = (labels == IGNORE_INDEX)
    fill[:, : 2 * cfg.num_kv_pairs] = False
    seen = set(inputs[fill].tolist())
    assert 0 in seen and cfg.vocab_size - 1 in seen
    assert not (inputs[fill].view(-1, 1) == keys.repeat_interleave(fill.sum(1), dim=0)).any()


def test_non_random_fill_is_zero():
    cfg = MQARConfig(32, 32, 4, num_examples=20, random_non_queries=False)
    inputs, labels = generate_mqar(cfg)
    fill = labels == IGNORE_INDEX
    fill[:, :8] = False
    assert (inputs[fill] == 0).all()


def test_power_law_prefers_short_gaps():
    """power_a=0.01 puts most queries in the first slots; power_a=1 spreads them uniformly."""
    def mean_slot(power_a):
        cfg = MQARConfig(256, 256, 4, power_a=power_a, num_examples=2000, seed=0)
        _, labels = generate_mqar(cfg)
        pos = (labels != IGNORE_INDEX).nonzero()[:, 1]
        return ((pos - 8) / 2).float().mean().item()

    num_slots = (256 - 8) // 2
    assert mean_slot(0.01) < 0.25 * num_slots
    assert abs(mean_slot(1.0) - (num_slots - 1) / 2) < 0.05 * num_slots


def test_deterministic_per_seed_and_different_across_seeds():
    cfg = MQARConfig(vocab_size=128, seq_len=64, num_kv_pairs=8, num_examples=50, seed=7)
    a, b = generate_mqar(cfg), generate_mqar(cfg)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    c = generate_mqar(MQARConfig(128, 64, 8, num_examples=50, seed=8))
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[1], c[1])


def test_dataset_items():
    cfg = MQARConfig(vocab_size=64, seq_len=32, num_kv_pairs=4, num_examples=10)
    ds = MQARDataset(cfg)
    inputs, labels = generate_mqar(cfg)
    assert len(ds) == 10
    x, y = ds[3]
    assert torch.equal(x, inputs[3]) and torch.equal(y, labels[3])


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(vocab_size=64, seq_len=31, num_kv_pairs=8), "seq_len=31"),
        (dict(vocab_size=17, seq_len=64, num_kv_pairs=8), "vocab_size=17"),
        (dict(vocab_size=64, seq_len=64, num_kv_pairs=0), "num_kv_pairs=0"),
        (dict(vocab_size=64, seq_len=64, num_kv_pairs=4, power_a=0.0), "power_a=0.0"),
        (dict(vocab_size=64, seq_len=64, num_kv_pairs=4, num_examples=0), "num_examples=0"),
        (dict(vocab_size=64, seq_len=64, num_kv_pairs=4, seed=-1), "seed=-1"),
    ],
)
def test_validation_names_the_value(kwargs, name):
    with pytest.raises(ValueError, match=name):
        MQARConfig(**kwargs)


def test_smallest_valid_vocab():
    MQARConfig(vocab_size=18, seq_len=32, num_kv_pairs=8)  # keys [1, 9): exactly 8


def test_accuracy_on_hand_made_logits():
    labels = torch.tensor([[IGNORE_INDEX, 3, IGNORE_INDEX, 1], [2, IGNORE_INDEX, IGNORE_INDEX, 0]])
    pred = torch.tensor([[0, 3, 2, 2], [2, 1, 1, 0]])  # row 0: 1 of 2 hits; row 1: 2 of 2
    logits = torch.nn.functional.one_hot(pred, 4).float()  # (2, 4, V=4)
    assert mqar_accuracy(logits, labels) == (3, 4)
    with pytest.raises(ValueError, match="does not match"):
        mqar_accuracy(logits[:, :3], labels)

    acc = MQARAccuracy()
    acc.update(logits, labels, "L4_kv2")
    acc.update(logits[:1], labels[:1], "L4_kv1")
    acc.update(logits, torch.full_like(labels, IGNORE_INDEX), "empty")
    out = acc.compute()
    assert out["L4_kv2"] == 0.75 and out["L4_kv1"] == 0.5 and math.isnan(out["empty"])
    acc.reset()
    assert acc.compute() == {}


def _oracle_logits(cfg, inputs):
    """Predict, at every position holding a key, the value paired with it in the prefix."""
    k = cfg.num_kv_pairs
    keys, values = _pairs(cfg, inputs)
    table = torch.zeros(inputs.shape[0], cfg.vocab_size, dtype=torch.long)  # key -> value
    table.scatter_(1, keys, values)
    pred = table.gather(1, inputs)  # (N, L): 0 where the token is not a key
    pred[:, : 2 * k] = 0
    return torch.nn.functional.one_hot(pred, cfg.vocab_size).float()  # (N, L, V)


def test_oracle_recalls_everything_and_constant_guess_is_chance():
    cfg = MQARConfig(vocab_size=64, seq_len=64, num_kv_pairs=8, num_examples=1000, seed=11)
    inputs, labels = generate_mqar(cfg)
    correct, total = mqar_accuracy(_oracle_logits(cfg, inputs), labels)
    assert total == 8000 and correct == total

    const = torch.zeros(1, 1, cfg.vocab_size)
    const[..., cfg.vocab_size // 2 + 5] = 1.0  # always the same value token
    correct, total = mqar_accuracy(const.expand(*labels.shape, -1), labels)
    p = 1 / cfg.num_values  # 1/32
    sd = (total * p * (1 - p)) ** 0.5
    assert abs(correct - total * p) < 5 * sd


def test_generation_speed():
    """10k sequences of length 256 in about a second (the brief): vectorized, not a Python loop
    per sequence (which takes minutes). Measured in this process's CPU time, which other
    processes on a shared machine do not inflate the way they do wall time."""
    cfg = MQARConfig(vocab_size=8192, seq_len=256, num_kv_pairs=64, num_examples=10_000)
    t0 = time.process_time()
    generate_mqar(cfg)
    assert time.process_time() - t0 < 3.0 * torch.get_num_threads()


def test_pair_order_is_uniform():
    """Which key sits first is uniform: no slot of the pair region favours large or small keys."""
    cfg = MQARConfig(vocab_size=66, seq_len=32, num_kv_pairs=8, num_examples=4000, seed=4)
    inputs, _ = generate_mqar(cfg)
    keys, values = _pairs(cfg, inputs)
    mean_key, mean_value = (1 + 32) / 2, (33 + 65) / 2
    sd = (32**2 / 12 / 4000) ** 0.5  # sd of a column mean under uniform draws
    assert (keys.float().mean(0) - mean_key).abs().max() < 5 * sd
    assert (values.float().mean(0) - mean_value).abs().max() < 5 * sd
