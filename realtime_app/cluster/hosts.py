"""Redis hosts as channels-redis reads them, which of them the backplane uses, the pool of
a Sentinel service, and the backplane's client on any of them — rules of this package, on redis-py's public API.

The shapes are channels-redis' (``CONFIG["hosts"]`` of its layers: a URL, a
``(host, port)`` pair, or a dict of connection keywords, Sentinel services with
``master_name`` / ``sentinels`` / ``sentinel_kwargs``), so that the backplane reads the
layer's hosts as the layer does. They are copied here rather than imported from
``channels_redis.utils``, which is not a documented API; ``tests/test_checks.py`` holds
them to the library's on every shape.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from redis import asyncio as aioredis
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.exceptions import RedisError

from realtime_app.cancellation import uninterrupted

__all__ = [
    "REDIS_LAYERS",
    "ClientClosed",
    "ConnectGate",
    "close_client",
    "decode_hosts",
    "host_label",
    "layer_hosts",
    "layer_kind",
    "redis_client",
    "sentinel_pool",
    "shard_hosts",
    "uses_channels_redis",
]


def decode_hosts(hosts: Sequence[Any] | None) -> list[dict[str, Any]]:
    """Each host as connection keywords: ``{"address": url}``, ``{"host", "port"}`` or the
    dict given; a bare string is refused (a list is needed even for one host)."""
    if not hosts:
        return [{"address": "redis://localhost:6379"}]
    if isinstance(hosts, (str, bytes)):
        raise ValueError("You must pass a list of Redis hosts, even if there is only one.")
    result: list[dict[str, Any]] = []
    for entry in hosts:
        if isinstance(entry, dict):
            result.append(entry)
        elif isinstance(entry, (tuple, list)):
            result.append({"host": entry[0], "port": entry[1]})
        else:
            result.append({"address": entry})
    return result


def sentinel_pool(host: dict[str, Any]) -> aioredis.ConnectionPool:
    """The pool of a Sentinel service's master (``master_name``, ``sentinels``,
    ``sentinel_kwargs``; the other keys go to each connection)."""
    options = dict(host)
    master_name = options.pop("master_name")
    sentinels = options.pop("sentinels")
    sentinel_kwargs = options.pop("sentinel_kwargs", None)
    sentinel = Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call]
    return SentinelConnectionPool(master_name, sentinel, **options)  # type: ignore[no-untyped-call]


def redis_client(settings: dict[str, Any], host: dict[str, Any]) -> Any:
    """A redis.asyncio client on one host, whatever its shape (URL, host and port, a
    Sentinel service), with the backplane's bounds: at most ``REDIS_MAX_CONNECTIONS``
    (a burst waits for one rather than failing, but with Sentinel), and
    ``REDIS_TIMEOUT_MS`` on every connect, read and wait, so that a server that stops
    answering fails its calls instead of holding them."""
    timeout_s = settings["REDIS_TIMEOUT_MS"] / 1000
    bounds = {
        "max_connections": settings["REDIS_MAX_CONNECTIONS"],
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
    }
    bounds["redis_connect_func"] = gated = ConnectGate().connect
    url = host.get("address") if isinstance(host.get("address"), str) else None
    if url:
        pool: aioredis.ConnectionPool = aioredis.BlockingConnectionPool.from_url(url, timeout=timeout_s, **bounds)
    elif host.get("master_name"):
        sentinel_kwargs = host.get("sentinel_kwargs") or {
            k: timeout_s for k in ("socket_timeout", "socket_connect_timeout")
        }
        sentinel_kwargs = {**sentinel_kwargs, "redis_connect_func": gated}  # the sentinels' connections too
        options = {**bounds, **_untimed(host), "sentinel_kwargs": sentinel_kwargs}
        pool = sentinel_pool(options)  # the master, by its sentinels
    elif host.get("host"):
        pool = aioredis.BlockingConnectionPool(timeout=timeout_s, **{**bounds, **_untimed(host)})
    else:
        raise ValueError("the Redis backplane needs REDIS_SHARDS, REDIS_URL or a channels-redis layer with hosts")
    return aioredis.Redis(connection_pool=pool)


def _untimed(host: dict[str, Any]) -> dict[str, Any]:
    """A host's keywords but its read and connect timeouts: the backplane's are
    ``REDIS_TIMEOUT_MS`` (a channels-redis layer's host may say None: its reads block)."""
    return {k: v for k, v in host.items() if k not in ("socket_timeout", "socket_connect_timeout")}


class ConnectGate:
    """Every connection of a :func:`redis_client` is set up by :meth:`connect` once its
    socket is open (redis-py's ``redis_connect_func``), and refused once the client is closed: a call
    still under way when its pool was closed — its connect in progress, which the pool's
    close skips, or begun after — would otherwise open a socket in a pool that nothing
    closes again. Refused with an error redis-py does not retry, the socket closed."""

    def __init__(self) -> None:
        self.closed = False

    async def connect(self, connection: Any) -> None:
        if self.closed:
            raise ClientClosed("this Redis client is closed")
        await connection.on_connect()


class ClientClosed(RedisError):
    """A call on a client closed meanwhile (:class:`ConnectGate`): never sent, and no outage."""


async def close_client(client: Any) -> None:
    """Close ``client`` and its pool (and a Sentinel service's sentinels) for good: no
    connection opened after (:class:`ConnectGate`), and the close finished even when the
    caller is cancelled meanwhile (a close cut in half leaves the sockets not closed yet
    open); each socket's close is bounded by the client's ``REDIS_TIMEOUT_MS``."""
    gate = getattr(client.connection_pool.connection_kwargs.get("redis_connect_func"), "__self__", None)
    if isinstance(gate, ConnectGate):
        gate.closed = True
    manager = getattr(client.connection_pool, "sentinel_manager", None)
    try:
        await uninterrupted(client.aclose(close_connection_pool=True))
    finally:  # a Sentinel service: its sentinels' connections too
        for sentinel in getattr(manager, "sentinels", ()):
            with contextlib.suppress(RedisError, OSError):
                await uninterrupted(sentinel.aclose())


def layer_kind() -> str:
    """What the default channel layer is, for the backplane's choice: ``"redis"`` (one of
    channels-redis' layers: the cluster is carried on its Redis), ``"memory"`` (none, or
    Channels' in-memory layer: one process) or ``"other"`` (a layer the backplane cannot
    carry a cluster on: check E008, never a silent fallback to one process)."""
    from django.conf import settings

    backend = (getattr(settings, "CHANNEL_LAYERS", {}) or {}).get("default", {}).get("BACKEND")
    if backend is None or backend == "channels.layers.InMemoryChannelLayer":
        return "memory"
    if backend in REDIS_LAYERS:
        return "redis"
    return "other"


#: The channel layers whose Redis carries the cluster (their ``CONFIG["hosts"]``).
REDIS_LAYERS = ("channels_redis.core.RedisChannelLayer", "channels_redis.pubsub.RedisPubSubChannelLayer")


def uses_channels_redis() -> bool:
    """True when the default channel layer is one of channels-redis' (either of them)."""
    return layer_kind() == "redis"


def layer_hosts() -> list[dict[str, Any]]:
    """The default layer's Redis hosts, as channels-redis reads them (``[]`` if none)."""
    from django.conf import settings

    layer = (getattr(settings, "CHANNEL_LAYERS", {}) or {}).get("default", {})
    hosts = (layer.get("CONFIG") or {}).get("hosts")
    return list(decode_hosts(hosts)) if hosts else []


def shard_hosts(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The Redis servers of the backplane, in channels-redis' host shape: ``REDIS_SHARDS``
    (URLs or host dicts, Sentinel ones included), else ``REDIS_URL``, else every host of
    the default channels-redis layer; more than one shards the channels
    (:mod:`realtime_app.cluster.shards`)."""
    if config.get("REDIS_SHARDS"):
        return list(decode_hosts(config["REDIS_SHARDS"]))
    if config.get("REDIS_URL"):
        return [{"address": config["REDIS_URL"]}]
    return layer_hosts()


def host_label(host: dict[str, Any]) -> str:
    """Where a host is, for logs and the probe: ``host:port/db`` or the Sentinel service
    name, never a password."""
    from urllib.parse import urlsplit

    if host.get("master_name"):
        return f"sentinel:{host['master_name']}"
    address = host.get("address")
    if isinstance(address, str):
        parts = urlsplit(address)
        return f"{parts.hostname}:{parts.port or 6379}{parts.path or '/0'}"
    return f"{host.get('host', '?')}:{host.get('port', 6379)}"
