"""Leases, probes and shared buckets on Redis (a mixin of
:class:`~realtime_app.cluster.redis.RedisBackplane`, the
:class:`~realtime_app.cluster.roles.LeaseStore` role): a key per lease (``SET NX PX``,
renewed by its holder), a key per process's probe with a TTL and a sorted set of the live
ones, a token bucket per identity."""

from __future__ import annotations

import json
from typing import Any

from realtime_app.cluster.redis_scripts import text
from realtime_app.cluster.roles import now_ms
from realtime_app.inbound.admission import retry_after_ms
from realtime_app.observability.logsafe import Outage
from realtime_app.observability.schema import ProcessProbe, ShardProbe

__all__ = ["RedisLeases"]


class RedisLeases:
    """``acquire``, ``renew``, ``release``, the probes and ``take_tokens`` of one Redis server."""

    redis: Any
    instance_id: str
    lease_ttl_ms: int
    address: str
    outage: Outage
    _renew: Any
    _release: Any
    _take: Any
    _probes: dict[str, tuple[bytes, ProcessProbe]]

    def key(self, kind: str, channel: str) -> str:
        raise NotImplementedError

    def home_key(self, name: str) -> str:
        raise NotImplementedError

    def redis_channel(self, channel: str) -> str:
        raise NotImplementedError

    @property
    def alive_key(self) -> str:
        raise NotImplementedError

    async def acquire(self, channel: str) -> bool:
        return bool(await self.redis.set(self.key("lease", channel), self.instance_id, nx=True, px=self.lease_ttl_ms))

    async def renew(self, channel: str) -> bool:
        return bool(await self._renew(keys=[self.key("lease", channel)], args=[self.instance_id, self.lease_ttl_ms]))

    async def release(self, channel: str) -> None:
        await self._release(keys=[self.key("lease", channel), self.redis_channel(channel)], args=[self.instance_id])

    async def put_probe(self, probe: ProcessProbe, ttl_ms: int) -> None:
        now = now_ms()
        instances = self.home_key("instances")
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.home_key(f"probe:{self.instance_id}"), json.dumps(probe), px=ttl_ms)
            pipe.zadd(instances, {self.instance_id: now + ttl_ms})
            pipe.zremrangebyscore(instances, "-inf", now)
            pipe.pexpire(instances, ttl_ms)  # gone with the last live process's probe
            await pipe.execute()

    async def drop_probe(self) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(self.home_key(f"probe:{self.instance_id}"))
            pipe.delete(self.alive_key)
            pipe.zrem(self.home_key("instances"), self.instance_id)
            await pipe.execute()

    async def drop_alive(self) -> None:
        """Withdraw this process's sentinel key (a shard other than the home one)."""
        await self.redis.delete(self.alive_key)

    async def cluster_probes(self) -> list[ProcessProbe]:
        """The other live processes' probes (this process's own is its hub's, fresh). A
        probe is republished every few seconds and read far more often: one whose bytes
        did not change is not decoded again (callers do not change what they are given)."""
        ids = await self.redis.zrangebyscore(self.home_key("instances"), now_ms(), "+inf")
        names = [name for name in map(text, ids) if name != self.instance_id]
        raw = await self.redis.mget([self.home_key(f"probe:{n}") for n in names]) if names else []
        seen, self._probes = self._probes, {}
        for name, data in zip(names, raw, strict=True):
            if data:
                known = seen.get(name)
                self._probes[name] = (data, known[1] if known is not None and known[0] == data else json.loads(data))
        return [probe for _, probe in self._probes.values()]

    def shards_probe(self) -> list[ShardProbe]:
        return [{"index": 0, "address": self.address, "up": not self.outage.down, "outages": self.outage.outages}]

    # -- admission ----------------------------------------------------------------------

    async def take_tokens(self, identity: str, cost: float, capacity: float, refill_per_s: float) -> int | None:
        refill_ms = int(capacity / refill_per_s * 1000) + 1000  # a full bucket needs no key
        wait = await self._take(
            keys=[self.home_key(f"bucket:{identity}")], args=[repr(cost), repr(capacity), repr(refill_per_s), refill_ms]
        )
        seconds = float(wait.decode() if isinstance(wait, bytes) else wait)
        return retry_after_ms(seconds) if seconds > 0 else None
