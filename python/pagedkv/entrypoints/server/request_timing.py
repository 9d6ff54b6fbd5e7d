"""A reply's per-request timing (vLLM's --enable-per-request-metrics), from its RequestMetrics."""

from __future__ import annotations

from pagedkv.outputs import RequestMetrics


def timing_metrics(metrics: RequestMetrics, num_generated: int) -> dict:
    """vLLM's fields, in milliseconds: time to first token (from the first schedule), decode time
    (first to last token), queue time (arrival to first schedule), mean inter-token latency (two
    tokens or more) and tokens per second (over scheduled to last token). A field whose
    timestamps are missing is left out."""
    queued, scheduled = metrics.arrival_time, metrics.first_scheduled_time
    first, last = metrics.first_token_time, metrics.finished_time
    fields = {}
    if scheduled is not None and first is not None:
        fields["time_to_first_token_ms"] = (first - scheduled) * 1000
    if first is not None and last is not None:
        fields["generation_time_ms"] = (last - first) * 1000
        if num_generated > 1:
            fields["mean_itl_ms"] = (last - first) / (num_generated - 1) * 1000
    if scheduled is not None:
        fields["queue_time_ms"] = (scheduled - queued) * 1000
        if last is not None and last > scheduled:
            fields["tokens_per_second"] = num_generated / (last - scheduled)
    return fields
