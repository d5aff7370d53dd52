"""The probe, as one typed schema: what every process reports, field by field.

The hub produces :class:`ProcessProbe`; ``GET /realtime/probe``, the health channel and
``realtime_probe`` carry it as it is; Prometheus (:mod:`~realtime_app.observability.metrics`)
and the admin screen read it. Each numeric field is annotated with how Prometheus shows
it (:class:`Gauge` or :class:`Counter`, or :class:`Shown` with the reason), and
``tests/test_probe_schema.py`` fails when a field is added in one place only: the hub's
probe, this schema, the metrics, or the admin screen.
"""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass
from typing import Annotated, Any, NotRequired, TypedDict

__all__ = [
    "AdmissionProbe",
    "BackplaneProbe",
    "BackpressureProbe",
    "ClusterProbe",
    "ConnectionProbe",
    "Counter",
    "Gauge",
    "HistoryProbe",
    "PoolProbe",
    "ProcessProbe",
    "Shown",
    "StoreProbe",
    "fields_of",
]


@dataclass(frozen=True, slots=True)
class Gauge:
    """A value that goes up and down: ``realtime_<section>_<field>``, or ``name``."""

    help: str
    name: str = ""


@dataclass(frozen=True, slots=True)
class Counter:
    """A count that only grows while the process lives."""

    help: str
    name: str = ""


@dataclass(frozen=True, slots=True)
class Shown:
    """A field Prometheus does not carry as such (text, a list, or shown by another metric)."""

    why: str


class BackpressureProbe(TypedDict):
    max_buffered_amount: Annotated[int, Gauge("Bytes queued for the worst connection")]
    max_drop_balance: Annotated[int, Gauge("Highest drop balance of a connection")]
    total_buffered_amount: Annotated[int, Gauge("Bytes queued for all connections")]
    slow_consumers: Annotated[int, Gauge("Connections at or above SLOW_CONSUMER_BYTES queued")]
    drops: Annotated[int, Counter("Frames dropped by transport backpressure")]
    closes: Annotated[int, Counter("Connections closed with 1013 by transport backpressure")]
    conflated: Annotated[int, Counter("Frames of conflated channels replaced by a newer one before they were sent")]
    holding: Annotated[int, Gauge("Connections holding conflated frames until their queue drains")]


class AdmissionProbe(TypedDict):
    pending: Annotated[int, Gauge("Admitted requests queued or running")]
    queued: Annotated[int, Gauge("Admitted requests waiting for the pool")]
    running: Annotated[int, Gauge("Requests running in the pool")]
    admitted: Annotated[int, Counter("Requests admitted")]
    completed: Annotated[int, Counter("Admitted requests answered, failed or cancelled")]
    coalesced: Annotated[int, Counter("Requests merged into a waiting one")]
    abandoned: Annotated[int, Counter("Waiting requests dropped because their connection closed")]
    refused: Annotated[dict[str, int], Shown("realtime_admission_refused{reason}")]
    identities: Annotated[int, Gauge("Identities (users, anonymous connections) admission tracks")]
    bucket: Annotated[str, Shown("realtime_admission_shared_bucket (1 while shared)")]
    closed_for_refusals: Annotated[int, Counter("Connections closed with 1008 for ignoring their refusals")]
    reconnect_tickets: Annotated[
        int, Counter("Anonymous handshakes let past the process's bucket by a draining process's ticket")
    ]
    once_ran: Annotated[int, Counter("Idempotent calls run the first time for their key")]
    once_repeats: Annotated[int, Counter("Repeats of idempotent calls answered with the first answer")]
    once_waited: Annotated[int, Counter("Repeats that waited for their first call to answer")]
    once_not_kept: Annotated[int, Counter("Idempotent answers too large to keep for repeats")]
    once_refused_full: Annotated[
        int, Counter("New idempotency keys refused: their identity's kept answers filled its bytes")
    ]
    once_kept_bytes: Annotated[int, Gauge("Bytes of idempotent answers kept through this process, all identities")]


class HistoryChannel(TypedDict):
    epoch: str
    kept: int


class HistoryProbe(TypedDict):
    channels: Annotated[dict[str, HistoryChannel], Shown("realtime_history_kept{channel}")]
    recoveries: Annotated[dict[str, int], Shown("realtime_history_recoveries{result}")]
    replayed: Annotated[int, Counter("Publications sent again from a history")]
    gaps: Annotated[int, Counter("Publications with history that never reached this process")]


class ShardProbe(TypedDict):
    """One Redis server of a sharded backplane (``backplane.shards``)."""

    index: int
    address: str  # host:port/db, or the Sentinel service name: never a password
    up: bool
    outages: int


class BackplaneProbe(TypedDict):
    up: Annotated[bool, Gauge("1 while the backplane answers (every shard)", "realtime_backplane_up")]
    outages: Annotated[int, Counter("Times the backplane stopped answering", "realtime_backplane_outages")]
    shards: Annotated[list[ShardProbe], Shown("per Redis server: up, outages (docs/capacity.md)")]


