"""The server's Prometheus metrics: latency histograms fed by each finished request, and the
engine's counters and gauges (serve/metrics.py's `EngineMetrics`) read from its latest snapshot
at scrape time; each under our name (egmla_*) and under vLLM's (vllm:*, labelled with
model_name), so vLLM's dashboards and alerts read this server.
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
            for name, value in (("e2e_request_latency_seconds", out.e2e),
                                ("request_queue_time_seconds", out.queue_time)):
                if value is not None:
                    vllm[name].observe(value)

    engine.on_finish.append(observe)
    return registry


class EngineCollector:
    """Gauges and counters read from the engine's latest snapshot at scrape time, under our
    names and vLLM's."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self._engine, self._model = engine, model_name

    def collect(self):
        s = self._engine.snapshot
        gauges = {
            "egmla_num_requests_running": ("Sequences in the running batch", s.running),
            "egmla_num_requests_waiting": ("Sequences waiting to be scheduled", s.waiting),
            "egmla_kv_blocks_used": ("KV-cache blocks held by sequences", s.kv_blocks_used),
            "egmla_kv_blocks_total": ("KV-cache blocks in the pool", s.kv_blocks_total),
            "egmla_prefix_cache_hit_rate": ("Prompt blocks found in the prefix cache / looked up",
                                            s.prefix_cache_hit_rate),
        }
        for name, (help_text, value) in gauges.items():
            yield GaugeMetricFamily(name, help_text, value=value)
        counters = {
            "egmla_preemptions": ("Sequences preempted (recomputed later)", s.preemptions),
            "egmla_prompt_tokens": ("Prompt tokens computed", s.prompt_tokens),
            "egmla_generation_tokens": ("Tokens generated", s.generation_tokens),
        }
        for name, (help_text, value) in counters.items():
            yield CounterMetricFamily(name, help_text, value=value)
        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        for name, help_text, value in (
                ("vllm:num_requests_running", "Sequences in the running batch", s.running),
                ("vllm:num_requests_waiting", "Sequences waiting to be scheduled", s.waiting),
                ("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means every block is held", usage)):
            family = GaugeMetricFamily(name, help_text, labels=["model_name"])
            family.add_metric([self._model], value)
            yield family
        for name, help_text, value in (
                ("vllm:prompt_tokens", "Prompt tokens computed", s.prompt_tokens),
                ("vllm:generation_tokens", "Tokens generated", s.generation_tokens)):
            family = CounterMetricFamily(name, help_text, labels=["model_name"])
            family.add_metric([self._model], value)
            yield family
