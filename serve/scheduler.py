"""The continuous-batching scheduler and its plan (vLLM's `v1/core/sched/`).

Every step fills a token budget: running decodes first (one token each) and unfinished chunked
prefills, then waiting sequences in arrival order, long prompts cut into chunks (chunked
prefill). When the block pool cannot hold a running sequence's next tokens, the most recently
arrived running sequence is preempted by recompute: its blocks are freed and it goes back to the
head of the queue, to be prefilled again (prompt plus what it had generated; full blocks may
still be found in the prefix cache).

The decision is a value, `SchedulerOutput`: per row, the tokens to compute, from which position,
into which KV blocks, and whether prompt logprobs are wanted; and the sequences preempted. The
forward reads only the plan (serve/executor.py); the engine applies the results to its
sequences afterwards (serve/engine.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from serve.block_manager import BlockManager
from serve.config import EngineConfig
from serve.metrics import EngineStats
from serve.request import Sequence


@dataclass(frozen=True)
class ScheduledRow:
    """One sequence in a step: `num_new_tokens` tokens (`token_ids`) from position `start` (its
    KV up to `start` is in the cache already), in the blocks `block_table`. `is_prefill`: more
    than its last token was new when it was scheduled (a prompt, a chunk of one, or a
    recompute), else a decode. `prompt_logprobs`: the chunk holds prompt positions whose
    logprobs the request asked for, so every position's logits are needed."""

    seq_id: int
    request_id: int
    start: int
    num_new_tokens: int
    is_prefill: bool
    token_ids: tuple[int, ...]
    block_table: tuple[int, ...]
    prompt_logprobs: bool

    @classmethod
    def of(cls, seq: Sequence, n: int, block_table: list[int]) -> ScheduledRow:
        tokens, start = seq.tokens, seq.num_computed
        return cls(seq.seq_id, seq.request_id, start, n, len(tokens) - start > 1,
                   tuple(tokens[start : start + n]), tuple(block_table),
                   seq.wants_prompt_logprobs(start, n))


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step runs, decided by the scheduler before any forward (vLLM's SchedulerOutput):
    the rows in order (running sequences first, then newly admitted ones) and the sequences
    preempted to make room, by id."""

    rows: list[ScheduledRow]
    preempted: list[int]

    @property
    def num_batched_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.rows)


class Scheduler:
    """The waiting queue and the running batch over a block pool; `schedule()` plans a step.
    `copy_block(src, dst)` copies a KV block (copy-on-write of a shared block)."""

    def __init__(self, config: EngineConfig, blocks: BlockManager,
                 copy_block: Callable[[int, int], None], stats: EngineStats) -> None:
        self.config, self.blocks, self._copy_block, self.stats = config, blocks, copy_block, stats
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a live sequence out of the batch or the queue (it finished early)."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_computed = 0
        seq.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(seq)

    def _reserve(self, seq: Sequence, n: int) -> bool:
        pairs = self.blocks.append_slots(seq.seq_id, seq.tokens, n)
        if pairs is None:
            return False
        for src, dst in pairs:
            self._copy_block(src, dst)
        return True

    def _row(self, seq: Sequence, n: int) -> ScheduledRow:
        return ScheduledRow.of(seq, n, self.blocks.block_table(seq.seq_id))

    def schedule(self) -> SchedulerOutput:
        c = self.config
        budget, rows, preempted = c.max_num_batched_tokens, [], []
        # 1. Running sequences, oldest first: decodes (1 token) and unfinished chunked prefills.
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted below to make room for an older sequence
            want = len(seq.tokens) - seq.num_computed
            n = min(want, budget) if (want == 1 or c.enable_chunked_prefill) else want
            if n < 1 or n > budget:
                continue
            while not self._reserve(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.seq_id)
                if victim is seq:
                    break
            if seq in self.running:  # (a planned row is never a later victim: those come after it)
                rows.append(self._row(seq, n))
                budget -= n
        # 2. Waiting sequences in arrival order, while budget, rows and blocks allow.
        while self.waiting and budget > 0 and len(rows) < c.max_num_seqs:
            seq = self.waiting[0]
            if not self.blocks.has(seq.seq_id):
                cached = self.blocks.allocate_prompt(  # prompt logprobs need every position
                    seq.seq_id, seq.tokens, lookup=seq.params.prompt_logprobs is None)
                seq.num_computed = cached
                if seq.cached_tokens is None:  # a preempted sequence re-finds its own blocks
                    seq.cached_tokens = cached
                self.stats.cached_prompt_tokens += cached
            want = len(seq.tokens) - seq.num_computed
            n = min(want, budget) if c.enable_chunked_prefill else want
            if n > budget or not self._reserve(seq, n):
                # FCFS: later requests wait for this one, which holds nothing while it waits
                # (else a queue of half-admitted requests could hold the whole pool).
                self.blocks.free(seq.seq_id)
                seq.num_computed = 0
                break
            self.waiting.popleft()
            self.running.append(seq)
            if seq.scheduled_time is None:
                seq.scheduled_time = time.perf_counter()
            rows.append(self._row(seq, n))
            budget -= n
        self.stats.peak_running = max(self.stats.peak_running, len(self.running))
        return SchedulerOutput(rows, preempted)
