"""Carrying out the reconciler's actions on the backplane, and the maintenance beat.

Each channel's actions run one at a time under the channel's lock until the reconciler
has nothing left to do or the backplane fails (then the next beat retries). The beat
notices lost backplane state, renews, competes, retries and re-asserts (the rule is
:class:`~realtime_app.hub.beat.BeatRule`), and writes this process's probe.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any, Protocol

from realtime_app.cluster.roles import BrokerAndLeases
from realtime_app.conf import beat_period_s
from realtime_app.conf.runtime import settings
from realtime_app.declarations.registry import FED_PREFIX
from realtime_app.hub.beat import BeatRule
from realtime_app.hub.connections import Connection
from realtime_app.hub.fed import FedStates
from realtime_app.hub.reconciler import REMOTE, Action, Reconciler
from realtime_app.hub.tickers import Tickers
from realtime_app.observability.logsafe import safe

#: Channels joined in one call of a re-assert.
JOIN_BATCH = 500

__all__ = ["Convergence"]

logger = logging.getLogger("realtime_app.hub")


class Member(Protocol):
    """What convergence needs of the hub: its reconciler, tickers, channels and probe."""

    @property
    def backplane(self) -> BrokerAndLeases | None: ...

    reconciler: Reconciler
    tickers: Tickers
    subscribers: dict[str, set[Connection]]
    last_seq: dict[str, int]
    fed: FedStates

    def probe(self) -> Any: ...


class Convergence:
    """One lock per channel with a converge holding or awaiting it; the beat's rule."""

    def __init__(self, hub: Member) -> None:
        self.hub = hub
        self.rule = BeatRule()
        self._locks: dict[str, asyncio.Lock] = {}
        self._lock_users: dict[str, int] = {}  # converges holding or awaiting each lock

    async def converge(self, channel: str) -> None:
        """Carry out the channel's actions until it is settled or the backplane fails.
        Never raises: what failed is retried at the next beat."""
        backplane = self.hub.backplane
        assert backplane is not None
        lock = self._locks.get(channel)
        if lock is None:
            lock = self._locks[channel] = asyncio.Lock()
        self._lock_users[channel] = self._lock_users.get(channel, 0) + 1
        try:
            await self._converge_locked(channel, lock, backplane)
        finally:
            # A lock is forgotten only when nobody holds or awaits it (``locked()`` is
            # already False while waiters queue): else two converges would run at once.
            users = self._lock_users[channel] - 1
            if users:
                self._lock_users[channel] = users
            else:
                del self._lock_users[channel]
                if channel not in self.hub.reconciler.channels:
                    self._locks.pop(channel, None)

    async def _converge_locked(self, channel: str, lock: asyncio.Lock, backplane: BrokerAndLeases) -> None:
        reconciler = self.hub.reconciler
        async with lock:
            for _ in range(16):  # a settled channel needs at most a handful
                action = reconciler.next_action(channel)
                if action is None:
                    break
                try:
                    ok = await self._carry_out(channel, action, backplane)
                except asyncio.CancelledError:
                    raise
                except backplane.errors as exc:
                    backplane.outage.failed(exc)
                    reconciler.failed(channel, action)
                    break
                except Exception:
                    logger.exception("%s of %s failed", action.value, safe(channel))
                    reconciler.failed(channel, action)
                    break
                if action in REMOTE:
                    self.rule.answered(recovered=backplane.outage.succeeded())
                reconciler.done(channel, action, ok, time.monotonic())

    async def _carry_out(self, channel: str, action: Action, backplane: BrokerAndLeases) -> bool:
        if action is Action.JOIN:
            await backplane.join([channel])
            if channel.startswith(FED_PREFIX):  # what was set while this process was not listening
                await self.hub.fed.resync(channel[len(FED_PREFIX) :])
            return True
        if action is Action.LEAVE:
            await backplane.leave(channel)
            return True
        if action is Action.ACQUIRE:
            return await backplane.acquire(channel)
        if action is Action.RENEW:
            held = await backplane.renew(channel)
            if not held:
                logger.warning("lost the lease of %s; stopping its ticker", safe(channel))
            return held
        if action is Action.RELEASE:
            await backplane.release(channel)
            return True
        if action is Action.START:
            return await self.hub.tickers.start(channel)
        await self.hub.tickers.stop(channel)
        return True

    async def converge_all(self, channels: list[str]) -> None:
        """Converge many channels, a bounded number at a time, each under its own lock.
        The joins of a re-assert go first, :data:`JOIN_BATCH` channels a call (one
        SUBSCRIBE, not one call and one wake-up per channel: 20,000 rooms re-joined one
        by one cost 3 s of a core every ``REASSERT_INTERVAL_MS``)."""
        await self._join_batches(channels)
        reconciler = self.hub.reconciler
        slots = asyncio.Semaphore(max(1, settings().publish_concurrency))

        async def one(channel: str) -> None:
            async with slots:
                await self.converge(channel)

        await asyncio.gather(*(one(c) for c in channels if reconciler.next_action(c) is not None))

    async def _join_batches(self, channels: list[str]) -> None:
        reconciler, backplane = self.hub.reconciler, self.hub.backplane
        assert backplane is not None
        joining = [
            c
            for c in channels
            if reconciler.next_action(c) is Action.JOIN and c not in self._lock_users and not c.startswith(FED_PREFIX)
        ]
        for start in range(0, len(joining), JOIN_BATCH):
            batch = [  # asked again: a channel left or being converged meanwhile is not joined here
                c
                for c in joining[start : start + JOIN_BATCH]
                if reconciler.next_action(c) is Action.JOIN and c not in self._lock_users
            ]
            if not batch:
                continue
            try:
                await backplane.join(batch)
            except backplane.errors as exc:
                backplane.outage.failed(exc)
                for channel in batch:
                    reconciler.failed(channel, Action.JOIN)
                return
            self.rule.answered(recovered=backplane.outage.succeeded())
            for channel in batch:
                if reconciler.next_action(channel) is Action.JOIN:  # else converged meanwhile
                    reconciler.done(channel, Action.JOIN, True)

    async def maintain(self) -> None:
        """The beat, every third of a lease TTL; the probe every third of its TTL."""
        config = settings()
        period = beat_period_s(config.lease_ttl_ms)
        probe_every = max(1, round(config.probe_ttl_ms / 3 / (period * 1000)))
        backplane = self.hub.backplane
        assert backplane is not None
        for beat in itertools.count():
            try:
                await self.beat(backplane)
                if beat % probe_every == 0:
                    await backplane.put_probe(self.hub.probe(), config.probe_ttl_ms)
            except asyncio.CancelledError:
                raise
            except backplane.errors as exc:
                backplane.outage.failed(exc)
            except Exception:
                logger.exception("hub maintenance failed; retrying")
            await asyncio.sleep(period)

    async def beat(self, backplane: BrokerAndLeases) -> None:
        """One beat: check the backplane, then renew, compete, retry — re-asserting
        everything when :class:`BeatRule` says the backplane may have lost it."""
        period = beat_period_s(settings().lease_ttl_ms)
        unreachable: tuple[type[BaseException], ...] = (*backplane.errors, TimeoutError)
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that
            # lands as check() returns, and the beat then outlives aclose() forever.
            async with asyncio.timeout(max(period, 0.5)):
                intact = await backplane.check()
        except unreachable as exc:
            if self.rule.unreachable(timed_out=isinstance(exc, TimeoutError)):
                backplane.outage.failed(exc)
            return
        hub = self.hub
        reassert = self.rule.reached(recovered=backplane.outage.succeeded(), intact=intact)
        hub.reconciler.beat(reassert=reassert)
        if reassert:
            await backplane.reseed({c: s for c, s in hub.last_seq.items() if c in hub.subscribers})
        await self.converge_all(list(hub.reconciler.pending()))
