"""Settings: one ``REALTIME_APP`` dict, defaults here, merged lazily, reset on change.

Read inside functions, never at import time, so that ``override_settings`` works and pure
modules stay importable without Django. The package reads them one way,
:func:`realtime_app.conf.runtime.settings` (typed, frozen, built once by the process's
runtime, whose docstring states the reload rule); :func:`get_config` is the merged dict
the runtime builds them from and the system checks validate.
"""

from __future__ import annotations

from functools import cache
from typing import Any

__all__ = [
    "DEFAULTS",
    "apply_json_encoder",
    "beat_period_s",
    "chosen_backplane",
    "get_config",
    "with_defaults",
]

DEFAULTS: dict[str, Any] = {
    # Channel access rules (see docs/configuration.md). The most specific rule wins; a rule
    # on a family's base name guards every cadence of that family.
    "POLICIES": [],
    # Rules always appended after the user's (the user's own rule on the same pattern wins).
    "BUILTIN_POLICIES": [{"pattern": "realtime:socket", "staff": True}],
    # Modules named so in each installed app are imported at startup to register channels.
    "AUTODISCOVER_MODULE": "realtime_channels",
    # Largest inbound WebSocket text frame, bytes; over it the connection closes with 1009.
    "MAX_FRAME_BYTES": 64 * 1024,
    # Most requests in one JSON-RPC batch; over it the batch is refused (-32600).
    "MAX_BATCH": 50,
    # Longest channel name a client may name, characters.
    "MAX_CHANNEL_NAME": 200,
    # Subscriptions one connection may hold at once; 0 = unlimited.
    "MAX_SUBSCRIPTIONS": 100,
    # Backplane: "auto" = Redis when REDIS_URL, REDIS_SHARDS or REDIS_CLUSTER names one or the default
    # channel layer is channels-redis', else in-process (chosen_backplane). Or "memory",
    # "redis", "postgres" (docs/postgres-backplane.md), or a dotted path to a Backplane class.
    "BACKPLANE": "auto",
    # Redis URL of the backplane (one server); None = the channel layer's hosts.
    "REDIS_URL": None,
    # The backplane's Redis servers, each channel on one (URLs or channels-redis host dicts,
    # Sentinel ones included; docs/capacity.md). None = REDIS_URL, else the layer's hosts.
    "REDIS_SHARDS": None,
    # A Redis Cluster for the backplane: its startup nodes' URLs (docs/redis-cluster.md); the
    # slots are discovered, each channel on its slot's master. None = not a cluster.
    "REDIS_CLUSTER": None,
    # Prefix of every Redis key the backplane writes (leases, sequences, probes).
    "KEY_PREFIX": "realtime",
    # Lifetime of a ticker lease, milliseconds: the failover time when a process dies. The
    # maintenance beat (renew, compete, retry) runs every third of it.
    "LEASE_TTL_MS": 3000,
    # Every this many ms (and whenever Redis lost its state) each process joins all its
    # groups again and reseeds its sequences.
    "REASSERT_INTERVAL_MS": 60000,
    # A channel's seq key expires after this many ms without publications or subscribers.
    "SEQ_IDLE_TTL_MS": 3600000,
    # Redis connections the backplane uses at most, per Redis server (its own pool, and at
    # once from the layer's); a burst beyond it waits for a free one rather than failing.
    "REDIS_MAX_CONNECTIONS": 50,
    # Socket, connect and pool-wait timeout of the backplane's Redis client, ms.
    "REDIS_TIMEOUT_MS": 5000,
    # The Django database alias of the PostgreSQL backplane (its tables made by migrate there).
    "BACKPLANE_DATABASE": "default",
    # Connections the PostgreSQL backplane opens per process besides its listening one.
    "POSTGRES_POOL_SIZE": 4,
    # Connect, statement and pool-wait timeout of the PostgreSQL backplane, ms.
    "POSTGRES_TIMEOUT_MS": 5000,
    # Processes the deployment may run at once (a rolling deploy's overlap included): the
    # online check E017 holds max_connections to that many times each process's connections.
    "POSTGRES_MAX_PROCESSES": 8,
    # Publications of different channels sent to the backplane at once (no head-of-line
    # blocking between channels).
    "PUBLISH_CONCURRENCY": 16,
    # Largest publication frame, bytes: over it publish() raises PublicationTooLarge (the
    # servers refuse to send frames over 1 MiB, daphne's maxMessagePayloadSize).
    "MAX_PUBLICATION_BYTES": 1_000_000,
    # Hostile subscribers: distinct cadences of one family running in a process (past it
    # a subscribe gets the nearest running cadence), ticker channels and app-fed cadences
    # running in a process (each holds a lease; past it -32003 too_many_tickers),
    # connections per authenticated user and per anonymous client address (past it the
    # socket is closed with 1008); 0 = unlimited.
    "MAX_CADENCES_PER_FAMILY": 16,
    "MAX_TICKERS": 1000,
    # Instances of channel templates (``lot:<int:id>``) live in a process at once: in all,
    # and of one template (a template's ``max_instances`` overrides the latter). Past
    # either, subscribing to a new instance gets -32003 too_many_instances; 0 = unlimited.
    "MAX_INSTANCES": 100_000,
    "MAX_INSTANCES_PER_TEMPLATE": 20_000,
    # Each identity's share (a user, or an anonymous client's network): tickers and live
    # instances its subscriptions hold in a process, whoever opened them (past it -32003
    # with bound "identity"). Anonymous identities together never take the last
    # SIGNED_IN_RESERVE of MAX_TICKERS, MAX_INSTANCES and a template's bound (bound
    # "anonymous"). 0 = no share.
    "MAX_TICKERS_PER_IDENTITY": 50,
    "MAX_INSTANCES_PER_IDENTITY": 500,
    # Backplane state (a fresh channel's count and epoch on Redis, kept its history TTL)
    # that one identity's subscribes may keep live through a process, bytes; past it a
    # subscribe to an instance it does not hold is refused -32003 too_many_instances with
    # bound "backplane_bytes" until some expires. 0 = no bound.
    "MAX_BACKPLANE_BYTES_PER_IDENTITY": 256 * 1024,
    "MAX_CONNECTIONS_PER_USER": 100,
    "MAX_CONNECTIONS_PER_ADDRESS": 50,
    # WebSocket handshakes per second of one identity (a user, or an anonymous client's
    # address), with bursts of HANDSHAKE_BURST; past it the socket is accepted and closed
    # with 1013 (clients back off). 0 = unlimited.
    "HANDSHAKES_PER_S": 10.0,
    "HANDSHAKE_BURST": 30,
    # The process's own ceilings, whatever the number of identities (many addresses):
    # connections open at once — the last SIGNED_IN_RESERVE of them for signed-in users,
    # which anonymous sockets cannot take — and anonymous handshakes per second (bursts of
    # twice that). Past either, the socket is closed with 1013 "server full" / "too many
    # handshakes" (clients back off). 0 = unlimited. Sized from about 35 KB and 1.4 % of a
    # core per 1,000 idle connections (docs/deployment.md).
    "MAX_CONNECTIONS": 10_000,
    "SIGNED_IN_RESERVE": 0.1,
    "MAX_ANONYMOUS_HANDSHAKES_PER_S": 200.0,
    # Anonymous clients are grouped by network: one identity per IPv4 address (/32) and
    # per IPv6 /64 (one host is handed a /64: each of its addresses is not a new client).
    "ADDRESS_PREFIX_V4": 32,
    "ADDRESS_PREFIX_V6": 64,
    # Reverse proxies whose forwarding headers (Forwarded, X-Forwarded-For) name the client:
    # addresses or networks, e.g. ["127.0.0.1", "10.0.0.0/8"]. Headers from anyone else
    # are ignored (docs/deployment.md).
    "TRUSTED_PROXIES": [],
    # The one header the trusted proxies write the client's address in: "X-Forwarded-For",
    # "Forwarded" or "X-Real-IP" (any other is ignored: a client could send it).
    "FORWARDED_HEADER": "X-Forwarded-For",
    # Every this many ms each socket holding guarded subscriptions is checked against its
    # session and the database again (closed with 4001 / 4003 when its rights ended); 0 = only
    # at each subscribe and at logout.
    "REVALIDATE_INTERVAL_MS": 30000,
    # Admission of application methods and ``publish`` (docs/admission.md): requests queued
    # or running in the process, requests of one identity in flight, and each identity's
    # token bucket (tokens, refill per second); 0 switches a cap or the bucket off.
    "ADMISSION_MAX_PENDING": 3000,
    "ADMISSION_MAX_RUNNING": 64,
    "ADMISSION_MAX_PER_IDENTITY": 10,
    "ADMISSION_BUCKET_CAPACITY": 18.0,
    "ADMISSION_REFILL_PER_S": 9.0,
    # Tokens taken from the caller's bucket by a request for an unknown method and by each
    # invalid request: floods of them are refused, then closed, like any other.
    "ADMISSION_ERROR_COST": 1.0,
    # Refusals a connection may collect (refilled at a tenth of this per second) before it is
    # closed with 1008: a client that ignores retry_after_ms; 0 = never closed for that.
    "ADMISSION_CLOSE_AFTER_REFUSALS": 200,
    # Resumes (subscribe with since) replaying at once in a process, short ones left out
    # (hub.replay.SHORT_RESUME); past it -32003 too_many_resumes with retry_after_ms
    # (clients retry). 0 = unlimited.
    "MAX_CONCURRENT_RESUMES": 8,
    # Of those, at most this many for one identity (a user, or an address): 0 = no share.
    "MAX_RESUMES_PER_IDENTITY": 2,
    # Idempotent methods (rpc_method(idempotent=True), docs/transactions.md): how long the
    # answer of a call with an "idempotency_key" is kept for its repeats, seconds; the
    # largest answer kept, bytes (a larger one is not: its repeats get -32603
    # answer_not_kept); on one process, the bytes of every answer kept together; and the
    # bytes of the answers one identity's calls keep (on Redis as in memory) through this
    # process — past it its next new key is refused -32003 idempotency_full with
    # retry_after_ms (0 = no bound).
    "IDEMPOTENCY_TTL_S": 300,
    "IDEMPOTENCY_MAX_ANSWER_BYTES": 64 * 1024,
    "IDEMPOTENCY_MAX_BYTES": 64 * 1024 * 1024,
    "IDEMPOTENCY_MAX_BYTES_PER_IDENTITY": 1024 * 1024,
    # The outbox of durable channels (event_channel(durable=True), docs/transactions.md):
    # the databases whose outbox the processes drain; rows waiting past which durable
    # publications are refused (PublicationError "outbox full") and the probe raises its
    # alarm; the age of the oldest row past which the alarm is raised too, seconds; and how
    # long a published row's key is remembered on the backplane, so that a drain repeated
    # after a crash publishes it no second time, seconds.
    "OUTBOX_DATABASES": ["default"],
    "OUTBOX_MAX_ROWS": 100_000,
    "OUTBOX_MAX_AGE_S": 60,
    "OUTBOX_DEDUPE_WINDOW_S": 3600,
    # Presence (channels declared presence=True, docs/presence.md): notifications to its
    # watchers at most once per this many ms per channel (joins and leaves between coalesced);
    # above PRESENCE_DIFF_MEMBERS members they carry the count only (the list on request,
    # RPC "presence"); members one process lists per channel, the rest counted (0 = no bound).
    "PRESENCE_INTERVAL_MS": 1000,
    "PRESENCE_DIFF_MEMBERS": 1000,
    "PRESENCE_MAX_MEMBERS": 10_000,
    # A callable (or its dotted path) user -> public info listed with the member (a display
    # name), at most PRESENCE_INFO_MAX_BYTES of JSON (over it: listed without); None: none.
    "PRESENCE_INFO": None,
    "PRESENCE_INFO_MAX_BYTES": 256,
    # List anonymous connections in RPC "presence" pages, as one {"user": null} entry
    # (they are always counted).
    "PRESENCE_LIST_ANONYMOUS": False,
    # HTTP concurrency pools (docs/http-limiter.md), used by ConcurrencyLimitMiddleware:
    # {"reports": {"max_concurrent": 2, "max_waiting": 50, "wait_timeout_ms": 10000,
    #              "paths": ["/reports/*"]}}; requests that match no pool pass untouched.
    "HTTP_POOLS": {},
    # Write-behind stores (docs/write-behind.md): how long a change stays in memory before it
    # may be written, milliseconds (the loss window of a crash is this plus one flush).
    "WRITE_BEHIND_DELAY_MS": 5000,
    # Where a process that ends with unsaved write-behind changes (its database unreachable)
    # keeps them for the next process to write: a directory that outlives a restart. None =
    # <system temp>/realtime_app-journal (docs/write-behind.md).
    "WRITE_BEHIND_JOURNAL_DIR": None,
    # Channels listed by name in a process's probe (the busiest); the rest are counted.
    "PROBE_TOP_CHANNELS": 50,
    # Connections listed in a process's probe: the most bytes queued and the most drops, this
    # many of each (the admin screen's drill-down); 0 lists none.
    "PROBE_TOP_CONNECTIONS": 10,
    # Lifetime of a published process probe, milliseconds; it is republished every third.
    "PROBE_TTL_MS": 6000,
    # Transport backpressure (docs/backpressure.md): bytes (0 disables), "drop" | "close", balance.
    "MAX_BACKPRESSURE": 4 * 1024 * 1024,
    "BACKPRESSURE_POLICY": "drop",
    "CLOSE_AFTER_DROPS": 1000,
    # Connections at or above this many queued bytes count as slow consumers (no action).
    "SLOW_CONSUMER_BYTES": 1024 * 1024,
    # After a 1013 close, how long queued frames may still drain before the drop, ms.
    "CLOSE_DRAIN_MS": 10000,
    # JSON-RPC responses are written even over the threshold (they still count as drops).
    "NEVER_DROP_RESPONSES": True,
    # Who may read /realtime/metrics besides staff: a bearer token, or None.
    "METRICS_TOKEN": None,
    # Connection tokens (docs/auth.md): lifetime of a token issued without --ttl, the longest
    # one that may be issued, seconds; how long before its expiry a token connection is told
    # to refresh it ("token_expiring"), seconds; and the origins of pages on other domains
    # that may open a socket without cookies and sign in with RPC "auth" (e.g.
    # ["https://app.example.com"]).
    "TOKEN_TTL_S": 3600,
    "TOKEN_MAX_TTL_S": 30 * 86400,
    "TOKEN_REFRESH_BEFORE_S": 60,
    "TOKEN_ORIGINS": [],
    # What this site's tokens are signed for besides SECRET_KEY: another site sharing the
    # key (a staging copy) does not accept them. None: the settings module and
    # ALLOWED_HOSTS. Changing it refuses every token issued before.
    "TOKEN_SALT": None,
    # On SIGTERM (daphne), a process closes its connections with 1012 spread over this many
    # seconds (each told when to come back), after it stopped accepting and /realtime/ready
    # answers 503 (docs/deployment.md); sized to end inside a 30 s grace period. 0: at once.
    "DRAIN_SECONDS": 20,
    # Seconds between the server's WebSocket pings to a quiet client (daphne): a dead peer
    # is found after about this plus the ping timeout; each ping costs every connection a
    # wake-up (docs/deployment.md). 0: the server's own (--ping-interval, 20 s).
    "HEARTBEAT_SECONDS": 0,
    "FREEZE_STARTUP_OBJECTS": True,
    # Keys of the HTTP publish API (POST /realtime/api/publish, Authorization: Bearer <key>):
    # services in any language publish with one; [] switches the API off (401 to all).
    "PUBLISH_API_KEYS": [],
    # The json.JSONEncoder subclass (dotted path) that writes results and publications: the
    # one Django's JsonResponse uses by default (Decimal, datetime, UUID, Promise).
    "JSON_ENCODER": "django.core.serializers.json.DjangoJSONEncoder",
}


