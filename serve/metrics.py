"""The engine's numbers: running sums kept as it works (`EngineStats`) and the record it reports
(`EngineMetrics`: `LLMEngine.metrics()`, `snapshot()`, the server's /metrics), as vLLM's
`v1/metrics/stats.py`. The server's Prometheus exposition of them is serve/prometheus.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class PoolNow(NamedTuple):
    """The KV pool at one moment (a walk over every held block)."""

    reserved_bytes: int
    used_bytes: int
    fragmentation: float


@dataclass
class EngineStats:
    """Running sums the engine adds to as it works (its own bookkeeping; read `metrics()`)."""

    steps: int = 0
    preemptions: int = 0
    peak_running: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    sampled_tokens: int = 0  # tokens generated, finished or not
    aborted: int = 0  # samples aborted (client gone, or stopped by the caller)
    failed: int = 0  # samples ended by a step that raised (StepFailed)
    cached_prompt_tokens: int = 0
    # finished (not aborted) requests' samples: running sums, so metrics survive release()
    finished: int = 0
    output_tokens: int = 0
    ttft_sum: float = 0.0
    ttft_count: int = 0
    tpot_sum: float = 0.0
    tpot_count: int = 0
    first_arrival: float | None = None
    last_finish: float | None = None
    reserved_slot_steps: int = 0  # sum over steps of KV slots held by live sequences
    used_slot_steps: int = 0  # sum over steps of the slots those sequences filled

    def metrics(self, *, running: int, waiting: int, kv_blocks_used: int, kv_blocks_total: int,
                prefix_cache_queries: int, prefix_cache_hits: int,
                pool: PoolNow | None) -> EngineMetrics:
        """These sums as the reported record, with the engine's state at this moment (`pool`
        None: the `*_now` fields are None) and the block manager's prefix-cache counters."""
        span = (self.last_finish - self.first_arrival) if self.finished else 0.0
        return EngineMetrics(
            running=running, waiting=waiting,
            requests_finished=self.finished, output_tokens=self.output_tokens,
            output_tokens_per_s=self.output_tokens / span if span > 0 else None,
            ttft_mean_s=self.ttft_sum / self.ttft_count if self.ttft_count else None,
            tpot_mean_s=self.tpot_sum / self.tpot_count if self.tpot_count else None,
            steps=self.steps, preemptions=self.preemptions, peak_running=self.peak_running,
            prompt_tokens=self.prefill_tokens, generation_tokens=self.sampled_tokens,
            kv_blocks_used=kv_blocks_used, kv_blocks_total=kv_blocks_total,
            kv_bytes_reserved_now=None if pool is None else pool.reserved_bytes,
            kv_bytes_used_now=None if pool is None else pool.used_bytes,
            fragmentation_now=None if pool is None else pool.fragmentation,
            fragmentation_mean=(1 - self.used_slot_steps / self.reserved_slot_steps
                                if self.reserved_slot_steps else 0.0),
            prefix_cache_queries=prefix_cache_queries, prefix_cache_hits=prefix_cache_hits,
            prefix_cache_hit_rate=(prefix_cache_hits / prefix_cache_queries
                                   if prefix_cache_queries else 0.0),
        )


@dataclass(frozen=True)
class EngineMetrics:
    """The engine's metrics, in one record: `metrics()` returns it as a dict, the server publishes
    one after every step (`snapshot(now=False)`) for its `/metrics`. Latencies and throughput
    are over finished requests; `*_now` fields describe the pool at this moment."""

    running: int  # sequences in the running batch
    waiting: int  # sequences waiting to be scheduled
    requests_finished: int  # samples finished (not aborted or failed)
    output_tokens: int  # tokens of those samples
    output_tokens_per_s: float | None  # output_tokens / (last finish - first arrival)
    ttft_mean_s: float | None
    tpot_mean_s: float | None
    steps: int
    preemptions: int  # running sequences preempted (freed, to be recomputed) to make room
    peak_running: int
    prompt_tokens: int  # prompt (and recomputed) tokens run through a forward
    generation_tokens: int  # tokens sampled, finished or not
    kv_blocks_used: int
    kv_blocks_total: int
    # The live pool's reserved and filled bytes and their unused share; None in a snapshot
    # taken with now=False (they need a walk over every held block).
    kv_bytes_reserved_now: int | None
    kv_bytes_used_now: int | None
    fragmentation_now: float | None
    fragmentation_mean: float  # unused / reserved KV slots, summed over every step of the run
    # Prompt tokens looked up in the prefix cache (each admission attempt of a sequence that
    # reads the cache; none with caching off) and, of those, found computed: vLLM's
    # prefix_cache_queries and prefix_cache_hits.
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float  # prefix_cache_hits / prefix_cache_queries