class PoolWait(TypedDict):
    p50: float
    p99: float


class PoolProbe(TypedDict):
    """One HTTP concurrency pool (``http_pools``, by pool name)."""

    max_concurrent: Annotated[int, Shown("a setting")]
    max_waiting: Annotated[int, Shown("a setting")]
    running: Annotated[int, Gauge("HTTP requests running in the pool", "realtime_http_pool_running")]
    waiting: Annotated[int, Gauge("HTTP requests waiting for the pool", "realtime_http_pool_waiting")]
    admitted: Annotated[int, Counter("HTTP requests the pool ran", "realtime_http_pool_admitted")]
    refused: Annotated[dict[str, int], Shown("realtime_http_pool_refused{reason}")]
    wait_ms: Annotated[PoolWait, Shown("realtime_http_pool_wait_ms{quantile}")]


class TemplateProbe(TypedDict):
    """One channel template (``templates``, by pattern): its instances in this process,
    summed — never a metric per instance; the busiest are named for the drill-down."""

    instances: Annotated[int, Gauge("Live instances of the template in this process", "realtime_template_instances")]
    subscribers: Annotated[int, Gauge("Subscriptions to the template's instances", "realtime_template_subscribers")]
    published: Annotated[
        int, Counter("Publications on the template's instances from this process", "realtime_template_published")
    ]
    busiest: Annotated[dict[str, int], Shown("subscribers of its busiest instances (the drill-down)")]


class StoreProbe(TypedDict):
    """One write-behind store (``write_behind``, by store name)."""

    objects: Annotated[int, Gauge("Objects the store holds in memory", "realtime_write_behind_objects")]
    dirty: Annotated[int, Gauge("Objects with a change not yet written", "realtime_write_behind_dirty")]
    oldest_unsaved_s: Annotated[
        float, Gauge("Age of the oldest unsaved change", "realtime_write_behind_oldest_unsaved_seconds")
    ]
    last_flush: Annotated[dict[str, Any] | None, Shown("realtime_write_behind_last_flush_timestamp_seconds")]
    consecutive_failures: Annotated[int, Gauge("Flushes failed in a row", "realtime_write_behind_consecutive_failures")]
    retries: Annotated[int, Counter("Batches retried after a transient error", "realtime_write_behind_retries")]
    flushes: Annotated[int, Counter("Flushes run", "realtime_write_behind_flushes")]
    flushed_rows: Annotated[int, Counter("Objects written", "realtime_write_behind_flushed_rows")]
    flushed_deletes: Annotated[int, Counter("Objects deleted", "realtime_write_behind_flushed_deletes")]
    failing: Annotated[dict[str, str], Shown("text: why the database refused the latest refused objects")]
    refused: Annotated[
        int, Counter("Objects whose unsaved changes the database refused", "realtime_write_behind_refused")
    ]
    in_doubt: Annotated[int, Gauge("Objects of batches whose commit is in doubt", "realtime_write_behind_in_doubt")]
    delay_s: Annotated[float, Gauge("Seconds until the next flush", "realtime_write_behind_delay_seconds")]
    evicted: Annotated[int, Counter("Clean objects evicted at max_objects", "realtime_write_behind_evicted")]
    journaled: Annotated[int, Counter("Objects journaled at a stop", "realtime_write_behind_journaled")]
    replayed: Annotated[int, Counter("Journaled objects written again", "realtime_write_behind_replayed")]


class ConnectionProbe(TypedDict):
    """One connection among the process's top ones by queued bytes and by drops
    (``top_connections``): what the admin screen's drill-down shows."""

    id: int  # the process's connection id (with the process's ``instance``: the cluster's)
    user: str | None  # the username, None when anonymous
    address: str | None  # the client's address (the forwarded one behind a trusted proxy)
    channels: list[str]  # its subscriptions by canonical name (a cadence is in the name), at most 20
    channel_count: int
    queued_bytes: int
    drops: int  # frames the guard dropped for it
    conflated: int  # frames of conflated channels replaced by a newer one before they were sent
    in_flight: int  # requests of its identity admitted and not answered yet
    age_s: float


class OutboxProbe(TypedDict):
    """The outbox of durable channels as this process's drain sees it (``outbox``)."""

    rows: Annotated[int, Gauge("Outbox rows waiting to be published, as last counted", "realtime_outbox_rows")]
    oldest_s: Annotated[float, Gauge("Age of the oldest outbox row", "realtime_outbox_oldest_seconds")]
    published: Annotated[int, Counter("Outbox rows published by this process", "realtime_outbox_published")]
    duplicates: Annotated[
        int, Counter("Outbox rows the backplane had published already (a drain repeated)", "realtime_outbox_duplicates")
    ]
    failures: Annotated[int, Counter("Outbox drain passes stopped by an error", "realtime_outbox_failures")]
    refused: Annotated[
        int, Counter("Durable publications refused: the outbox was full (OUTBOX_MAX_ROWS)", "realtime_outbox_refused")
    ]
    alarm: Annotated[str, Shown("why the outbox needs attention (too many rows, too old), or empty")]


