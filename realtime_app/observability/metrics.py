"""Prometheus exposition of the cluster probe (``GET /realtime/metrics``).

Derived from the probe's schema (:mod:`~realtime_app.observability.schema`): every field
annotated :class:`Gauge` or :class:`Counter` becomes a metric, per process (labels
``instance``, ``host``, ``pid``), named ``realtime_<section>_<field>`` unless the schema
names it; the fields that are maps (refusals by reason, pools, stores, channels) are
labelled below, one function each.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from realtime_app.observability.schema import (
    AdmissionProbe,
    BackplaneProbe,
    BackpressureProbe,
    Counter,
    Gauge,
    HistoryProbe,
    PoolProbe,
    ProcessProbe,
    StoreProbe,
    TemplateProbe,
    fields_of,
)

__all__ = ["metric_names", "render"]

LABELS = ["instance", "host", "pid"]
#: The probe's sections of one process, each a block of fields.
SECTIONS: dict[str, type] = {
    "": ProcessProbe,
    "backpressure": BackpressureProbe,
    "admission": AdmissionProbe,
    "history": HistoryProbe,
    "backplane": BackplaneProbe,
}
#: The probe's maps of blocks, by the label their keys become.
KEYED: dict[str, tuple[type, str]] = {
    "http_pools": (PoolProbe, "pool"),
    "write_behind": (StoreProbe, "store"),
    "templates": (TemplateProbe, "template"),
}


def exported(schema: type, section: str) -> dict[str, tuple[str, Gauge | Counter]]:
    """The fields of ``schema`` that are metrics: field -> (metric name, kind)."""
    out: dict[str, tuple[str, Gauge | Counter]] = {}
    for name, (_, marks) in fields_of(schema).items():
        for mark in marks:
            if isinstance(mark, (Gauge, Counter)):
                out[name] = (mark.name or f"realtime_{section + '_' if section else ''}{name}", mark)
    return out


def _family(name: str, mark: Gauge | Counter, labels: list[str]) -> Any:
    kind = GaugeMetricFamily if isinstance(mark, Gauge) else CounterMetricFamily
    return kind(name, mark.help, labels=labels)


def _value(value: Any) -> float:
    if isinstance(value, (list, dict)):
        return float(len(value))
    return float(value or 0)


def _label(p: dict[str, Any]) -> list[str]:
    return [str(p.get("instance", "")), str(p.get("host", "")), str(p.get("pid", ""))]


class _ProbeCollector:
    def __init__(self, probe: dict[str, Any]) -> None:
        self.probe = probe

    def collect(self) -> Iterator[Metric]:
        instances: list[dict[str, Any]] = self.probe["instances"]
        for section, schema in SECTIONS.items():
            for field, (name, mark) in exported(schema, section).items():
                metric = _family(name, mark, LABELS)
                for p in instances:
                    block = p.get(section, {}) if section else p
                    metric.add_metric(_label(p), _value(block.get(field)))
                yield metric
        for section, (schema, key) in KEYED.items():
            for field, (name, mark) in exported(schema, section).items():
                metric = _family(name, mark, [*LABELS, key])
                for p in instances:
                    for item, block in sorted(p.get(section, {}).items()):
                        metric.add_metric([*_label(p), item], _value(block.get(field)))
                yield metric
        yield from _maps(instances)
        live = GaugeMetricFamily("realtime_instances", "Live processes in the cluster view")
        live.add_metric([], float(len(instances)))
        yield live


def _maps(instances: list[dict[str, Any]]) -> Iterator[Metric]:
    """The fields that are maps: one labelled metric each."""
    refused = CounterMetricFamily(
        "realtime_refused", "Requests refused or narrowed by a limit", labels=[*LABELS, "limit"]
    )
    admission_refused = CounterMetricFamily(
        "realtime_admission_refused", "Requests admission refused, by reason", labels=[*LABELS, "reason"]
    )
    shared = GaugeMetricFamily(
        "realtime_admission_shared_bucket", "1 while users' buckets are shared through the backplane", labels=LABELS
    )
    recoveries = CounterMetricFamily(
        "realtime_history_recoveries",
        "Resumes answered, by result (served, failed, deferred: too many at once)",
        labels=[*LABELS, "result"],
    )
    kept = GaugeMetricFamily(
        "realtime_history_kept", "Publications a channel's history keeps, as last seen", labels=[*LABELS, "channel"]
    )
    pool_refused = CounterMetricFamily(
        "realtime_http_pool_refused",
        "HTTP requests answered 503 or gone, by reason",
        labels=[*LABELS, "pool", "reason"],
    )
    wait = GaugeMetricFamily(
        "realtime_http_pool_wait_ms", "Wait before running, recent requests", labels=[*LABELS, "pool", "quantile"]
    )
    last = GaugeMetricFamily(
        "realtime_write_behind_last_flush_timestamp_seconds", "When the last flush ended", labels=[*LABELS, "store"]
    )
    for p in instances:
        label = _label(p)
        for limit, count in sorted(p.get("refused", {}).items()):
            refused.add_metric([*label, limit], float(count))
        admission = p.get("admission", {})
        for reason, count in sorted(admission.get("refused", {}).items()):
            admission_refused.add_metric([*label, reason], float(count))
        shared.add_metric(label, 1.0 if admission.get("bucket") == "shared" else 0.0)
        history = p.get("history", {})
        for result, count in sorted(history.get("recoveries", {}).items()):
            recoveries.add_metric([*label, result], float(count))
        for channel, seen in sorted(history.get("channels", {}).items()):
            kept.add_metric([*label, channel], float(seen.get("kept", 0)))
        for name, pool in sorted(p.get("http_pools", {}).items()):
            for reason, count in sorted(pool.get("refused", {}).items()):
                pool_refused.add_metric([*label, name, reason], float(count))
            for quantile in ("p50", "p99"):
                wait.add_metric([*label, name, quantile], float(pool.get("wait_ms", {}).get(quantile, 0)))
        for store, probe in sorted(p.get("write_behind", {}).items()):
            last.add_metric([*label, store], float((probe.get("last_flush") or {}).get("at", 0)))
    yield from (refused, admission_refused, shared, recoveries, kept, pool_refused, wait, last)


def metric_names() -> set[str]:
    """Every metric family this module renders (without ``_total``)."""
    names = {name for section, schema in SECTIONS.items() for name, _ in exported(schema, section).values()}
    names |= {name for section, (schema, _) in KEYED.items() for name, _ in exported(schema, section).values()}
    return names | {metric.name for metric in _maps([])} | {"realtime_instances"}


def render(probe: dict[str, Any]) -> bytes:
    """The Prometheus text format (0.0.4) of a cluster probe: what ``prometheus_client``'s
    ``generate_latest`` writes for these families, byte for byte (tested), without its
    per-sample name validation, which was most of a read's cost. Only our own names are
    written (valid by construction); label values are escaped."""
    out: list[str] = []
    for metric in _ProbeCollector(probe).collect():
        name = f"{metric.name}_total" if metric.type == "counter" else metric.name
        help_text = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {name} {help_text}\n# TYPE {name} {metric.type}\n")
        for sample in metric.samples:
            if sample.labels:
                labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(sample.labels.items()))
                out.append(f"{sample.name}{{{labels}}} {_go_float(sample.value)}\n")
            else:
                out.append(f"{sample.name} {_go_float(sample.value)}\n")
    return "".join(out).encode()


def render_with_client(probe: dict[str, Any]) -> bytes:
    """The same text written by ``prometheus_client`` (the reference :func:`render` is tested against)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ProbeCollector(probe))
    return generate_latest(registry)


def _escape(value: str) -> str:
    if "\\" not in value and "\n" not in value and '"' not in value:
        return value
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _go_float(value: float) -> str:
    """A sample value as Prometheus' Go code prints it (exponent past 1e6, ``+Inf``, ``NaN``)."""
    if value == math.inf:
        return "+Inf"
    if value == -math.inf:
        return "-Inf"
    if math.isnan(value):
        return "NaN"
    text = repr(float(value))
    dot = text.find(".")
    if value > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return text
