"""Prometheus exposition of the cluster probe (``GET /realtime/metrics``).

Derived from the probe's schema (:mod:`~realtime_app.observability.schema`): every field
annotated :class:`Gauge` or :class:`Counter` becomes a metric, per process (labels
``instance``, ``host``, ``pid``), named ``realtime_<section>_<field>`` unless the schema
names it; the fields that are maps (refusals by reason, pools, stores, channels) are
labelled below, one function each.
"""

from __future__ import annotations

import functools
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

LABELS = ("instance", "host", "pid")
Order = tuple[int, ...]  # where each label, in the order written, is in a family's labels
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


@functools.cache
def exported(schema: type, section: str) -> dict[str, tuple[str, Gauge | Counter]]:
    """The fields of ``schema`` that are metrics: field -> (metric name, kind). Read once."""
    out: dict[str, tuple[str, Gauge | Counter]] = {}
    for name, (_, marks) in fields_of(schema).items():
        for mark in marks:
            if isinstance(mark, (Gauge, Counter)):
                out[name] = (mark.name or f"realtime_{section + '_' if section else ''}{name}", mark)
    return out


class Family:
    """One metric family as written: its samples' label values in ``labels``' order. What
    :func:`render` writes straight away, and :func:`render_with_client` hands to
    ``prometheus_client`` (the reference the text is held to)."""

    __slots__ = ("help", "kind", "labels", "name", "samples")

    def __init__(self, name: str, kind: str, help_text: str, labels: tuple[str, ...] = ()) -> None:
        self.name, self.kind, self.help, self.labels = name, kind, help_text, labels
        self.samples: list[tuple[tuple[str, ...], float]] = []

    def add(self, values: tuple[str, ...], value: float) -> None:
        self.samples.append((values, value))

    def text(self, out: list[str], labelled: dict[tuple[Any, ...], str]) -> None:
        """Append this family's lines to ``out``; ``labelled`` remembers each set of label
        names and values as written (one process's labels recur in every family)."""
        header, names, order = _layout(self.name, self.kind, self.help, self.labels)
        out.append(header)
        name = names[0]
        for values, value in self.samples:
            labels = labelled.get((self.labels, values))
            if labels is None:
                labels = labelled[self.labels, values] = (
                    "{" + ",".join(f'{n}="{_escape(values[i])}"' for n, i in zip(names[1:], order, strict=True)) + "}"
                    if order
                    else ""
                )
            out.append(f"{name}{labels} {_go_float(value)}\n")

    def client_family(self) -> Metric:
        kind = GaugeMetricFamily if self.kind == "gauge" else CounterMetricFamily
        family = kind(self.name, self.help, labels=list(self.labels))
        for values, value in self.samples:
            family.add_metric(list(values), value)
        return family


@functools.cache
def _layout(name: str, kind: str, help_text: str, labels: tuple[str, ...]) -> tuple[str, tuple[str, ...], Order]:
    """A family's HELP and TYPE lines, its sample name then its label names in the order
    prometheus_client writes them (sorted), and where each is in ``labels``."""
    sample = f"{name}_total" if kind == "counter" else name
    escaped = help_text.replace("\\", r"\\").replace("\n", r"\n")
    order = tuple(sorted(range(len(labels)), key=labels.__getitem__))
    header = f"# HELP {sample} {escaped}\n# TYPE {sample} {kind}\n"
    return header, (sample, *(labels[i] for i in order)), order


def _family(name: str, mark: Gauge | Counter, labels: tuple[str, ...]) -> Family:
    return Family(name, "gauge" if isinstance(mark, Gauge) else "counter", mark.help, labels)


def _value(value: Any) -> float:
    if isinstance(value, (list, dict)):
        return float(len(value))
    return float(value or 0)


def _label(p: dict[str, Any]) -> tuple[str, str, str]:
    return (str(p.get("instance", "")), str(p.get("host", "")), str(p.get("pid", "")))


def families(probe: dict[str, Any]) -> Iterator[Family]:
    """The probe's metric families, in the order they are written."""
    instances: list[dict[str, Any]] = probe["instances"]
    labelled = [(p, _label(p)) for p in instances]
    for section, schema in SECTIONS.items():
        for field, (name, mark) in exported(schema, section).items():
            metric = _family(name, mark, LABELS)
            for p, label in labelled:
                block = p.get(section, {}) if section else p
                metric.add(label, _value(block.get(field)))
            yield metric
    for section, (schema, key) in KEYED.items():
        for field, (name, mark) in exported(schema, section).items():
            metric = _family(name, mark, (*LABELS, key))
            for p, label in labelled:
                for item, block in sorted(p.get(section, {}).items()):
                    metric.add((*label, item), _value(block.get(field)))
            yield metric
    yield from _maps(instances)
    live = Family("realtime_instances", "gauge", "Live processes in the cluster view")
    live.add((), float(len(instances)))
    yield live


