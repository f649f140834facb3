"""The server's Prometheus metrics: latency histograms fed by each finished request, and the
engine's counters and gauges (serve/metrics.py's `EngineMetrics`) read from its latest snapshot
at scrape time; each under our name (egmla_*) and under vLLM's (vllm:*, labelled with
model_name), so vLLM's dashboards and alerts read this server.

vLLM's names, types and label as its v1 `PrometheusStatLogger` declares them
(vllm/v1/metrics/loggers.py): a Counter declared as `vllm:num_preemptions` is exposed as
`vllm:num_preemptions_total` (prometheus_client adds the suffix, here as there).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from serve.async_engine import AsyncEngine
from serve.outputs import RequestUpdate


def metrics_registry(engine: AsyncEngine, model_name: str) -> CollectorRegistry:
    """A Prometheus registry of one app's own (the module docstring says what it holds)."""
    registry = CollectorRegistry()
    latency = dict(registry=registry, buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
    ttft = Histogram("egmla_time_to_first_token_seconds", "Time to first token", **latency)
    tpot = Histogram("egmla_time_per_output_token_seconds",
                     "Time per output token after the first", **latency)
    vllm = {name: Histogram(f"vllm:{name}", text, labelnames=["model_name"], **latency).labels(model_name)
            for name, text in (
                ("time_to_first_token_seconds", "Time to first token"),
                ("inter_token_latency_seconds", "Time between tokens (each request's mean gap, "
                                                "once per gap)"),
                # vLLM's older name for the same observations, still read by its dashboards
                ("time_per_output_token_seconds", "Time per output token after the first (the "
                                                  "observations of inter_token_latency_seconds)"),
                ("e2e_request_latency_seconds", "Request latency, arrival to last token"),
                ("request_queue_time_seconds", "Time waiting before first scheduled"))}
    success = Counter("vllm:request_success", "Finished requests by finish reason",
                      labelnames=["model_name", "finished_reason"], registry=registry)
    registry.register(EngineCollector(engine, model_name))

    def observe(update: RequestUpdate) -> None:  # on the engine thread
        for out in update.outputs:
            if out.finish_reason in ("abort", "error"):
                continue
            success.labels(model_name, out.finish_reason).inc()
            if out.ttft is not None:
                ttft.observe(out.ttft)
                vllm["time_to_first_token_seconds"].observe(out.ttft)
            if out.tpot is not None:
                tpot.observe(out.tpot)
                for _ in range(len(out.token_ids) - 1):
                    vllm["inter_token_latency_seconds"].observe(out.tpot)
                    vllm["time_per_output_token_seconds"].observe(out.tpot)
            for name, value in (("e2e_request_latency_seconds", out.e2e),
                                ("request_queue_time_seconds", out.queue_time)):
                if value is not None:
                    vllm[name].observe(value)

    engine.on_finish.append(observe)
    return registry


class EngineCollector:
    """Gauges and counters read from the engine's latest snapshot at scrape time, each under our
    name, vLLM's (labelled with model_name), or both."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self._engine, self._model = engine, model_name

    def collect(self):
        s = self._engine.snapshot
        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        # (our name, vLLM's, help, value); None where one side has no such figure
        gauges = (
            ("egmla_num_requests_running", "vllm:num_requests_running",
             "Sequences in the running batch", s.running),
            ("egmla_num_requests_waiting", "vllm:num_requests_waiting",
             "Sequences waiting to be scheduled", s.waiting),
            ("egmla_kv_blocks_used", None, "KV-cache blocks held by sequences", s.kv_blocks_used),
            ("egmla_kv_blocks_total", None, "KV-cache blocks in the pool", s.kv_blocks_total),
            (None, "vllm:kv_cache_usage_perc", "KV-cache usage: 1 means every block is held", usage),
            ("egmla_prefix_cache_hit_rate", None,
             "Prompt tokens found in the prefix cache / looked up", s.prefix_cache_hit_rate),
        )
        counters = (
            ("egmla_preemptions", "vllm:num_preemptions",
             "Sequences preempted (freed, recomputed later)", s.preemptions),
            ("egmla_prompt_tokens", "vllm:prompt_tokens", "Prompt tokens computed", s.prompt_tokens),
            ("egmla_generation_tokens", "vllm:generation_tokens", "Tokens generated",
             s.generation_tokens),
            ("egmla_prefix_cache_queries", "vllm:prefix_cache_queries",
             "Prompt tokens looked up in the prefix cache", s.prefix_cache_queries),
            ("egmla_prefix_cache_hits", "vllm:prefix_cache_hits",
             "Prompt tokens found in the prefix cache", s.prefix_cache_hits),
        )
        for family, rows in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for ours, vllms, help_text, value in rows:
                if ours is not None:
                    yield family(ours, help_text, value=value)
                if vllms is not None:
                    labelled = family(vllms, help_text, labels=["model_name"])
                    labelled.add_metric([self._model], value)
                    yield labelled
