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
import contextlib
import logging
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

from realtime_app.cancellation import uninterrupted
from realtime_app.cluster.base import Backplane, Deliver
from realtime_app.cluster.hosts import ClientClosed, shard_hosts
from realtime_app.cluster.redis import RedisBackplane
from realtime_app.declarations.registry import FED_PREFIX, RESERVED
from realtime_app.observability.logsafe import Outage
from realtime_app.observability.schema import ProcessProbe, ShardProbe
from realtime_app.wire.history import PAGE_BYTES, HistoryEntry, HistoryPolicy, HistoryRead, Since
from realtime_app.wire.names import group_name

__all__ = ["ShardStopped", "ShardUnavailable", "ShardedBackplane", "ShardsOutage", "shard_of"]

logger = logging.getLogger("realtime_app.backplane")

T = TypeVar("T")


def shard_of(channel: str, shards: int) -> int:
    """The shard of ``channel`` among ``shards``: channels-redis' rule, on its group name.
    An app-fed family's value lives on the shard of the family's base channel."""
    if shards == 1:
        return 0
    channel = channel.removeprefix(FED_PREFIX)
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


class ShardUnavailable(ConnectionError):
    """A call to a shard whose last check failed: refused at once, not after a timeout."""


class ShardStopped(ShardUnavailable):
    """A call on a shard stopped meanwhile: never sent (a cluster makes it on the new map)."""