def _maps(instances: list[dict[str, Any]]) -> Iterator[Family]:
    """The fields that are maps: one labelled metric each."""
    refused = Family("realtime_refused", "counter", "Requests refused or narrowed by a limit", (*LABELS, "limit"))
    admission_refused = Family(
        "realtime_admission_refused", "counter", "Requests admission refused, by reason", (*LABELS, "reason")
    )
    shared = Family(
        "realtime_admission_shared_bucket", "gauge", "1 while users' buckets are shared through the backplane", LABELS
    )
    recoveries = Family(
        "realtime_history_recoveries",
        "counter",
        "Resumes answered, by result (served, failed, deferred: too many at once)",
        (*LABELS, "result"),
    )
    kept = Family(
        "realtime_history_kept", "gauge", "Publications a channel's history keeps, as last seen", (*LABELS, "channel")
    )
    pool_refused = Family(
        "realtime_http_pool_refused",
        "counter",
        "HTTP requests answered 503 or gone, by reason",
        (*LABELS, "pool", "reason"),
    )
    wait = Family(
        "realtime_http_pool_wait_ms", "gauge", "Wait before running, recent requests", (*LABELS, "pool", "quantile")
    )
    last = Family(
        "realtime_write_behind_last_flush_timestamp_seconds",
        "gauge",
        "When the last flush ended",
        (*LABELS, "store"),
    )
    for p in instances:
        label = _label(p)
        for limit, count in sorted(p.get("refused", {}).items()):
            refused.add((*label, limit), float(count))
        admission = p.get("admission", {})
        for reason, count in sorted(admission.get("refused", {}).items()):
            admission_refused.add((*label, reason), float(count))
        shared.add(label, 1.0 if admission.get("bucket") == "shared" else 0.0)
        history = p.get("history", {})
        for result, count in sorted(history.get("recoveries", {}).items()):
            recoveries.add((*label, result), float(count))
        for channel, seen in sorted(history.get("channels", {}).items()):
            kept.add((*label, channel), float(seen.get("kept", 0)))
        for name, pool in sorted(p.get("http_pools", {}).items()):
            for reason, count in sorted(pool.get("refused", {}).items()):
                pool_refused.add((*label, name, reason), float(count))
            for quantile in ("p50", "p99"):
                wait.add((*label, name, quantile), float(pool.get("wait_ms", {}).get(quantile, 0)))
        for store, probe in sorted(p.get("write_behind", {}).items()):
            last.add((*label, store), float((probe.get("last_flush") or {}).get("at", 0)))
    yield from (refused, admission_refused, shared, recoveries, kept, pool_refused, wait, last)


def metric_names() -> set[str]:
    """Every metric family this module renders (without ``_total``)."""
    names = {name for section, schema in SECTIONS.items() for name, _ in exported(schema, section).values()}
    names |= {name for section, (schema, _) in KEYED.items() for name, _ in exported(schema, section).values()}
    return names | {metric.name for metric in _maps([])} | {"realtime_instances"}


def render(probe: dict[str, Any]) -> bytes:
    """The Prometheus text format (0.0.4) of a cluster probe: what ``prometheus_client``'s
    ``generate_latest`` writes for these families, byte for byte (tested), written straight
    from the schema — no per-sample objects, no name validation (only our own names are
    written, valid by construction; label values are escaped)."""
    out: list[str] = []
    labelled: dict[tuple[Any, ...], str] = {}
    for family in families(probe):
        family.text(out, labelled)
    return "".join(out).encode()


class _ClientCollector:
    def __init__(self, probe: dict[str, Any]) -> None:
        self.probe = probe

    def collect(self) -> Iterator[Metric]:
        return (family.client_family() for family in families(self.probe))


def render_with_client(probe: dict[str, Any]) -> bytes:
    """The same text written by ``prometheus_client`` (the reference :func:`render` is tested against)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ClientCollector(probe))
    return generate_latest(registry)


def _escape(value: str) -> str:
    if "\\" not in value and "\n" not in value and '"' not in value:
        return value
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _go_float(value: float) -> str:
    """A sample value as Prometheus' Go code prints it (exponent past 1e6, ``+Inf``, ``NaN``)."""
    if value == 0:
        return "-0.0" if math.copysign(1.0, value) < 0 else "0.0"
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
