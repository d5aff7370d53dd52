"""Prometheus exposition of the cluster probe (``GET /realtime/metrics``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["render"]

_GAUGES = {  # metric name: (probe field, help)
    "connections": ("connections", "Open WebSocket connections"),
    "subscriptions": ("subscriptions", "Channel subscriptions of local connections"),
    "channels": ("channel_count", "Channels with local subscribers"),
    "tickers": ("ticker_count", "Tickers this process runs"),
    "failing_tickers": ("failing_tickers", "Tickers whose factory, tick or publication fails now"),
    "uptime_s": ("uptime_s", "Seconds since the process started"),
}
_BP_GAUGES = {
    "max_buffered_amount": "Bytes queued for the worst connection",
    "max_drop_balance": "Highest drop balance of a connection",
    "total_buffered_amount": "Bytes queued for all connections",
    "slow_consumers": "Connections at or above SLOW_CONSUMER_BYTES queued",
}
_BP_COUNTERS = {
    "drops": "Frames dropped by transport backpressure",
    "closes": "Connections closed with 1013 by transport backpressure",
}


_ADMISSION_GAUGES = {
    "pending": "Admitted requests queued or running",
    "queued": "Admitted requests waiting for the pool",
    "running": "Requests running in the pool",
    "identities": "Identities (users, anonymous connections) admission tracks",
}
_ADMISSION_COUNTERS = {
    "admitted": "Requests admitted",
    "completed": "Admitted requests answered, failed or cancelled",
    "coalesced": "Requests merged into a waiting one",
    "abandoned": "Waiting requests dropped because their connection closed",
    "closed_for_refusals": "Connections closed with 1008 for ignoring their refusals",
}


class _ProbeCollector:
    def __init__(self, probe: dict[str, Any]) -> None:
        self.probe = probe

    def collect(self) -> Iterator[Metric]:
        instances = self.probe["instances"]
        labels = ["instance", "host", "pid"]

        def label(p: dict[str, Any]) -> list[str]:
            return [str(p.get("instance", "")), str(p.get("host", "")), str(p.get("pid", ""))]

        for name, (key, doc) in _GAUGES.items():
            gauge = GaugeMetricFamily(f"realtime_{name}", doc, labels=labels)
            for p in instances:
                value = p.get(key) or 0
                gauge.add_metric(label(p), float(len(value) if isinstance(value, list) else value))
            yield gauge
        published = CounterMetricFamily("realtime_published", "Publications sent by this process", labels=labels)
        for p in instances:
            published.add_metric(label(p), float(p.get("published", 0)))
        yield published
        yield from _section(instances, labels, label, "backpressure", _BP_GAUGES, GaugeMetricFamily)
        yield from _section(instances, labels, label, "backpressure", _BP_COUNTERS, CounterMetricFamily)
        failures = CounterMetricFamily(
            "realtime_send_failures", "Connections closed with 1011 because a send raised", labels=labels
        )
        up = GaugeMetricFamily("realtime_backplane_up", "1 while the backplane answers", labels=labels)
        outages = CounterMetricFamily(
            "realtime_backplane_outages", "Times the backplane stopped answering", labels=labels
        )
        refused = CounterMetricFamily(
            "realtime_refused", "Requests refused or narrowed by a limit", labels=[*labels, "limit"]
        )
        for p in instances:
            failures.add_metric(label(p), float(p.get("send_failures", 0)))
            backplane = p.get("backplane", {})
            up.add_metric(label(p), 1.0 if backplane.get("up", True) else 0.0)
            outages.add_metric(label(p), float(backplane.get("outages", 0)))
            for limit, count in sorted(p.get("refused", {}).items()):
                refused.add_metric([*label(p), limit], float(count))
        yield from (failures, up, outages, refused)
        yield from _admission(instances, labels, label)
        yield from _http_pools(instances, labels, label)
        yield from _write_behind(instances, labels, label)
        yield from _history(instances, labels, label)
        live = GaugeMetricFamily("realtime_instances", "Live processes in the cluster view")
        live.add_metric([], float(len(instances)))
        yield live


def _section(
    instances: list[dict[str, Any]],
    labels: list[str],
    label: Any,
    section: str,
    fields: dict[str, str],
    family: type[GaugeMetricFamily] | type[CounterMetricFamily],
) -> Iterator[Metric]:
    """One metric ``realtime_<section>_<field>`` per field of a probe block, per process."""
    for name, doc in fields.items():
        metric = family(f"realtime_{section}_{name}", doc, labels=labels)
        for p in instances:
            metric.add_metric(label(p), float(p.get(section, {}).get(name, 0)))
        yield metric


def _admission(instances: list[dict[str, Any]], labels: list[str], label: Any) -> Iterator[Metric]:
    yield from _section(instances, labels, label, "admission", _ADMISSION_GAUGES, GaugeMetricFamily)
    yield from _section(instances, labels, label, "admission", _ADMISSION_COUNTERS, CounterMetricFamily)
    refused = CounterMetricFamily(
        "realtime_admission_refused", "Requests admission refused, by reason", labels=[*labels, "reason"]
    )
    shared = GaugeMetricFamily(
        "realtime_admission_shared_bucket", "1 while users' buckets are shared through the backplane", labels=labels
    )
    for p in instances:
        admission = p.get("admission", {})
        for reason, count in sorted(admission.get("refused", {}).items()):
            refused.add_metric([*label(p), reason], float(count))
        shared.add_metric(label(p), 1.0 if admission.get("bucket") == "shared" else 0.0)
    yield refused
    yield shared


def _http_pools(instances: list[dict[str, Any]], labels: list[str], label: Any) -> Iterator[Metric]:
    with_pool = [*labels, "pool"]
    running = GaugeMetricFamily("realtime_http_pool_running", "HTTP requests running in the pool", labels=with_pool)
    waiting = GaugeMetricFamily("realtime_http_pool_waiting", "HTTP requests waiting for the pool", labels=with_pool)
    admitted = CounterMetricFamily("realtime_http_pool_admitted", "HTTP requests the pool ran", labels=with_pool)
    refused = CounterMetricFamily(
        "realtime_http_pool_refused", "HTTP requests answered 503 or gone, by reason", labels=[*with_pool, "reason"]
    )
    wait = GaugeMetricFamily(
        "realtime_http_pool_wait_ms", "Wait before running, recent requests", labels=[*with_pool, "quantile"]
    )
    for p in instances:
        for name, pool in sorted(p.get("http_pools", {}).items()):
            key = [*label(p), name]
            running.add_metric(key, float(pool["running"]))
            waiting.add_metric(key, float(pool["waiting"]))
            admitted.add_metric(key, float(pool["admitted"]))
            for reason, count in sorted(pool["refused"].items()):
                refused.add_metric([*key, reason], float(count))
            for quantile in ("p50", "p99"):
                wait.add_metric([*key, quantile], float(pool["wait_ms"][quantile]))
    yield from (running, waiting, admitted, refused, wait)


def _write_behind(instances: list[dict[str, Any]], labels: list[str], label: Any) -> Iterator[Metric]:
    with_store = [*labels, "store"]
    gauges = {
        "dirty": ("realtime_write_behind_dirty", "Objects with a change not yet written"),
        "oldest_unsaved_s": ("realtime_write_behind_oldest_unsaved_seconds", "Age of the oldest unsaved change"),
        "consecutive_failures": ("realtime_write_behind_consecutive_failures", "Flushes failed in a row"),
    }
    counters = {
        "flushed_rows": ("realtime_write_behind_flushed_rows", "Objects written"),
        "flushed_deletes": ("realtime_write_behind_flushed_deletes", "Objects deleted"),
        "retries": ("realtime_write_behind_retries", "Batches retried after a transient error"),
        "flushes": ("realtime_write_behind_flushes", "Flushes run"),
    }
    families: list[Any] = []
    kinds: tuple[tuple[dict[str, tuple[str, str]], Any], ...] = (
        (gauges, GaugeMetricFamily),
        (counters, CounterMetricFamily),
    )
    for fields, family in kinds:
        for key, (name, doc) in fields.items():
            metric = family(name, doc, labels=with_store)
            for p in instances:
                for store, probe in sorted(p.get("write_behind", {}).items()):
                    metric.add_metric([*label(p), store], float(probe.get(key, 0)))
            families.append(metric)
    last = GaugeMetricFamily(
        "realtime_write_behind_last_flush_timestamp_seconds", "When the last flush ended", labels=with_store
    )
    for p in instances:
        for store, probe in sorted(p.get("write_behind", {}).items()):
            flush = probe.get("last_flush") or {}
            last.add_metric([*label(p), store], float(flush.get("at", 0)))
    families.append(last)
    yield from families


_HISTORY_COUNTERS = {
    "replayed": "Publications sent again from a history",
    "gaps": "Publications with history that never reached this process",
}


def _history(instances: list[dict[str, Any]], labels: list[str], label: Any) -> Iterator[Metric]:
    recoveries = CounterMetricFamily(
        "realtime_history_recoveries",
        "Resumes answered, by result (served, failed, deferred: too many at once)",
        labels=[*labels, "result"],
    )
    kept = GaugeMetricFamily(
        "realtime_history_kept", "Publications a channel's history keeps, as last seen", labels=[*labels, "channel"]
    )
    for p in instances:
        history = p.get("history", {})
        for result, count in sorted(history.get("recoveries", {}).items()):
            recoveries.add_metric([*label(p), result], float(count))
        for channel, seen in sorted(history.get("channels", {}).items()):
            kept.add_metric([*label(p), channel], float(seen.get("kept", 0)))
    yield from (recoveries, kept)
    yield from _section(instances, labels, label, "history", _HISTORY_COUNTERS, CounterMetricFamily)


def render(probe: dict[str, Any]) -> bytes:
    """The Prometheus text format of a cluster probe."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ProbeCollector(probe))
    return generate_latest(registry)
