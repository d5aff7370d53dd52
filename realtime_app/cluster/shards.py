"""The backplane over several Redis servers: each channel lives on one shard.

A channel's keys and pub/sub channel — its group traffic, ``seq``, lease, history and
epoch — are all on the shard :func:`shard_of` picks from its group name, so every
per-channel script stays on one server; that server's :class:`~.redis.RedisBackplane`
carries them as it would alone (its own pool, pub/sub connection, receiver and outage).
What belongs to no channel — the instances and their probes, the shared token buckets —
lives on the **home** shard, the first. Losing a shard stops its channels only: the
others go on (their leases renewed, their frames delivered), and when it answers again
its own check says so and the hub re-asserts what that shard lost; clients resuming a
channel with history learn by its epoch what was lost (docs/recovery.md). Losing the home
shard stops the cluster view and makes shared buckets fall back to each process's own;
delivery goes on.

The hash is channels-redis' own (``_consistent_hash`` in ``channels_redis.utils``: the
low 12 bits of the CRC-32 of the name, cut into equal ranges), copied here as a public
rule of this module and held to the library's by a test: a channel's shard does not
depend on a private name of another package. Adding a shard moves about half of the
channels (docs/capacity.md, "Adding a shard").
"""

from __future__ import annotations

import asyncio
import binascii
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

from realtime_app.cluster.base import Backplane, Deliver
from realtime_app.cluster.redis import RedisBackplane, shard_hosts
from realtime_app.observability.logsafe import Outage
from realtime_app.observability.schema import ProcessProbe, ShardProbe
from realtime_app.wire.history import PAGE_BYTES, HistoryEntry, HistoryPolicy, HistoryRead, Since
from realtime_app.wire.names import group_name

__all__ = ["ShardedBackplane", "ShardsOutage", "shard_of"]

logger = logging.getLogger("realtime_app.backplane")

T = TypeVar("T")


def shard_of(channel: str, shards: int) -> int:
    """The shard of ``channel`` among ``shards``: channels-redis' rule, on its group name."""
    if shards == 1:
        return 0
    bits = binascii.crc32(group_name(channel).encode("utf-8")) & 0xFFF
    return int(bits / (4096 / shards))


class ShardsOutage(Outage):
    """The hub's view of the shards' outages: down while any shard is, recovered when one
    comes back. Each shard logs its own edges; this one logs nothing."""

    def __init__(self, shards: list[RedisBackplane]) -> None:
        super().__init__(logger, "backplane shards")
        self.shards = shards
        self._down: set[int] = set()

    @property
    def down(self) -> bool:
        return any(shard.outage.down for shard in self.shards)

    @property
    def outages(self) -> int:
        return sum(shard.outage.outages for shard in self.shards)

    @outages.setter
    def outages(self, value: int) -> None:  # Outage.__init__ sets it
        pass

    def failed(self, exc: BaseException) -> None:
        """Counted by the shard that failed (its calls go through :meth:`ShardedBackplane._on`)."""

    def succeeded(self) -> bool:
        """True once for each shard that came back since the last call: the hub re-asserts."""
        now_down = {i for i, shard in enumerate(self.shards) if shard.outage.down}
        back = bool(self._down - now_down)
        self._down = now_down
        return back