class PresenceProbe(TypedDict):
    """Presence channels as this process keeps them (``presence``, docs/presence.md)."""

    channels: Annotated[int, Gauge("Presence channels with members or watchers here", "realtime_presence_channels")]
    connections: Annotated[
        int, Gauge("Local connections in presence channels (one per channel)", "realtime_presence_connections")
    ]
    watchers: Annotated[int, Gauge("Local subscribers of presence diffs", "realtime_presence_watchers")]
    changes: Annotated[int, Counter("Local joins and leaves of presence channels", "realtime_presence_changes")]
    diffs: Annotated[int, Counter("Presence frames handed to watchers", "realtime_presence_diffs")]
    coalesced: Annotated[
        int, Counter("Presence diffs merged into one held for a slow watcher", "realtime_presence_coalesced")
    ]
    writes: Annotated[int, Counter("Presence parts of this process written", "realtime_presence_writes")]
    reads: Annotated[int, Counter("Presence channels read from the backplane", "realtime_presence_reads")]
    failures: Annotated[int, Counter("Presence turns the backplane did not answer", "realtime_presence_failures")]
    members: Annotated[dict[str, int], Shown("members of the busiest presence channels")]


class ProcessProbe(TypedDict):
    """One process: ``GET /realtime/probe``'s ``instances[]``, a health-channel frame's."""

    instance: Annotated[str, Shown("the instance label")]
    host: Annotated[str, Shown("the host label")]
    pid: Annotated[int, Shown("the pid label")]
    uptime_s: Annotated[float, Gauge("Seconds since the process started", "realtime_uptime_s")]
    rss_bytes: Annotated[int, Gauge("Resident memory of the process", "realtime_process_resident_memory_bytes")]
    cpu_seconds: Annotated[float, Counter("CPU time of the process, user and system", "realtime_process_cpu_seconds")]
    connections: Annotated[int, Gauge("Open WebSocket connections", "realtime_connections")]
    subscriptions: Annotated[int, Gauge("Channel subscriptions of local connections", "realtime_subscriptions")]
    channels: Annotated[dict[str, int], Shown("subscribers of the busiest channels; see channel_count")]
    channel_count: Annotated[int, Gauge("Channels with local subscribers", "realtime_channels")]
    tickers: Annotated[list[str], Shown("names; see ticker_count")]
    ticker_count: Annotated[int, Gauge("Tickers this process runs", "realtime_tickers")]
    failing_tickers: Annotated[
        list[str], Gauge("Tickers whose factory, tick or publication fails now", "realtime_failing_tickers")
    ]
    published: Annotated[int, Counter("Publications sent by this process", "realtime_published")]
    frames_out: Annotated[int, Counter("Channel frames handed to this process's connections", "realtime_frames_out")]
    channel_frames: Annotated[dict[str, int], Shown("publications fanned out, per busiest channel")]
    channel_cadences: Annotated[
        dict[str, int | None], Shown("cadence (ms) of each busiest channel as the registry resolves it; null: none")
    ]
    top_connections: Annotated[list[ConnectionProbe], Shown("the drill-down: top connections by queue and drops")]
    refused: Annotated[dict[str, int], Shown("realtime_refused{limit}")]
    backplane_bytes: Annotated[
        int,
        Gauge(
            "Backplane state the identities' subscribes keep live through this process (bytes, about)",
            "realtime_backplane_identity_bytes",
        ),
    ]
    admission: AdmissionProbe
    history: HistoryProbe
    send_failures: Annotated[
        int, Counter("Connections closed with 1011 because a send raised", "realtime_send_failures")
    ]
    stale_ticks: Annotated[
        int, Counter("Ticks not published: the lease was not renewed in time", "realtime_stale_ticks")
    ]
    backplane: BackplaneProbe
    backpressure: BackpressureProbe
    http_pools: dict[str, PoolProbe]
    write_behind: dict[str, StoreProbe]
    templates: dict[str, TemplateProbe]
    outbox: OutboxProbe
    presence: PresenceProbe
    draining: Annotated[bool, Shown("the process stops: it accepts no connection, /realtime/ready answers 503")]


class ClusterProbe(TypedDict):
    """``GET /realtime/probe``: every live process, and the cluster's totals."""

    generated_at: int
    clustered: bool
    complete: bool  # False: the backplane did not answer, only this process is listed
    instances: list[ProcessProbe]
    totals: dict[str, Any]
    stale: NotRequired[bool]


@functools.cache
def fields_of(schema: type) -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """A TypedDict's fields: name -> (type without annotations, annotations); read once
    per schema (every metrics scrape asks), not to be changed."""
    hints = typing.get_type_hints(schema, include_extras=True)
    out: dict[str, tuple[Any, tuple[Any, ...]]] = {}
    for name, hint in hints.items():
        if typing.get_origin(hint) is Annotated:
            out[name] = (hint.__origin__, hint.__metadata__)
        else:
            out[name] = (hint, ())
    return out
