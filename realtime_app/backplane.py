"""How processes share publications, ticker leases, sequences and probes.

Two implementations of one small interface:

* :class:`MemoryBackplane` — the embedded default: one process, nothing to elect, frames
  handed straight to the local hub.
* :class:`RedisBackplane` — a cluster on channels-redis. Each process owns one layer
  channel and joins a channel's group at its first local subscriber, so a publication
  costs one backplane message per subscribed process. A lease per cadenced channel
  (``SET NX PX``, renewed by its holder) elects the one process that runs its ticker;
  ``INCR`` numbers publications cluster-wide, so ``seq`` survives a failover. Probes are
  keys with a TTL, so the cluster view lists live processes only.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

from .names import group_name
from .protocol import message_notification

if TYPE_CHECKING:
    from .hub import Hub

__all__ = ["Backplane", "MemoryBackplane", "RedisBackplane", "make_backplane"]

logger = logging.getLogger("realtime_app.backplane")

FRAME = "realtime.frame"
RELEASED = "realtime.released"

_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


def now_ms() -> int:
    return int(time.time() * 1000)


class Backplane:
    """What the hub needs from the rest of the cluster. The base class is one process."""

    #: True when several processes may share channels (leases and groups matter).
    clustered = False

    def __init__(self, hub: Hub | None = None) -> None:
        self.hub = hub
        self._seq: dict[str, int] = {}

    async def start(self) -> None:
        """Begin receiving for the hub (no-op for one process)."""

    async def stop(self) -> None:
        """Stop receiving and release what this process holds."""

    async def join(self, channel: str) -> None:
        """This process has its first local subscriber of ``channel``."""

    async def leave(self, channel: str) -> None:
        """This process's last local subscriber of ``channel`` has left."""

    async def next_seq(self, channel: str) -> int:
        seq = self._seq.get(channel, 0) + 1
        self._seq[channel] = seq
        return seq

    async def publish(self, channel: str, data: Any) -> int:
        """Number and deliver one publication; returns its ``seq``."""
        seq = await self.next_seq(channel)
        if self.hub is not None:
            await self.hub.fanout(channel, message_notification(channel, data, seq, now_ms()))
        return seq

    async def acquire(self, channel: str) -> bool:
        """Try to become the process that runs ``channel``'s ticker."""
        return True

    async def renew(self, channel: str) -> bool:
        """Keep the lease; False means it was lost (stop the ticker)."""
        return True

    async def release(self, channel: str) -> None:
        """Give the lease up and tell the other subscribed processes."""

    async def put_probe(self, probe: dict[str, Any], ttl_ms: int) -> None:
        self._probe = probe

    async def cluster_probes(self) -> list[dict[str, Any]]:
        """The probes of every live process (this one's only, for one process)."""
        probe = getattr(self, "_probe", None)
        return [probe] if probe else []


class MemoryBackplane(Backplane):
    """The embedded default: one process, in-memory channel layer or none at all."""


