"""vLLM's Prometheus metrics (V1 names, labels model_name and engine), beside pagedkv's own, so
that vLLM's Grafana dashboards and alerts work unchanged. What a request measures is observed when
it finishes, from its RequestMetrics; pool and queue figures come from the engine loop's stats
snapshot at scrape time (vllm:iteration_tokens_total too: the engine keeps that histogram)."""

from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


def one_two_five_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets for token counts)."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return buckets
            buckets.append(step * scale)
        scale *= 10


class VLLMMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int, stats_source,
                 cache_config: dict):
        self.labels = (model_name, "0")
        names = ["model_name", "engine"]
        token_buckets = one_two_five_buckets(max_model_len)

        def histogram(name: str, documentation: str, buckets) -> Histogram:
            return Histogram(name, documentation, names, buckets=buckets, registry=registry).labels(*self.labels)

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, names, registry=registry).labels(*self.labels)

        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds", "Time between tokens", _LATENCY_BUCKETS)
        self.time_per_output_token = histogram("vllm:time_per_output_token_seconds",
                                               "A request's mean time per output token after the first",
                                               _LATENCY_BUCKETS)
        self.e2e_latency = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish", _LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled", _LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds", "First scheduled to finish",
                                        _LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds", "First scheduled to first token",
                                      _LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds", "First token to finish", _LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens per request", token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens", "Generated tokens per request",
                                                   token_buckets)
        self.params_n = histogram("vllm:request_params_n", "Requests' n", [1, 2, 5, 10, 20])
        self.num_preemptions = histogram("vllm:request_num_preemptions", "Preemptions per finished request",
                                         [1, 2, 3, 4, 5, 10, 20])
        self.params_max_tokens = histogram("vllm:request_params_max_tokens", "Requests' max_tokens", token_buckets)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens of finished requests")
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason",
                                       [*names, "finished_reason"], registry=registry)
        rejections = Counter("vllm:admission_rejections", "Requests refused by a full waiting queue, by reason",
                             ["model_name", "reason"], registry=registry)
        self.admission_rejections = {reason: rejections.labels(model_name, reason)
                                     for reason in ("max_num_queued_reqs", "max_num_queued_tokens")}
        registry.register(_StatsCollector(stats_source, self.labels, cache_config))

    def observe_params(self, n: int, max_tokens: Optional[int]) -> None:
        self.params_n.observe(n)
        if max_tokens is not None:
            self.params_max_tokens.observe(max_tokens)

    def observe_finished(self, reason: str, num_prompt_tokens: int, num_generated_tokens: int, metrics) -> None:
        """One finished request (all its samples): `metrics` its RequestMetrics."""
        self.request_success.labels(*self.labels, reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generated_tokens)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generated_tokens)
        self.num_preemptions.observe(metrics.num_preemptions)
        arrival, scheduled = metrics.arrival_time, metrics.first_scheduled_time
        first_token, finished = metrics.first_token_time, metrics.finished_time
        if finished is not None:
            self.e2e_latency.observe(finished - arrival)
        if scheduled is not None:
            self.queue_time.observe(scheduled - arrival)
            if finished is not None:
                self.inference_time.observe(finished - scheduled)
            if first_token is not None:
                self.prefill_time.observe(first_token - scheduled)
        if first_token is not None and finished is not None:
            self.decode_time.observe(finished - first_token)
            if num_generated_tokens > 1:
                self.time_per_output_token.observe((finished - first_token) / (num_generated_tokens - 1))


class _StatsCollector:
    def __init__(self, stats_source, labels: tuple[str, str], cache_config: dict):
        self.stats_source = stats_source
        self.labels = list(labels)
        self.cache_config = {name: str(value) for name, value in cache_config.items()}

    def collect(self):
        stats, names = self.stats_source(), ["model_name", "engine"]

        def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, documentation, labels=names)
            family.add_metric(self.labels, value)
            return family

        def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, documentation, labels=names)
            family.add_metric(self.labels, value)
            return family

        total, free = stats["num_device_blocks"], stats["num_free_device_blocks"]
        yield gauge("vllm:num_requests_running", "Requests running", stats["num_running"])
        yield gauge("vllm:num_requests_waiting", "Requests waiting (preempted ones included)",
                    stats["num_waiting"] + stats["num_swapped"])
        waiting = GaugeMetricFamily("vllm:num_requests_waiting_by_reason",
                                    "Waiting requests by reason: capacity (for room in the batch or the KV cache), "
                                    "deferred (none here: no transient constraint holds a request back)",
                                    labels=[*names, "reason"])
        waiting.add_metric([*self.labels, "capacity"], stats["num_waiting"] + stats["num_swapped"])
        waiting.add_metric([*self.labels, "deferred"], 0)
        yield waiting
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full", (total - free) / max(total, 1))
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                      stats.get("prefix_cache_queried_tokens", 0))
        yield counter("vllm:prefix_cache_hits", "Prompt tokens the prefix cache served",
                      stats.get("prefix_cache_hit_tokens", 0))
        yield counter("vllm:num_preemptions", "Preemptions",
                      stats["num_preemptions_swap"] + stats["num_preemptions_recompute"])
        steps = stats.get("iteration_tokens")
        if steps is not None:
            family = HistogramMetricFamily("vllm:iteration_tokens_total", "Tokens per engine step (prompt tokens "
                                           "computed and tokens sampled)", labels=names)
            family.add_metric(self.labels, [(floatToGoString(bound), count) for bound, count in steps["buckets"]],
                              steps["sum"])
            yield family
        info = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's configuration", labels=list(self.cache_config))
        info.add_metric(list(self.cache_config.values()), 1)
        yield info
