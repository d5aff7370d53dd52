"""Prometheus exposition of the cluster probe (``GET /realtime/metrics``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["render"]

_GAUGES = {
    "connections": "Open WebSocket connections",
    "subscriptions": "Channel subscriptions of local connections",
    "tickers": "Tickers this process runs",
    "uptime_s": "Seconds since the process's hub started",
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


class _ProbeCollector:
    def __init__(self, probe: dict[str, Any]) -> None:
        self.probe = probe

    def collect(self) -> Iterator[Metric]:
        instances = self.probe["instances"]
        labels = ["instance", "host", "pid"]

        def label(p: dict[str, Any]) -> list[str]:
            return [str(p.get("instance", "")), str(p.get("host", "")), str(p.get("pid", ""))]

        for name, doc in _GAUGES.items():
            gauge = GaugeMetricFamily(f"realtime_{name}", doc, labels=labels)
            for p in instances:
                value = p.get(name)
                gauge.add_metric(label(p), len(value) if isinstance(value, list) else float(value or 0))
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
        live = GaugeMetricFamily("realtime_instances", "Live processes in the cluster view")
        live.add_metric([], float(len(instances)))
        yield live


def render(probe: dict[str, Any]) -> bytes:
    """The Prometheus text format of a cluster probe."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ProbeCollector(probe))
    return generate_latest(registry)
