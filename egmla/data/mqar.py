"""Multi-Query Associative Recall (MQAR), the recall probe of Zoology (Arora et al. 2023,
"Zoology: Measuring and improving recall in efficient language models", arXiv 2312.04927).

A sequence opens with `num_kv_pairs` key-value pairs; later each key appears once more, as a query,
and the model must emit the value it was paired with. Recall is what attention variants that store
less (MLA, EG-MLA) may lose, so this task measures it directly.

Worked example, `vocab_size=12, seq_len=12, num_kv_pairs=2`. Keys come from [1, 6), values from
[6, 12). Pairs (2 -> 8) and (4 -> 7); key 4 is queried in slot 0 (position 4) and key 2 in slot 3
(position 4 + 2*3 = 10). Non-query positions are shown as 0 here (`random_non_queries=False`):

                k    v    k    v    q                        q
    position    0    1    2    3    4    5    6    7    8    9   10   11
    Inputs:     2    8    4    7    4    0    0    0    0    0    2    0
    Labels:  -100 -100 -100 -100    7 -100 -100 -100 -100 -100    8 -100

The label sits on the query position itself: the model predicts the value as the token after the
key. -100 is ignored by the loss and by `mqar_accuracy`.

>>> keys, values = torch.tensor([[2, 4]]), torch.tensor([[8, 7]])
>>> slots = torch.tensor([[3, 0]])  # query slot of each key, slot j at position 2*K + 2*j
>>> filler = torch.zeros(1, 12, dtype=torch.long)  # what the non-query positions hold
>>> inputs, labels = assemble_mqar(keys, values, slots, filler)
>>> inputs.tolist()
[[2, 8, 4, 7, 4, 0, 0, 0, 0, 0, 2, 0]]
>>> labels.tolist()
[[-100, -100, -100, -100, 7, -100, -100, -100, -100, -100, 8, -100]]

Generated data has the same shape, with random non-query tokens (never one of the row's keys):

>>> inputs, labels = generate_mqar(MQARConfig(12, 12, 2, num_examples=3, seed=0))
>>> inputs.shape, (labels != -100).sum(dim=1).tolist()
(torch.Size([3, 12]), [2, 2, 2])

Choices, following Zoology's generator where it is explicit:
- Vocabulary split: keys in [1, V//2), values in [V//2, V). Token 0 is never a key (Zoology keeps
  it as the blank). Keys are distinct within a row, and so are values (Zoology samples both
  without replacement).
- Query slots: the region after the pairs has `(seq_len - 2K) // 2` slots at even offsets; K
  distinct slots are drawn without replacement with p(slot j) proportional to (j+1)^(power_a - 1),
  so power_a=0.01 strongly favours short gaps and power_a=1 is uniform. Key i takes the i-th slot
  drawn, and keys are in random order, so which key is queried first is random.
- Non-query tokens (`random_non_queries=True`): uniform over [0, V) minus this row's own keys.
  Zoology draws from all of [0, V), so a filler can repeat a key without a label, an unlabelled
  second query. Excluding the row's keys removes that ambiguity and is the one deliberate
  deviation. Fillers may still be values or other rows' keys (noise, never a query).
- `seq_len >= 4 * num_kv_pairs` (as Zoology asserts) so there are at least K slots. Zoology also
  asserts `vocab_size > seq_len` and an even `seq_len`; neither is needed here, so neither is
  required.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

IGNORE_INDEX = -100


@dataclass
class MQARConfig:
    """One MQAR slice: N sequences of `seq_len` tokens, each with `num_kv_pairs` pairs to recall."""

    vocab_size: int
    seq_len: int
    num_kv_pairs: int
    power_a: float = 0.01
    num_examples: int = 1000
    seed: int = 0
    random_non_queries: bool = True

    def __post_init__(self) -> None:
        k = self.num_kv_pairs
        if k < 1:
            raise ValueError(f"num_kv_pairs={k}: must be >= 1")
        if self.seq_len < 4 * k:
            raise ValueError(
                f"seq_len={self.seq_len}: must be >= 4 * num_kv_pairs = {4 * k} "
                "(K pairs take 2K positions and the K queries need K slots in the rest)"
            )
        if self.num_keys < k or self.num_values < k:
            raise ValueError(
                f"vocab_size={self.vocab_size}: too small for {k} distinct keys and values "
                f"(keys [1, {self.vocab_size // 2}), values [{self.vocab_size // 2}, "
                f"{self.vocab_size})); need vocab_size >= {2 * k + 2}"
            )
        if not self.power_a > 0:
            raise ValueError(f"power_a={self.power_a}: must be > 0 (1.0 gives uniform query gaps)")
        if self.num_examples < 1:
            raise ValueError(f"num_examples={self.num_examples}: must be >= 1")
        if self.seed < 0:
            raise ValueError(f"seed={self.seed}: must be >= 0")

    @property
    def num_keys(self) -> int:
        return self.vocab_size // 2 - 1  # keys are [1, V//2)

    @property
    def num_values(self) -> int:
        return self.vocab_size - self.vocab_size // 2  # values are [V//2, V)

    @property
    def num_slots(self) -> int:
        return (self.seq_len - 2 * self.num_kv_pairs) // 2


def assemble_mqar(
    keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, filler: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay out rows from explicit pairs and query slots; the sampling lives in `generate_mqar`.

    keys, values, slots: (N, K); filler: (N, L), used at every position that is neither a pair nor
    a query. Key i is queried at position 2K + 2*slots[:, i]. Returns inputs, labels: (N, L).
    """
    n, k = keys.shape
    inputs = filler.clone()  # (N, L)
    inputs[:, 0 : 2 * k : 2] = keys
    inputs[:, 1 : 2 * k : 2] = values
    query_pos = 2 * k + 2 * slots  # (N, K)
    if query_pos.numel() and int(query_pos.max()) >= inputs.shape[1]:
        raise ValueError(f"query position {int(query_pos.max())} is past seq_len={inputs.shape[1]}")
    inputs.scatter_(1, query_pos, keys)
    labels = torch.full_like(inputs, IGNORE_INDEX)
    labels.scatter_(1, query_pos, values)
    return inputs, labels