class ShardedBackplane(Backplane):
    """One :class:`RedisBackplane` per shard, each channel routed to its own.

    One shard never holds the others up. Each beat checks every shard at once, each within
    a bound below the beat; a shard that fails its check (or any call) is *stalled* until
    a check answers again, and the maintenance calls of its channels (join, renew,
    acquire, release, reseed) fail at once meanwhile instead of waiting out a timeout, so
    the beat goes on renewing the healthy shards' leases. A shard that cannot be reached
    when the process starts is started by a later check.
    """

    clustered = True
    errors = RedisBackplane.errors
    #: Errors of a shard that answered: not an outage (a Redis Cluster's ``MOVED``).
    not_outages: tuple[type[BaseException], ...] = ()

    home: RedisBackplane

    def __init__(
        self,
        *,
        instance_id: str = "headless",
        config: dict[str, Any] | None = None,
        hosts: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(instance_id=instance_id, config=config)
        from realtime_app.conf import beat_period_s, with_defaults

        settings = with_defaults(config)
        hosts = shard_hosts(settings) if hosts is None else hosts
        self.shards = [RedisBackplane(instance_id=instance_id, config=config, hosts=[host]) for host in hosts]
        for index, shard in enumerate(self.shards):
            shard.outage.what = f"backplane shard {index} ({shard.address})"
            shard.histories = self.histories  # one view: a channel lives on one shard
        self.outage = ShardsOutage(self.shards)
        if self.shards:  # (a Redis Cluster's are found when it is first used)
            self.home = self.shards[0]
        #: A maintenance call's bound: within the beat's own bound on its check (the beat is
        #: a third of the lease TTL; hub.convergence.beat), so that a shard that hangs costs
        #: the beat no more than that.
        beat_s = max(beat_period_s(settings["LEASE_TTL_MS"]), 0.5)
        self.beat_call_s = min(settings["REDIS_TIMEOUT_MS"] / 1000, beat_s * 0.8)
        self.stalled: set[RedisBackplane] = set()  # failed since their last good check
        self._unstarted: set[RedisBackplane] = set()
        self._deliver: Deliver | None = None

    def shard(self, channel: str) -> RedisBackplane:
        """The shard of ``channel``; the hub's own control channel lives on the home shard."""
        if channel == RESERVED:
            return self.home
        return self.shards[shard_of(channel, len(self.shards))]

    async def _on(self, shard: RedisBackplane, call: Awaitable[T], bound: float | None = None) -> T:
        """``call`` on ``shard`` (within ``bound`` seconds), its outage told how it went."""
        try:
            result = await (asyncio.wait_for(call, bound) if bound else call)
        except self.not_outages:
            raise
        except ClientClosed as exc:  # stopped meanwhile (dropped from a cluster's map): never sent
            raise ShardStopped(f"backplane shard {shard.address} was stopped") from exc
        except shard.errors as exc:
            shard.outage.failed(exc)
            if not shard.outage.stopped:  # (a shard stopped meanwhile is no longer checked: never stalled)
                self.stalled.add(shard)
            raise
        shard.outage.succeeded()
        return result

    def _refuse_if_stalled(self, shard: RedisBackplane, call: Coroutine[Any, Any, Any]) -> None:
        if shard in self.stalled or shard in self._unstarted:
            call.close()
            raise ShardUnavailable(f"backplane shard {self.shards.index(shard)} ({shard.address}) is not answering")

    async def _call(self, shard: RedisBackplane, call: Coroutine[Any, Any, T]) -> T:
        """A call on the way of a request or a publication: refused at once on a stalled
        shard (the caller hears that the backplane is unavailable), else as Redis answers."""
        self._refuse_if_stalled(shard, call)
        return await self._on(shard, call)

    async def _beat_call(self, shard: RedisBackplane, call: Coroutine[Any, Any, T]) -> T:
        """A maintenance call: refused at once on a stalled shard, else bounded."""
        self._refuse_if_stalled(shard, call)
        return await self._on(shard, call, self.beat_call_s)

    def _by_shard(self, channels: list[str]) -> dict[RedisBackplane, list[str]]:
        split: dict[RedisBackplane, list[str]] = {}
        for channel in channels:
            split.setdefault(self.shard(channel), []).append(channel)
        return split

    async def _each(self, work: dict[RedisBackplane, Coroutine[Any, Any, Any]]) -> None:
        """Every shard's part at once; the first failure raised once all have ended (the
        healthy shards' parts are done)."""
        results = await asyncio.gather(
            *(self._beat_call(shard, part) for shard, part in work.items()), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    # -- lifecycle ----------------------------------------------------------------

    async def start(self, deliver: Deliver) -> None:
        """Start every shard that answers; the others start at a later check. Raises only
        when none does (the caller stops what was opened, as after any failed start)."""
        self._deliver = deliver
        self._unstarted = set(self.shards)
        starts = (self._on(shard, self._start(shard), self.beat_call_s) for shard in self.shards)
        results = await asyncio.gather(*starts, return_exceptions=True)
        if all(isinstance(r, BaseException) for r in results):
            raise next(r for r in results if isinstance(r, BaseException))

    async def _start(self, shard: RedisBackplane) -> None:
        assert self._deliver is not None
        await shard.start(self._deliver)
        self._unstarted.discard(shard)

    async def stop(self) -> None:
        """Every shard stopped, even when the caller is cancelled meanwhile (a shard's stop
        cancelled before its first step would never close its connections)."""
        await uninterrupted(asyncio.gather(*(shard.stop() for shard in self.shards), return_exceptions=True))

    async def check(self) -> bool:
        """Each shard's check at once, each within its bound: False when any lost what it
        kept for this process, or came back (the hub re-asserts; what the others keep is
        asserted again, harmlessly). A shard that does not answer is stalled on its own;
        this raises only when none answers."""

        async def work(shard: RedisBackplane) -> bool:
            if shard in self._unstarted:
                await self._start(shard)
            return await shard.check()

        async def one(shard: RedisBackplane) -> bool:
            intact = await self._on(shard, work(shard), self.beat_call_s)
            back = shard in self.stalled
            self.stalled.discard(shard)
            return intact and not back

        results = await asyncio.gather(*(one(shard) for shard in self.shards), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, self.errors):
                raise result  # a bug, not an outage
        answered = [r for r in results if not isinstance(r, BaseException)]
        if not answered:
            raise next(r for r in results if isinstance(r, BaseException))
        return all(answered)

    # -- channels: on their shard ---------------------------------------------------

    async def join(self, channels: list[str]) -> None:
        await self._each({shard: shard.join(part) for shard, part in self._by_shard(channels).items()})

    async def leave(self, channel: str) -> None:
        shard = self.shard(channel)
        await self._beat_call(shard, shard.leave(channel))

    async def publish(self, channel: str, data_json: str, floor: int = 0, history: HistoryPolicy | None = None) -> int:
        shard = self.shard(channel)
        return await self._call(shard, shard.publish(channel, data_json, floor, history))

    async def history(
        self, channel: str, policy: HistoryPolicy, since: Since | None = None, floor: int = 0
    ) -> HistoryRead:
        shard = self.shard(channel)
        return await self._call(shard, shard.history(channel, policy, since, floor))

    async def history_page(
        self, channel: str, after: int, count: int, max_bytes: int = PAGE_BYTES
    ) -> list[HistoryEntry]:
        shard = self.shard(channel)
        return await self._call(shard, shard.history_page(channel, after, count, max_bytes))

    async def reseed(self, floors: dict[str, int]) -> None:
        """Each answering shard's channels; a stalled shard's wait for its return (the
        re-assert that follows it reseeds them), so that the beat goes on for the others."""
        parts = {s: part for s, part in self._by_shard(list(floors)).items() if s not in self.stalled}
        with contextlib.suppress(*self.errors):  # counted as that shard's failure
            await self._each({shard: shard.reseed({c: floors[c] for c in part}) for shard, part in parts.items()})

    async def acquire(self, channel: str) -> bool:
        shard = self.shard(channel)
        return await self._beat_call(shard, shard.acquire(channel))

    async def renew(self, channel: str) -> bool:
        shard = self.shard(channel)
        return await self._beat_call(shard, shard.renew(channel))

    async def release(self, channel: str) -> None:
        shard = self.shard(channel)
        await self._beat_call(shard, shard.release(channel))

    async def put_presence(self, parts: dict[str, str | None], ttl_ms: int, alive: bool = False) -> None:
        split = self._by_shard(list(parts))
        await self._each({s: s.put_presence({c: parts[c] for c in part}, ttl_ms, alive) for s, part in split.items()})

    async def presence_alive(self, ttl_ms: int) -> tuple[int, bool] | None:
        """Marked on every shard (each reads its own); not intact when one had lost it."""
        marks = await asyncio.gather(*(s.presence_alive(ttl_ms) for s in self.shards))
        if any(mark is None for mark in marks):
            return None
        return min(m[0] for m in marks if m), all(m[1] for m in marks if m)

    async def read_presence(self, known: dict[str, str]) -> dict[str, tuple[str, list[str]] | None]:
        """Each answering shard's channels (a stalled shard's are read again at the next turn)."""
        split = self._by_shard(list(known))
        results = await asyncio.gather(
            *(self._beat_call(s, s.read_presence({c: known[c] for c in part})) for s, part in split.items()),
            return_exceptions=True,
        )
        out: dict[str, tuple[str, list[str]] | None] = {}
        for result in results:
            if isinstance(result, dict):
                out.update(result)
        return out

    # -- the cluster's own state: on the home shard ------------------------------------

    async def put_probe(self, probe: ProcessProbe, ttl_ms: int) -> None:
        await self._beat_call(self.home, self.home.put_probe(probe, ttl_ms))

    async def drop_probe(self) -> None:
        """The probe from the home shard, the sentinel key from every shard, at once."""
        calls = [self._on(self.home, self.home.drop_probe(), self.beat_call_s)]
        others = [shard for shard in self.shards if shard is not self.home]
        calls += [self._on(shard, shard.drop_alive(), self.beat_call_s) for shard in others]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def cluster_probes(self) -> list[ProcessProbe]:
        return await self._call(self.home, self.home.cluster_probes())

    async def take_tokens(self, identity: str, cost: float, capacity: float, refill_per_s: float) -> int | None:
        return await self._call(self.home, self.home.take_tokens(identity, cost, capacity, refill_per_s))

    async def publish_once(
        self, channel: str, data_json: str, floor: int, history: HistoryPolicy, key: str, window_ms: int
    ) -> int | None:
        shard = self.shard(channel)
        return await self._call(shard, shard.publish_once(channel, data_json, floor, history, key, window_ms))

    async def claim_once(self, name: str, owner: str, ttl_ms: int) -> tuple[Any, str | None]:
        shard = self.shard(name)
        return await self._call(shard, shard.claim_once(name, owner, ttl_ms))

    async def keep_once(self, name: str, owner: str, answer: str, ttl_ms: int) -> None:
        shard = self.shard(name)
        await self._call(shard, shard.keep_once(name, owner, answer, ttl_ms))

    async def renew_once(self, name: str, owner: str, ttl_ms: int) -> None:
        shard = self.shard(name)
        await self._call(shard, shard.renew_once(name, owner, ttl_ms))

    def shards_probe(self) -> list[ShardProbe]:
        """Per shard: its address, up or down, its outages (the probe's ``backplane.shards``)."""
        return [
            {"index": i, "address": shard.address, "up": not shard.outage.down, "outages": shard.outage.outages}
            for i, shard in enumerate(self.shards)
        ]
