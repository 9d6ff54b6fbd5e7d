"""Prometheus metrics of the server: KV pool gauges, scheduler counters (read from the engine
loop's stats snapshot at scrape time), latency histograms and finished requests by reason."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    def __init__(self, stats_source):
        """`stats_source()` returns the latest engine stats dict."""
        self.registry = CollectorRegistry()
        self.time_to_first_token = Histogram(
            "pagedkv_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=self.registry
        )
        self.inter_token_latency = Histogram(
            "pagedkv_inter_token_latency_seconds", "Time between tokens", buckets=_LATENCY_BUCKETS, registry=self.registry
        )
        self.requests_finished = Counter(
            "pagedkv_requests_finished", "Finished requests by finish reason", ["finish_reason"], registry=self.registry
        )
        self.registry.register(_EngineCollector(stats_source))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, stats_source):
        self.stats_source = stats_source

    def collect(self):
        stats = self.stats_source()
        for device, total_key, free_key in (
            ("device", "num_device_blocks", "num_free_device_blocks"),
            ("cpu", "num_cpu_blocks", "num_free_cpu_blocks"),
        ):
            total, free = stats[total_key], stats[free_key]
            yield _gauge(f"pagedkv_kv_blocks_total_{device}", f"{device} KV blocks in the pool", total)
            yield _gauge(f"pagedkv_kv_blocks_used_{device}", f"{device} KV blocks in use", total - free)
            yield _gauge(f"pagedkv_kv_usage_percent_{device}", f"{device} KV usage %", 100.0 * (total - free) / max(total, 1))
        yield _gauge("pagedkv_kv_blocks_cached_device", "free device blocks holding a cached prefix", stats["num_cached_device_blocks"])
        yield _gauge("pagedkv_requests_running", "running requests", stats["num_running"])
        yield _gauge("pagedkv_requests_waiting", "waiting requests", stats["num_waiting"])
        yield _gauge("pagedkv_requests_swapped", "swapped-out requests", stats["num_swapped"])
        preemptions = CounterMetricFamily("pagedkv_preemptions", "Preemptions by kind", labels=["kind"])
        preemptions.add_metric(["swap"], stats["num_preemptions_swap"])
        preemptions.add_metric(["recompute"], stats["num_preemptions_recompute"])
        yield preemptions
        swapped = CounterMetricFamily("pagedkv_blocks_swapped", "Blocks swapped by direction", labels=["direction"])
        swapped.add_metric(["in"], stats["num_blocks_swapped_in"])
        swapped.add_metric(["out"], stats["num_blocks_swapped_out"])
        yield swapped
        yield _gauge("pagedkv_prefix_cache_hit_rate", "prefix cache hit rate (blocks)", stats["prefix_cache_hit_rate"])


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