def beat_period_s(lease_ttl_ms: float) -> float:
    """The maintenance beat (renew, compete, retry, re-assert): a third of a lease's life,
    so that a lease is renewed twice before it can lapse. The one home of that rule."""
    return float(lease_ttl_ms) / 3000


def with_defaults(config: dict[str, Any] | None) -> dict[str, Any]:
    """``config`` (a whole ``REALTIME_APP`` or a few keys of one, as a backplane built in a
    test or a script is given) over :data:`DEFAULTS`: the one place they are merged."""
    return {**DEFAULTS, **(config or {})}


def chosen_backplane(config: dict[str, Any], layer: str) -> str:
    """The one rule of which backplane the settings choose: ``"memory"``, ``"redis"``, ``"postgres"``, a
    dotted path, or ``"unsupported_layer"`` (``"auto"`` with a channel layer no cluster can
    be carried on: check E008, never a silent single process). ``layer`` is the default
    channel layer's kind (``cluster.hosts.layer_kind``: ``"redis"``, ``"memory"``,
    ``"other"``). A Redis named in ``REALTIME_APP`` (``REDIS_URL``, ``REDIS_SHARDS`` or
    ``REDIS_CLUSTER``) chooses Redis as a channels-redis layer does."""
    choice = str(config["BACKPLANE"])
    if choice != "auto":
        return choice
    if layer == "redis" or config.get("REDIS_URL") or config.get("REDIS_SHARDS") or config.get("REDIS_CLUSTER"):
        return "redis"
    return "unsupported_layer" if layer == "other" else "memory"


@cache
def get_config() -> dict[str, Any]:
    """The effective settings: the user's ``REALTIME_APP`` merged over :data:`DEFAULTS`."""
    from django.conf import settings

    user = getattr(settings, "REALTIME_APP", None) or {}
    if not isinstance(user, dict):  # reported by check E001; the defaults meanwhile
        user = {}
    return with_defaults(user)


def apply_json_encoder() -> None:
    """Give the wire format the ``JSON_ENCODER`` class (at startup and when the settings
    change); a path that does not import to one is reported by check E009 and ignored."""
    import json

    from django.utils.module_loading import import_string

    from realtime_app.wire.protocol import use_encoder

    value = get_config()["JSON_ENCODER"]
    try:
        cls = import_string(value) if isinstance(value, str) else value
    except ImportError:
        return
    if isinstance(cls, type) and issubclass(cls, json.JSONEncoder):
        use_encoder(cls)
