"""A step-indexed sampler: which samples a step sees depends only on (seed, step, rank, world_size).

So a run resumed at step s, or split over 2 processes, reads exactly the samples a 1-process
uninterrupted run reads. The model is an infinite stream of indices: epoch e is a permutation of
range(dataset_len) seeded by (seed, e) (identity without shuffle), epochs concatenated. Step s
takes stream items [s*B, (s+1)*B) for the global batch B; rank r takes the contiguous part
[r*B/W, (r+1)*B/W) of it.

Worked example, dataset_len=5, global_batch=4, shuffle=False, world_size=2:

    stream   0 1 2 3 | 4 0 1 2 | 3 4 0 1 | ...     (epochs: 0 1 2 3 4 | 0 1 2 3 4 | ...)
    step          0         1         2
    rank 0   0 1       4 0       3 4
    rank 1       2 3       1 2       0 1

>>> list(StepSampler(5, 4, rank=1, world_size=2, shuffle=False, start_step=1, total_steps=3))
[1, 2, 0, 1]

Steps are micro-batch steps. With gradient accumulation an optimizer step consumes `accumulate`
micro-batches, so pass the global micro-batch size (per-rank micro-batch * world_size) as
`global_batch` and resume with `start_step = optimizer_steps * accumulate`. The per-rank
DataLoader then uses `batch_size = global_batch // world_size`, and the distributed wrapper must
not substitute its own sampler (Lightning: `Trainer(use_distributed_sampler=False)`).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from torch.utils.data import Sampler


class StepSampler(Sampler[int]):
    """Yields this rank's sample indices for steps [start_step, total_steps), per_rank per step."""

    def __init__(
        self,
        dataset_len: int,
        global_batch: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        start_step: int = 0,
        total_steps: int | None = None,
        shuffle: bool = True,
    ) -> None:
        if dataset_len < 1:
            raise ValueError(f"dataset_len={dataset_len}: must be >= 1")
        if world_size < 1:
            raise ValueError(f"world_size={world_size}: must be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}: must be in [0, world_size={world_size})")
        if global_batch < 1 or global_batch % world_size:
            raise ValueError(
                f"global_batch={global_batch}: must be a positive multiple of "
                f"world_size={world_size}"
            )
        if seed < 0:
            raise ValueError(f"seed={seed}: must be >= 0")
        if start_step < 0:
            raise ValueError(f"start_step={start_step}: must be >= 0")
        if total_steps is not None and total_steps < start_step:
            raise ValueError(f"total_steps={total_steps}: must be >= start_step={start_step}")
        self.dataset_len = dataset_len
        self.global_batch = global_batch
        self.rank = rank
        self.world_size = world_size
        self.per_rank = global_batch // world_size
        self.seed = seed
        self.start_step = start_step
        self.total_steps = total_steps
        self.shuffle = shuffle
        self._cached: tuple[int, np.ndarray] | None = None  # (epoch, its permutation)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The permutation of range(dataset_len) for `epoch`; depends only on (seed, epoch)."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        if self.shuffle:
            # SeedSequence mixes (seed, epoch) into independent streams; seed + epoch would not.
            order = np.random.default_rng([self.seed, epoch]).permutation(self.dataset_len)
        else:
            order = np.arange(self.dataset_len)
        self._cached = (epoch, order)
        return order

    def stream(self, start: int, count: int) -> list[int]:
        """Stream items [start, start + count), crossing epoch boundaries as needed."""
        out: list[int] = []
        while count > 0:
            epoch, offset = divmod(start, self.dataset_len)
            take = min(count, self.dataset_len - offset)
            out += self.epoch_order(epoch)[offset : offset + take].tolist()
            start += take
            count -= take
        return out

    def step_indices(self, step: int) -> list[int]:
        """This rank's per_rank indices for one (micro-batch) step."""
        return self.stream(step * self.global_batch + self.rank * self.per_rank, self.per_rank)

    def __iter__(self) -> Iterator[int]:
        step = self.start_step
        while self.total_steps is None or step < self.total_steps:
            yield from self.step_indices(step)
            step += 1

    def __len__(self) -> int:
        if self.total_steps is None:
            raise TypeError("StepSampler with total_steps=None is infinite and has no length")
        return (self.total_steps - self.start_step) * self.per_rank