def _distinct(n: int, k: int, m: int, g: torch.Generator) -> torch.Tensor:
    """(n, k) rows of k distinct ints from [0, m), in random order. Cost O(n k^2), not O(n m)."""
    # Floyd's algorithm gives a uniform k-subset; a random permutation then makes the order uniform.
    out = torch.empty(n, k, dtype=torch.long)
    for i, j in enumerate(range(m - k, m)):
        t = torch.randint(0, j + 1, (n,), generator=g)
        taken = (out[:, :i] == t[:, None]).any(dim=1)
        out[:, i] = torch.where(taken, j, t)
    order = torch.rand(n, k, generator=g).argsort(dim=1)
    return out.gather(1, order)


def generate_mqar(cfg: MQARConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample `cfg.num_examples` MQAR rows; the same config (seed included) gives the same tensors.

    Returns inputs, labels: (N, seq_len) int64, labels -100 except at query positions.
    """
    g = torch.Generator().manual_seed(cfg.seed)
    n, k, length = cfg.num_examples, cfg.num_kv_pairs, cfg.seq_len
    half = cfg.vocab_size // 2
    keys = 1 + _distinct(n, k, cfg.num_keys, g)  # (N, K) in [1, V//2)
    values = half + _distinct(n, k, cfg.num_values, g)  # (N, K) in [V//2, V)

    ranks = torch.arange(1, cfg.num_slots + 1, dtype=torch.float64)
    p = ranks ** (cfg.power_a - 1)  # Zoology's power law over gaps; normalisation is implicit
    slots = torch.multinomial(p.expand(n, -1), k, replacement=False, generator=g)  # (N, K)

    if cfg.random_non_queries:
        # Uniform over [0, V) minus the row's keys: draw from V - K values, then step over each
        # excluded key at or below the draw (sorted_keys[i] - i counts the keys skipped so far).
        u = torch.randint(0, cfg.vocab_size - k, (n, length), generator=g)  # (N, L)
        shifted = keys.sort(dim=1).values - torch.arange(k)  # (N, K), non-decreasing
        filler = u + torch.searchsorted(shifted, u, right=True)
    else:
        filler = torch.zeros(n, length, dtype=torch.long)
    return assemble_mqar(keys, values, slots, filler)


class MQARDataset(Dataset):
    """One MQAR slice, generated once up front; items are (input_ids, labels), each (L,)."""

    def __init__(self, cfg: MQARConfig) -> None:
        self.cfg = cfg
        self.inputs, self.labels = generate_mqar(cfg)  # (N, L) each

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[i], self.labels[i]


def mqar_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """Argmax hits at labelled positions: (correct, total); logits (..., L, V), labels (..., L)."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits shape {tuple(logits.shape)} does not match labels shape {tuple(labels.shape)} "
            "plus a vocabulary dimension"
        )
    mask = labels != IGNORE_INDEX
    pred = logits.argmax(dim=-1)
    return int((pred[mask] == labels[mask]).sum()), int(mask.sum())


class MQARAccuracy:
    """Accumulates recall per slice (e.g. "L256_kv16"), since MQAR is reported per (L, K) cell."""

    def __init__(self) -> None:
        self.correct: dict[str, int] = defaultdict(int)
        self.total: dict[str, int] = defaultdict(int)

    def update(self, logits: torch.Tensor, labels: torch.Tensor, slice_name: str = "all") -> None:
        correct, total = mqar_accuracy(logits, labels)
        self.correct[slice_name] += correct
        self.total[slice_name] += total

    def compute(self) -> dict[str, float]:
        """slice -> accuracy; NaN for a slice that has seen no labelled position."""
        return {s: self.correct[s] / t if t else float("nan") for s, t in self.total.items()}

    def reset(self) -> None:
        self.correct.clear()
        self.total.clear()