class RedisBackplane(Backplane):
    """A cluster of processes sharing the channels-redis layer (and its Redis)."""

    clustered = True

    def __init__(
        self,
        hub: Hub | None = None,
        *,
        layer: Any = None,
        redis: Any = None,
        prefix: str = "realtime",
        lease_ttl_ms: int = 3000,
    ) -> None:
        super().__init__(hub)
        if layer is None:
            from channels.layers import get_channel_layer

            layer = get_channel_layer()
        self.layer = layer
        self.redis = redis if redis is not None else _redis_for(layer)
        self.prefix = prefix
        self.lease_ttl_ms = lease_ttl_ms
        self.process_channel: str | None = None
        self.instance_id = hub.instance_id if hub is not None else "headless"
        self._renew = self.redis.register_script(_RENEW)
        self._release = self.redis.register_script(_RELEASE)

    def key(self, kind: str, channel: str) -> str:
        return f"{self.prefix}:{kind}:{group_name(channel)}"

    async def start(self) -> None:
        assert self.hub is not None
        # The default prefix on purpose: channels-redis serves every process-local ("!")
        # channel of a layer through one receive lock that pops one Redis key per prefix;
        # a channel under another prefix would starve the application's own consumers.
        self.process_channel = await self.layer.new_channel()

    async def receive(self) -> dict[str, Any]:
        """Wait for the next message to this process (the hub loops over it)."""
        assert self.process_channel is not None
        message: dict[str, Any] = await self.layer.receive(self.process_channel)
        return message

    async def stop(self) -> None:
        await self.redis.aclose()

    async def join(self, channel: str) -> None:
        assert self.process_channel is not None
        await self.layer.group_add(group_name(channel), self.process_channel)

    async def leave(self, channel: str) -> None:
        assert self.process_channel is not None
        await self.layer.group_discard(group_name(channel), self.process_channel)

    async def next_seq(self, channel: str) -> int:
        return int(await self.redis.incr(self.key("seq", channel)))

    async def publish(self, channel: str, data: Any) -> int:
        seq = await self.next_seq(channel)
        text = message_notification(channel, data, seq, now_ms())
        await self.layer.group_send(group_name(channel), {"type": FRAME, "channel": channel, "text": text})
        return seq

    async def acquire(self, channel: str) -> bool:
        return bool(await self.redis.set(self.key("lease", channel), self.instance_id, nx=True, px=self.lease_ttl_ms))

    async def renew(self, channel: str) -> bool:
        return bool(await self._renew(keys=[self.key("lease", channel)], args=[self.instance_id, self.lease_ttl_ms]))

    async def release(self, channel: str) -> None:
        await self._release(keys=[self.key("lease", channel)], args=[self.instance_id])
        await self.layer.group_send(group_name(channel), {"type": RELEASED, "channel": channel, "by": self.instance_id})

    async def lease_holder(self, channel: str) -> str | None:
        value = await self.redis.get(self.key("lease", channel))
        return value.decode() if isinstance(value, bytes) else value

    async def put_probe(self, probe: dict[str, Any], ttl_ms: int) -> None:
        now = now_ms()
        instances = f"{self.prefix}:instances"
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(f"{self.prefix}:probe:{self.instance_id}", json.dumps(probe), px=ttl_ms)
            pipe.zadd(instances, {self.instance_id: now + ttl_ms})
            pipe.zremrangebyscore(instances, "-inf", now)
            await pipe.execute()

    async def drop_probe(self) -> None:
        await self.redis.delete(f"{self.prefix}:probe:{self.instance_id}")
        await self.redis.zrem(f"{self.prefix}:instances", self.instance_id)

    async def cluster_probes(self) -> list[dict[str, Any]]:
        ids = await self.redis.zrangebyscore(f"{self.prefix}:instances", now_ms(), "+inf")
        if not ids:
            return []
        names = [i.decode() if isinstance(i, bytes) else i for i in ids]
        raw = await self.redis.mget([f"{self.prefix}:probe:{n}" for n in names])
        return [json.loads(r) for r in raw if r]


def _redis_for(layer: Any) -> Any:
    """A redis.asyncio client on the layer's first host (the same Redis as the groups)."""
    from channels_redis.utils import create_pool
    from django.conf import settings  # noqa: F401  (settings must be configured)
    from redis import asyncio as aioredis

    from .conf import get_config

    url = get_config()["REDIS_URL"]
    if url:
        return aioredis.Redis.from_url(url)
    return aioredis.Redis(connection_pool=create_pool(layer.hosts[0]))


def backplane_class() -> type[Backplane]:
    """The backplane the settings choose (``"auto"``: Redis iff the layer is channels-redis)."""
    from django.utils.module_loading import import_string

    from .conf import get_config

    choice = get_config()["BACKPLANE"]
    if choice == "memory":
        return MemoryBackplane
    if choice == "redis":
        return RedisBackplane
    if choice == "auto":
        from channels.layers import get_channel_layer

        layer = get_channel_layer()
        try:
            from channels_redis.core import RedisChannelLayer
        except ImportError:  # pragma: no cover - channels-redis is a dependency
            return MemoryBackplane
        return RedisBackplane if isinstance(layer, RedisChannelLayer) else MemoryBackplane
    cls: type[Backplane] = import_string(choice)
    return cls


def make_backplane(hub: Hub | None = None) -> Backplane:
    """Build the configured backplane for ``hub`` (None: publish-only, no receiving)."""
    from .conf import get_config

    cls = backplane_class()
    if issubclass(cls, RedisBackplane):
        config = get_config()
        return cls(hub, prefix=config["KEY_PREFIX"], lease_ttl_ms=config["LEASE_TTL_MS"])
    return cls(hub)
