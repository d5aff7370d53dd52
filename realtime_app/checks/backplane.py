"""Checks of the backplane's settings: which backplane (E003, E005), its Redis servers
(E011), its Redis Cluster (E014) and its PostgreSQL database (E016). Called by
:func:`realtime_app.checks.configuration.check_settings`."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error

from realtime_app.conf import get_config

__all__ = ["check_backplane", "check_cluster", "check_shards"]


def check_shards(value: Any) -> list[CheckMessage]:
    """E011: ``REDIS_SHARDS`` that are not hosts as channels-redis reads them: URLs,
    ``(host, port)`` pairs, or dicts with an ``address``, a ``host`` or a Sentinel
    ``master_name``."""
    if value is None:
        return []

    def is_host(entry: Any) -> bool:
        if isinstance(entry, str):
            return entry.startswith(("redis://", "rediss://", "unix://"))
        if isinstance(entry, (list, tuple)):
            return len(entry) == 2
        return isinstance(entry, dict) and any(k in entry for k in ("address", "host", "master_name"))

    problem = "must be a non-empty list of Redis URLs (redis://, rediss://, unix://), (host, port) pairs or "
    problem += "channels-redis host dicts"
    if isinstance(value, (list, tuple)) and value:
        bad = [entry for entry in value if not is_host(entry)]
        if bad:
            problem += f"; not a host: {bad[0]!r}"
        elif len({_server(entry) for entry in value}) < len(value):
            problem = "lists a server twice (each channel would be on one of two names for the same server)"
        else:
            return []
    return [
        Error(
            f"REALTIME_APP['REDIS_SHARDS'] {problem}, got {value!r}.",
            hint='e.g. ["redis://10.0.0.1:6379/0", "redis://10.0.0.2:6379/0"] (docs/capacity.md).',
            id="realtime_app.E011",
        )
    ]


def check_cluster(config: dict[str, Any]) -> list[CheckMessage]:
    """E014: ``REDIS_CLUSTER`` that is not a list of ``redis://`` / ``rediss://`` URLs, or
    that another setting contradicts (a second Redis for the backplane, a backplane that is
    not Redis, a key prefix with a hash tag of its own)."""
    value = config.get("REDIS_CLUSTER")
    if value is None:
        return []
    problem = None
    if not isinstance(value, (list, tuple)) or not value:
        problem = "must be a non-empty list of the cluster's startup node URLs"
    elif bad := [url for url in value if not (isinstance(url, str) and url.startswith(("redis://", "rediss://")))]:
        problem = f"lists {bad[0]!r}, not a redis:// or rediss:// URL"
    elif config.get("REDIS_SHARDS") or config.get("REDIS_URL"):
        problem = "is set beside REDIS_SHARDS or REDIS_URL: the backplane uses one of them, say which"
    elif str(config.get("BACKPLANE")) not in ("auto", "redis"):
        problem = f"is set but BACKPLANE is {config.get('BACKPLANE')!r}: the cluster would not be used"
    elif any(c in str(config.get("KEY_PREFIX", "")) for c in "{}"):
        problem = "is set and KEY_PREFIX has a brace: it would be the hash tag of every key (one slot for all)"
    if problem is None:
        return []
    return [
        Error(
            f"REALTIME_APP['REDIS_CLUSTER'] {problem}, got {value!r}.",
            hint='e.g. ["redis://10.0.0.1:6379", "redis://10.0.0.2:6379"] (docs/redis-cluster.md).',
            id="realtime_app.E014",
        )
    ]


def _server(entry: Any) -> str:
    """Which server and database a host names, whatever the spelling: ``redis://A:6379``
    and ``redis://a:6379/0`` are one."""
    from urllib.parse import urlsplit

    if isinstance(entry, str) and entry.startswith(("redis://", "rediss://")):
        parts = urlsplit(entry)
        database = parts.path.strip("/") or "0"
        return f"{(parts.hostname or '').lower()}:{parts.port or 6379}/{database}"
    if isinstance(entry, dict) and isinstance(entry.get("address"), str):
        return _server(entry["address"])
    if isinstance(entry, (list, tuple)) and len(entry) == 2:
        return f"{str(entry[0]).lower()}:{entry[1]}/0"
    return repr(entry)


def check_backplane(backplane: Any) -> list[CheckMessage]:
    """E003 a backplane that is not one; E005 the Redis backplane without a Redis to use."""
    from django.utils.module_loading import import_string

    from realtime_app.cluster.base import Backplane

    if backplane in ("auto", "memory"):
        return []
    if backplane == "postgres":
        from realtime_app.cluster.factory import check_postgres

        return check_postgres(get_config()["BACKPLANE_DATABASE"])
    if backplane == "redis":
        from realtime_app.cluster.hosts import uses_channels_redis

        config = get_config()
        if uses_channels_redis() or config["REDIS_URL"] or config["REDIS_SHARDS"] or config["REDIS_CLUSTER"]:
            return []
        return [
            Error(
                "REALTIME_APP['BACKPLANE'] is 'redis' but neither REDIS_URL nor a channels-redis layer says "
                "where Redis is.",
                hint="Set REDIS_URL, or configure CHANNEL_LAYERS with channels_redis.core.RedisChannelLayer or "
                "channels_redis.pubsub.RedisPubSubChannelLayer.",
                id="realtime_app.E005",
            )
        ]
    from realtime_app.cluster.roles import missing_methods

    why = ""
    try:
        cls = import_string(backplane) if isinstance(backplane, str) else None
    except ImportError as exc:
        cls, why = None, f" ({exc})"
    if not (isinstance(cls, type) and issubclass(cls, Backplane)):
        return [
            Error(
                f"REALTIME_APP['BACKPLANE'] is {backplane!r}: "
                f"not 'auto', 'memory', 'redis', 'postgres' or the dotted path of a Backplane subclass{why}.",
                hint="See docs/configuration.md.",
                id="realtime_app.E003",
            )
        ]
    missing = missing_methods(cls)
    if missing:
        return [
            Error(
                f"REALTIME_APP['BACKPLANE'] {backplane!r} does not implement {', '.join(missing)}.",
                hint="A backplane plays every role of realtime_app.cluster.roles (docs/architecture.md).",
                id="realtime_app.E003",
            )
        ]
    return []
