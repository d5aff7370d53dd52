"""Checks of the backplane's settings: which backplane (E003, E005) and its Redis servers
(E011). Called by :func:`realtime_app.checks.configuration.check_settings`."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error

from realtime_app.conf import get_config

__all__ = ["check_backplane", "check_shards"]


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
    if backplane == "redis":
        from realtime_app.cluster.redis import uses_channels_redis

        if uses_channels_redis() or get_config()["REDIS_URL"] or get_config()["REDIS_SHARDS"]:
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
    try:
        cls = import_string(backplane) if isinstance(backplane, str) else None
    except ImportError:
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, Backplane)):
        return [
            Error(
                f"REALTIME_APP['BACKPLANE'] is {backplane!r}: "
                "not 'auto', 'memory', 'redis' or the dotted path of a Backplane subclass.",
                hint="See docs/configuration.md.",
                id="realtime_app.E003",
            )
        ]
    return []
