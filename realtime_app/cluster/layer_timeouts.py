"""channels-redis' layers kept as they were written: their receive is a blocking read
(``BZPOPMIN``, a pub/sub listen) that waits as long as nothing is sent, and redis-py 8
times every read out after 5 s by default — so a project's idle consumer died with 1011
("Timeout reading from ...") after 6-11 s. The backplane needs redis-py 8 (its own clients
set their own bounds: ``REDIS_TIMEOUT_MS``); the layers need reads without a timeout. At
start, each host of a channels-redis layer that does not say ``socket_timeout`` itself is
given ``None``, redis-py 7's default; a host that says one keeps it."""

from __future__ import annotations

from typing import Any

from realtime_app.cluster.hosts import decode_hosts

__all__ = ["LAYER_MODULES", "unbounded_layer_reads"]

#: The channel layers whose receive blocks on Redis (channels-redis' two).
LAYER_MODULES = ("channels_redis.core.", "channels_redis.pubsub.")


def unbounded_layer_reads(layers: dict[str, Any]) -> list[str]:
    """Give every host of each channels-redis layer of ``layers`` (``CHANNEL_LAYERS``,
    changed in place) ``socket_timeout=None`` unless it sets one — in its dict, or in its
    URL's query (which redis-py reads over keywords). The aliases of the layers changed."""
    changed: list[str] = []
    for alias, layer in (layers or {}).items():
        if not isinstance(layer, dict) or not str(layer.get("BACKEND", "")).startswith(LAYER_MODULES):
            continue
        config = layer.setdefault("CONFIG", {})
        if not isinstance(config, dict):
            continue
        try:
            hosts = decode_hosts(config.get("hosts"))
        except ValueError:  # a bare string: channels-redis says so itself when it reads it
            continue
        kept = [_unbounded(host) for host in hosts]
        if kept != hosts:
            config["hosts"] = kept
            changed.append(alias)
    return changed


def _unbounded(host: dict[str, Any]) -> dict[str, Any]:
    if "socket_timeout" in host or "socket_timeout=" in str(host.get("address", "")):
        return host
    return {**host, "socket_timeout": None}
