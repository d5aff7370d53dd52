"""Presence on Redis (a mixin of :class:`~realtime_app.cluster.redis.RedisBackplane`): each
channel's parts in a hash, their expiry in a sorted set, and — for a process that marks
itself alive — one key per process instead of a renewal per room per beat.

Found: 20,000 idle presence rooms kept daphne at 85 % of a core, each room's part
written again every beat to renew a 3 s lease. A process now renews one alive key per
beat (per shard); its parts live an hour between writes
(:data:`~realtime_app.cluster.base.PRESENCE_KEEP_MS`), and every reader drops the parts
of a process whose alive key lapsed — as soon as a lease, as before.
"""

from __future__ import annotations

from typing import Any

from realtime_app.cluster.base import PRESENCE_KEEP_MS
from realtime_app.cluster.redis_scripts import text

__all__ = ["RedisPresence"]


class RedisPresence:
    """``put_presence``, ``read_presence`` and ``presence_alive`` of one Redis server."""

    prefix: str
    instance_id: str
    redis: Any
    _presence: dict[str, Any]  # the scripts: PUT, READ, ALIVE
    #: Whether this process may mark itself alive here (a Redis Cluster node may not: its
    #: scripts reach only the keys of one slot).
    presence_liveness = True

    def key(self, kind: str, channel: str) -> str:
        raise NotImplementedError

    def _alive_prefix(self) -> str:
        return f"{self.prefix}:presence-alive:" if self.presence_liveness else ""

    async def presence_alive(self, ttl_ms: int) -> tuple[int, bool] | None:
        """Mark this process alive for ``ttl_ms``: ``(how long its parts are kept, whether
        its mark was still there)`` — not there (a first beat, a Redis that lost its keys,
        a beat late by a lease): its parts may be gone, the caller writes them all again."""
        if not self.presence_liveness:
            return None
        was = await self._presence["ALIVE"](keys=[self._alive_prefix() + self.instance_id], args=[ttl_ms])
        return PRESENCE_KEEP_MS, bool(int(was))

    async def put_presence(self, parts: dict[str, str | None], ttl_ms: int, alive: bool = False) -> None:
        field, prefix = self.instance_id, ""
        if alive and self.presence_liveness:
            field, prefix = "@" + self.instance_id, self._alive_prefix()
        put = self._presence["PUT"]
        async with self.redis.pipeline(transaction=False) as pipe:
            for channel, part in parts.items():
                keys = [self.key("presence", channel), self.key("presence-until", channel)]
                await put(keys=keys, args=[field, part or "", ttl_ms, prefix], client=pipe)
            await pipe.execute()

    async def read_presence(self, known: dict[str, str]) -> dict[str, tuple[str, list[str]] | None]:
        read, prefix = self._presence["READ"], self._alive_prefix()
        async with self.redis.pipeline(transaction=False) as pipe:
            for channel, version in known.items():
                keys = [self.key("presence", channel), self.key("presence-until", channel)]
                await read(keys=keys, args=[version, prefix], client=pipe)
            answers = await pipe.execute()
        out: dict[str, tuple[str, list[str]] | None] = {}
        for (channel, version), answer in zip(known.items(), answers, strict=True):
            current = text(answer[0])
            out[channel] = None if current == version else (current, [text(part) for part in answer[1:]])
        return out
