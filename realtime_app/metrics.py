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
        for name, doc in _BP_GAUGES.items():
            gauge = GaugeMetricFamily(f"realtime_backpressure_{name}", doc, labels=labels)
            for p in instances:
                gauge.add_metric(label(p), float(p.get("backpressure", {}).get(name, 0)))
            yield gauge
        for name, doc in _BP_COUNTERS.items():
            counter = CounterMetricFamily(f"realtime_backpressure_{name}", doc, labels=labels)
            for p in instances:
                counter.add_metric(label(p), float(p.get("backpressure", {}).get(name, 0)))
            yield counter
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
        live = GaugeMetricFamily("realtime_instances", "Live processes in the cluster view")
        live.add_metric([], float(len(instances)))
        yield live


def _admission(instances: list[dict[str, Any]], labels: list[str], label: Any) -> Iterator[Metric]:
    for name, doc in _ADMISSION_GAUGES.items():
        gauge = GaugeMetricFamily(f"realtime_admission_{name}", doc, labels=labels)
        for p in instances:
            gauge.add_metric(label(p), float(p.get("admission", {}).get(name, 0)))
        yield gauge
    for name, doc in _ADMISSION_COUNTERS.items():
        counter = CounterMetricFamily(f"realtime_admission_{name}", doc, labels=labels)
        for p in instances:
            counter.add_metric(label(p), float(p.get("admission", {}).get(name, 0)))
        yield counter
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


def render(probe: dict[str, Any]) -> bytes:
    """The Prometheus text format of a cluster probe."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ProbeCollector(probe))
    return generate_latest(registry)