class ShardedBackplane(Backplane):
    """One :class:`RedisBackplane` per shard, each channel routed to its own."""

    clustered = True
    errors = RedisBackplane.errors

    def __init__(
        self,
        *,
        instance_id: str = "headless",
        config: dict[str, Any] | None = None,
        hosts: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(instance_id=instance_id, config=config)
        hosts = shard_hosts(config or {}) if hosts is None else hosts
        self.shards = [RedisBackplane(instance_id=instance_id, config=config, hosts=[host]) for host in hosts]
        for index, shard in enumerate(self.shards):
            shard.outage.what = f"backplane shard {index} ({shard.address})"
            shard.histories = self.histories  # one view: a channel lives on one shard
        self.outage = ShardsOutage(self.shards)
        self.home = self.shards[0]

    def shard(self, channel: str) -> RedisBackplane:
        return self.shards[shard_of(channel, len(self.shards))]

    async def _on(self, shard: RedisBackplane, call: Awaitable[T]) -> T:
        """``call`` on ``shard``, its outage told how it went."""
        try:
            result = await call
        except shard.errors as exc:
            shard.outage.failed(exc)
            raise
        shard.outage.succeeded()
        return result

    def _by_shard(self, channels: list[str]) -> dict[RedisBackplane, list[str]]:
        split: dict[RedisBackplane, list[str]] = {}
        for channel in channels:
            split.setdefault(self.shard(channel), []).append(channel)
        return split

    async def _each(self, work: dict[RedisBackplane, Awaitable[Any]]) -> None:
        """Every shard's part at once; the first failure raised once all have ended (the
        healthy shards' parts are done)."""
        calls = (self._on(shard, part) for shard, part in work.items())
        results = await asyncio.gather(*calls, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    # -- lifecycle ----------------------------------------------------------------

    async def start(self, deliver: Deliver) -> None:
        for shard in self.shards:
            await shard.start(deliver)

    async def stop(self) -> None:
        for shard in self.shards:
            await shard.stop()

    async def check(self) -> bool:
        """Each shard's check at once: False when any lost what it kept for this process
        (the hub re-asserts; what the others keep is asserted again, harmlessly). A shard
        that does not answer is down on its own; this raises only when none answers."""
        results = await asyncio.gather(
            *(self._on(shard, shard.check()) for shard in self.shards), return_exceptions=True
        )
        answered = [r for r in results if not isinstance(r, BaseException)]
        if not answered:
            raise next(r for r in results if isinstance(r, BaseException))
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, self.errors):
                raise result  # a bug, not an outage
        return all(answered)

    # -- channels: on their shard ---------------------------------------------------

    async def join(self, channels: list[str]) -> None:
        await self._each({shard: shard.join(part) for shard, part in self._by_shard(channels).items()})

    async def leave(self, channel: str) -> None:
        shard = self.shard(channel)
        await self._on(shard, shard.leave(channel))

    async def publish(self, channel: str, data_json: str, floor: int = 0, history: HistoryPolicy | None = None) -> int:
        shard = self.shard(channel)
        return await self._on(shard, shard.publish(channel, data_json, floor, history))

    async def history(
        self, channel: str, policy: HistoryPolicy, since: Since | None = None, floor: int = 0
    ) -> HistoryRead:
        shard = self.shard(channel)
        return await self._on(shard, shard.history(channel, policy, since, floor))

    async def history_page(
        self, channel: str, after: int, count: int, max_bytes: int = PAGE_BYTES
    ) -> list[HistoryEntry]:
        shard = self.shard(channel)
        return await self._on(shard, shard.history_page(channel, after, count, max_bytes))

    async def reseed(self, floors: dict[str, int]) -> None:
        parts = self._by_shard(list(floors))
        await self._each({shard: shard.reseed({c: floors[c] for c in part}) for shard, part in parts.items()})

    async def acquire(self, channel: str) -> bool:
        shard = self.shard(channel)
        return await self._on(shard, shard.acquire(channel))

    async def renew(self, channel: str) -> bool:
        shard = self.shard(channel)
        return await self._on(shard, shard.renew(channel))

    async def release(self, channel: str) -> None:
        shard = self.shard(channel)
        await self._on(shard, shard.release(channel))

    # -- the cluster's own state: on the home shard ------------------------------------

    async def put_probe(self, probe: ProcessProbe, ttl_ms: int) -> None:
        await self._on(self.home, self.home.put_probe(probe, ttl_ms))

    async def drop_probe(self) -> None:
        await self._on(self.home, self.home.drop_probe())
        for shard in self.shards[1:]:  # each shard's own sentinel key
            await self._on(shard, shard.drop_alive())

    async def cluster_probes(self) -> list[ProcessProbe]:
        return await self._on(self.home, self.home.cluster_probes())

    async def take_tokens(self, identity: str, cost: float, capacity: float, refill_per_s: float) -> int | None:
        return await self._on(self.home, self.home.take_tokens(identity, cost, capacity, refill_per_s))

    def shards_probe(self) -> list[ShardProbe]:
        """Per shard: its address, up or down, its outages (the probe's ``backplane.shards``)."""
        return [
            {"index": i, "address": shard.address, "up": not shard.outage.down, "outages": shard.outage.outages}
            for i, shard in enumerate(self.shards)
        ]
