"""The probe has one schema (realtime_app.observability.schema): the hub produces exactly
its fields, Prometheus exports every field the schema marks, and what the admin screen
and ``realtime_probe`` read exists in it. A field added in one place only fails here."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any, get_origin

import pytest

from realtime_app.observability import metrics
from realtime_app.observability.schema import Counter, Gauge, ProcessProbe, Shown, fields_of

ROOT = Path(__file__).resolve().parent.parent
#: The blocks Prometheus reads field by field (metrics.SECTIONS and metrics.KEYED).
METRIC_BLOCKS = {
    "",
    ".backpressure",
    ".admission",
    ".history",
    ".backplane",
    ".http_pools[]",
    ".write_behind[]",
    ".templates[]",
}


def is_block(kind: Any) -> bool:
    return typing.is_typeddict(kind)


def blocks(schema: type, path: str = "") -> dict[str, type]:
    """Every TypedDict reachable from ``schema``, by path (``dict[str, X]`` values too)."""
    out = {path: schema}
    for name, (kind, _) in fields_of(schema).items():
        if is_block(kind):
            out.update(blocks(kind, f"{path}.{name}"))
        elif get_origin(kind) is dict and is_block(typing.get_args(kind)[1]):
            out.update(blocks(typing.get_args(kind)[1], f"{path}.{name}[]"))
        elif get_origin(kind) is list and is_block(typing.get_args(kind)[0]):
            out.update(blocks(typing.get_args(kind)[0], f"{path}.{name}[]"))
    return out


def all_field_names() -> set[str]:
    return {name for schema in blocks(ProcessProbe).values() for name in fields_of(schema)}


def check_against(value: dict[str, Any], schema: type, path: str = "probe") -> None:
    """``value`` has exactly the fields of ``schema``, recursively."""
    fields = fields_of(schema)
    required = {n for n in fields if n in getattr(schema, "__required_keys__", fields)}
    assert required <= set(value) <= set(fields), f"{path}: {sorted(set(value) ^ set(fields))}"
    for name, (kind, _) in fields.items():
        if name not in value:
            continue
        if is_block(kind) and value[name] is not None:
            check_against(value[name], kind, f"{path}.{name}")
        elif get_origin(kind) is dict and is_block(typing.get_args(kind)[1]):
            for key, item in value[name].items():
                check_against(item, typing.get_args(kind)[1], f"{path}.{name}[{key}]")
        elif get_origin(kind) is list and is_block(typing.get_args(kind)[0]):
            for index, item in enumerate(value[name]):
                check_against(item, typing.get_args(kind)[0], f"{path}.{name}[{index}]")


async def test_the_hub_produces_exactly_the_schema(hub) -> None:
    from tests.support.asgi_client import Client

    async with Client() as c:  # a connection, so that top_connections has one to check
        await c.call("subscribe", {"channel": "demo:clock"})
        probe = hub.probe()
    assert probe["http_pools"], "the test settings declare HTTP pools: each is checked"
    assert probe["top_connections"], "a connection is listed: its fields are checked"
    check_against(dict(probe), ProcessProbe)


def test_a_store_probe_has_exactly_the_schema() -> None:
    from django.contrib.auth import get_user_model

    from realtime_app.observability.schema import StoreProbe
    from realtime_app.persistence.write_behind import WriteBehindStore

    store = WriteBehindStore(get_user_model(), key=("username",), fields=("first_name",), name="schema-test")
    try:
        check_against(dict(store.probe()), StoreProbe)
    finally:
        store.close()


def test_the_check_fails_on_a_field_in_one_place_only() -> None:
    from realtime_app.observability.schema import BackplaneProbe

    with pytest.raises(AssertionError):
        check_against({"up": True, "outages": 0, "lag_ms": 3}, BackplaneProbe)  # not in the schema
    with pytest.raises(AssertionError):
        check_against({"up": True}, BackplaneProbe)  # in the schema, not produced


@pytest.mark.parametrize("path", sorted(blocks(ProcessProbe)))
def test_every_field_is_a_metric_or_says_why_not(path: str) -> None:
    """A new field must decide: a Gauge, a Counter, or Shown (with the reason)."""
    for name, (kind, marks) in fields_of(blocks(ProcessProbe)[path]).items():
        decided = any(isinstance(m, (Gauge, Counter, Shown)) for m in marks)
        nested = is_block(kind) or (get_origin(kind) is dict and is_block(typing.get_args(kind)[1]))
        if path in METRIC_BLOCKS and not nested:
            assert decided, f"{path}.{name}: Gauge, Counter or Shown?"


async def test_prometheus_renders_every_metric_the_schema_marks(hub) -> None:
    from realtime_app.observability.probes import cluster_probe

    text = metrics.render(await cluster_probe()).decode()
    families = {name.removesuffix("_total") for name in re.findall(r"^# TYPE (\S+) ", text, re.M)}
    assert metrics.metric_names() <= families
    marked = {
        mark.name or f"realtime_{section + '_' if section else ''}{name}"
        for section, schema in metrics.SECTIONS.items()
        for name, (_, marks) in fields_of(schema).items()
        for mark in marks
        if isinstance(mark, (Gauge, Counter))
    }
    assert marked <= families


def test_what_the_admin_screen_reads_is_in_the_schema() -> None:
    script = (ROOT / "realtime_app/static/realtime_app/admin_cluster.js").read_text()
    read = set(re.findall(r"\.([a-z]+(?:_[a-z0-9]+)+)\b", script))
    assert read, "the pattern finds the screen's snake_case fields"
    assert read <= all_field_names() | {"generated_at"}, sorted(read - all_field_names())


def test_what_realtime_probe_reads_is_in_the_schema() -> None:
    source = (ROOT / "realtime_app/management/commands/realtime_probe.py").read_text()
    read = set(re.findall(r"""(?:get\(|\[)["']([a-z_]+)["']""", source))
    assert read
    known = all_field_names() | {"served", "failed", "instances", "totals", "clustered", "complete", "stale"}
    known |= {"json", "watch"}  # the command's own options
    assert read <= known, sorted(read - known)


async def test_the_prometheus_text_is_prometheus_clients_byte_for_byte(hub) -> None:
    """render writes the text itself (prometheus_client's validation per sample was most
    of a read's CPU): the same bytes, for label values that need escaping and values
    that Go prints with an exponent."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from realtime_app.observability.probes import cluster_probe

    base = await cluster_probe()
    labels = st.text(min_size=1, max_size=12)
    values = st.one_of(
        st.integers(min_value=0, max_value=10**12),
        st.floats(allow_nan=True, allow_infinity=True),
    )

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(host=labels, channels=st.dictionaries(labels, values, max_size=4), refused=st.dictionaries(labels, values))
    def same(host: str, channels: dict[str, float], refused: dict[str, float]) -> None:
        instance = {**base["instances"][0], "host": host, "refused": refused, "published": channels.get("", 7)}
        instance["history"] = {**instance["history"], "channels": {c: {"kept": v} for c, v in channels.items()}}
        probe = {**base, "instances": [instance, {**instance, "instance": 'other\n"\\'}]}
        assert metrics.render(probe) == metrics.render_with_client(probe)

    same()
    # Found in review: families whose last label differs by name only (pool, store, template,
    # reason, result) shared one remembered label text when their keys were the same word.
    instance = dict(base["instances"][0])
    instance["write_behind"] = {"default": {"flushes": 2}}
    instance["http_pools"] = {"default": {"refused": {"default": 1}, "wait_ms": {"p50": 1, "p99": 2}}}
    instance["templates"] = {"default": {}}
    instance["admission"] = {**instance["admission"], "refused": {"default": 3}}
    instance["history"] = {**instance["history"], "recoveries": {"default": 4}}
    probe = {**base, "instances": [instance]}
    text = metrics.render(probe)
    assert text == metrics.render_with_client(probe)
    assert b'store="default"} 2.0' in text and b'reason="default"} 3.0' in text


async def test_the_admin_screen_is_told_each_channels_cadence_not_a_trailing_number(hub) -> None:
    """Found: the screen read ``order:1`` as a cadence of 1 ms (a trailing number of a
    template's instance); the probe now says the cadence the registry resolves."""
    from realtime_app.hub.probe import process_probe
    from tests.support.asgi_client import Client

    async with Client() as client:
        for name in ("test:bids:7", "test:lot:3:250", "test:lot:4", "demo:clock"):
            assert "result" in await client.call("subscribe", {"channel": name}), name
        cadences = process_probe(hub)["channel_cadences"]
    assert cadences == {"test:bids:7": None, "test:lot:3:250": 250, "test:lot:4": 1000, "demo:clock": 1000}
    script = (ROOT / "realtime_app/static/realtime_app/admin_cluster.js").read_text()
    assert "channel_cadences" in script and r"/:(\d+)$/" not in script
