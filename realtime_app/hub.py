"""The per-process hub: local subscriptions, one ticker per cadenced channel, fan-out.

Each process keeps, for every channel, the set of its own connections subscribed to it.
At a channel's first local subscriber the process joins the channel's group on the
backplane and, if the channel has a factory, competes for its ticker lease; at the last
it leaves, stops the ticker it held and hands the lease over. Frames arrive once per
process and are fanned out locally, encoded once.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .backplane import FRAME, RELEASED, Backplane, RedisBackplane, make_backplane
from .backpressure import CLOSE, DROP, SEND, Decision
from .conf import get_config
from .guard import Guard
from .protocol import CloseCode
from .registry import ChannelSpec

__all__ = ["Connection", "Hub", "get_hub", "running_hub"]

logger = logging.getLogger("realtime_app.hub")

_connection_ids = itertools.count(1)


@dataclass(eq=False, slots=True)
class Connection:
    """One WebSocket connection as the hub sees it: its guarded transport, its channels."""

    send: Callable[[dict[str, Any]], Any]
    scope: dict[str, Any] = field(default_factory=dict, repr=False)
    id: int = field(default_factory=lambda: next(_connection_ids))
    subscriptions: set[str] = field(default_factory=set)
    closed: bool = False
    guard: Guard = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.guard = Guard(self.send)


@dataclass(slots=True)
class _Ticker:
    spec: ChannelSpec
    cleanup: Callable[[], Any] | None = None


class Hub:
    """Everything one process knows about its connections and channels (one event loop)."""

    def __init__(self) -> None:
        self.instance_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.started_at = _process_start()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.backplane: Backplane | None = None
        self.connections: set[Connection] = set()
        self.subscribers: dict[str, set[Connection]] = {}
        self._wanted: dict[str, ChannelSpec] = {}  # local channels with a ticker to run
        self._held: dict[str, _Ticker] = {}  # tickers this process runs
        self._failed: set[str] = set()  # factories that raised (logged once)
        self._locks: dict[str, asyncio.Lock] = {}
        self._pending: dict[str, Any] = {}  # latest unpublished value per ticker channel
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._start_lock = asyncio.Lock()
        self._started = False
        self._thread_id = threading.get_ident()
        self._background: set[asyncio.Task[Any]] = set()
        self.published = 0
        self.drops = 0  # frames refused by the guard, cumulative
        self.closes = 0  # connections closed with 1013 by the guard

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Connect to the backplane and start the background loops (idempotent)."""
        async with self._start_lock:
            if self._started:
                return
            self.loop = asyncio.get_running_loop()
            self._thread_id = threading.get_ident()
            self.backplane = make_backplane(self)
            await self.backplane.start()
            self._tasks.append(self.loop.create_task(self._publisher(), name="realtime-publisher"))
            self._tasks.append(self.loop.create_task(self._maintain(), name="realtime-maintain"))
            if isinstance(self.backplane, RedisBackplane):
                self._tasks.append(self.loop.create_task(self._receive(), name="realtime-receive"))
            self._started = True
            logger.info("hub %s started on %s", self.instance_id, type(self.backplane).__name__)

    async def aclose(self) -> None:
        """Stop tickers, hand leases over, leave groups and stop the loops."""
        if not self._started:
            return
        self._started = False
        for conn in list(self.connections):
            await self.remove_connection(conn)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        assert self.backplane is not None
        if isinstance(self.backplane, RedisBackplane):
            with contextlib.suppress(Exception):
                await self.backplane.drop_probe()
        await self.backplane.stop()

    # -- connections and subscriptions --------------------------------------------------

    def add_connection(self, conn: Connection) -> None:
        self.connections.add(conn)

    async def remove_connection(self, conn: Connection) -> None:
        """Forget a connection and everything it subscribed (disconnect without unsubscribe)."""
        conn.closed = True
        for channel in list(conn.subscriptions):
            await self.unsubscribe(conn, channel)
        self.connections.discard(conn)

    def _lock(self, channel: str) -> asyncio.Lock:
        lock = self._locks.get(channel)
        if lock is None:
            lock = self._locks[channel] = asyncio.Lock()
        return lock

    async def subscribe(self, conn: Connection, spec: ChannelSpec) -> bool:
        """Add ``conn`` to ``spec``'s subscribers; False if it already was one."""
        channel = spec.name
        async with self._lock(channel):
            if conn.closed or channel in conn.subscriptions:
                return False
            subs = self.subscribers.get(channel)
            if subs is None:
                await self._activate(spec)
                subs = self.subscribers[channel] = set()
            subs.add(conn)
            conn.subscriptions.add(channel)
            return True

    async def unsubscribe(self, conn: Connection, channel: str) -> bool:
        """Remove ``conn`` from ``channel``; the last one out stops what the channel held."""
        async with self._lock(channel):
            if channel not in conn.subscriptions:
                return False
            conn.subscriptions.discard(channel)
            subs = self.subscribers.get(channel)
            if subs is not None:
                subs.discard(conn)
                if not subs:
                    del self.subscribers[channel]
                    await self._deactivate(channel)
        if channel not in self.subscribers and not self._lock(channel).locked():
            self._locks.pop(channel, None)
        return True

    async def _activate(self, spec: ChannelSpec) -> None:
        assert self.backplane is not None
        await self.backplane.join(spec.name)
        if spec.has_ticker:
            self._wanted[spec.name] = spec
            await self._try_acquire(spec.name)

    async def _deactivate(self, channel: str) -> None:
        assert self.backplane is not None
        self._wanted.pop(channel, None)
        self._failed.discard(channel)
        if channel in self._held:
            await self._stop_ticker(channel)
            await self.backplane.release(channel)
        await self.backplane.leave(channel)

    # -- tickers -----------------------------------------------------------------------

    async def _try_acquire(self, channel: str) -> None:
        assert self.backplane is not None
        spec = self._wanted.get(channel)
        if spec is None or channel in self._held:
            return
        if await self.backplane.acquire(channel):
            if channel in self._wanted and channel not in self._held:
                await self._start_ticker(spec)
            else:  # everyone left while we were asking
                await self.backplane.release(channel)

    async def _start_ticker(self, spec: ChannelSpec) -> None:
        assert spec.factory is not None
        ticker = self._held[spec.name] = _Ticker(spec)
        try:
            result = spec.factory(spec, self._publisher_for(spec.name))
            if inspect.isawaitable(result):
                result = await result
        except Exception:
            if spec.name not in self._failed:
                logger.exception("factory of %s failed; retrying at each lease period", spec.name)
                self._failed.add(spec.name)
            del self._held[spec.name]
            assert self.backplane is not None
            await self.backplane.release(spec.name)
            return
        self._failed.discard(spec.name)
        cleanup = result if callable(result) else None
        if self._held.get(spec.name) is not ticker:  # stopped while the factory ran
            if cleanup is not None:
                maybe = cleanup()
                if inspect.isawaitable(maybe):
                    await maybe
            return
        ticker.cleanup = cleanup
        logger.debug("ticker %s started on %s", spec.name, self.instance_id)

    async def _stop_ticker(self, channel: str) -> None:
        ticker = self._held.pop(channel, None)
        self._pending.pop(channel, None)
        if ticker is None or ticker.cleanup is None:
            return
        try:
            result = ticker.cleanup()
            if inspect.isawaitable(result):
                await result
        except Exception:
            logger.exception("cleanup of %s failed", channel)

    def _publisher_for(self, channel: str) -> Callable[[Any], None]:
        """The ``publish(data)`` handed to a factory: latest value wins, thread-safe."""

        def publish(data: Any) -> None:
            if threading.get_ident() != self._thread_id:
                assert self.loop is not None
                self.loop.call_soon_threadsafe(publish, data)
                return
            if channel in self._held:
                self._pending[channel] = data
                self._wake.set()

        return publish

    async def _publisher(self) -> None:
        assert self.backplane is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                channel = next(iter(self._pending))
                data = self._pending.pop(channel)
                try:
                    await self.backplane.publish(channel, data)
                    self.published += 1
                except Exception:
                    logger.exception("publication on %s failed", channel)

    async def _maintain(self) -> None:
        """Renew held leases, compete for orphaned ones, publish the probe."""
        config = get_config()
        period = config["LEASE_TTL_MS"] / 3000
        probe_every = max(1, round(config["PROBE_TTL_MS"] / 3 / (period * 1000)))
        assert self.backplane is not None
        for beat in itertools.count():
            try:
                for channel in list(self._held):
                    if not await self.backplane.renew(channel):
                        logger.warning("lost the lease of %s; stopping its ticker", channel)
                        await self._stop_ticker(channel)
                for channel in list(self._wanted):
                    if channel not in self._held:
                        await self._try_acquire(channel)
                if beat % probe_every == 0:
                    await self.backplane.put_probe(self.probe(), config["PROBE_TTL_MS"])
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("hub maintenance failed; retrying")
            await asyncio.sleep(period)

    # -- delivery ----------------------------------------------------------------------

    async def _receive(self) -> None:
        backplane = self.backplane
        assert isinstance(backplane, RedisBackplane)
        while True:
            try:
                message = await backplane.receive()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("backplane receive failed; retrying")
                await asyncio.sleep(0.5)
                continue
            kind = message.get("type")
            if kind == FRAME:
                await self.fanout(message["channel"], message["text"])
            elif kind == RELEASED and message.get("by") != self.instance_id:
                channel = message["channel"]
                if channel in self._wanted and channel not in self._held:
                    self.loop.create_task(self._try_acquire(channel))  # type: ignore[union-attr]

    async def fanout(self, channel: str, text: str) -> None:
        """Hand one encoded frame to every local subscriber of ``channel``, guarded."""
        subs = self.subscribers.get(channel)
        if not subs:
            return
        payload = text.encode("utf-8")  # once per publication, not per subscriber
        for conn in tuple(subs):
            decision = conn.guard.send(payload)
            if decision is not SEND:
                self._account(conn, decision)

    def send_to(self, conn: Connection, text: str, *, response: bool = False) -> Decision:
        """Send one frame to one connection through its guard (RPC responses, errors)."""
        decision = conn.guard.send(text.encode("utf-8"), response=response)
        if decision is not SEND:
            self._account(conn, decision)
        return decision

    def _account(self, conn: Connection, decision: Decision) -> None:
        if decision is DROP:
            self.drops += 1
        elif decision is CLOSE and not conn.closed:
            self.closes += 1
            logger.warning(
                "connection %s closed with %s: backpressure (%s bytes queued, %s drops)",
                conn.id,
                int(CloseCode.TRY_AGAIN_LATER),
                conn.guard.buffered(),
                conn.guard.state.drops,
            )
            self.forget(conn)

    def forget(self, conn: Connection) -> None:
        """Release a connection's subscriptions now, from synchronous code."""
        conn.closed = True
        assert self.loop is not None
        task = self.loop.create_task(self.remove_connection(conn))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def publish(self, channel: str, data: Any) -> int:
        """Publish one message on ``channel`` from application code; returns its ``seq``."""
        if not self._started:
            await self.start()
        assert self.backplane is not None
        seq = await self.backplane.publish(channel, data)
        self.published += 1
        return seq

    # -- probe -------------------------------------------------------------------------

    def backpressure_probe(self) -> dict[str, int]:
        """Queued bytes per connection, read now from the transports (no decision taken)."""
        slow = get_config()["SLOW_CONSUMER_BYTES"]
        worst = total = slow_count = balance = 0
        for conn in self.connections:
            queued = conn.guard.buffered()
            total += queued
            worst = max(worst, queued)
            balance = max(balance, conn.guard.state.balance)
            if slow and queued >= slow:
                slow_count += 1
        return {
            "max_buffered_amount": worst,
            "max_drop_balance": balance,
            "total_buffered_amount": total,
            "slow_consumers": slow_count,
            "drops": self.drops,
            "closes": self.closes,
        }

    def probe(self) -> dict[str, Any]:
        """This process's counters (no decision is taken from them)."""
        return {
            "instance": self.instance_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started_at, 3),
            "connections": len(self.connections),
            "subscriptions": sum(len(s) for s in self.subscribers.values()),
            "channels": {name: len(subs) for name, subs in self.subscribers.items()},
            "tickers": sorted(self._held),
            "published": self.published,
            "backpressure": self.backpressure_probe(),
        }

    async def cluster_probes(self) -> list[dict[str, Any]]:
        """Every live process's probe, this one's fresh."""
        assert self.backplane is not None
        others = [p for p in await self.backplane.cluster_probes() if p.get("instance") != self.instance_id]
        return [self.probe(), *others]


def _process_start() -> float:
    """When this process started (uptime is the process's, not the hub's)."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:
        return time.time()


_hubs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Hub] = weakref.WeakKeyDictionary()


async def get_hub() -> Hub:
    """The started hub of the running event loop (created on first use)."""
    loop = asyncio.get_running_loop()
    hub = _hubs.get(loop)
    if hub is None:
        hub = _hubs[loop] = Hub()
    if not hub._started:
        await hub.start()
    return hub


def running_hub() -> Hub | None:
    """A started hub of this process on another live loop, for publishing from threads."""
    for loop, hub in list(_hubs.items()):
        if hub._started and loop.is_running() and not loop.is_closed():
            return hub
    return None


def hub_of_current_loop() -> Hub | None:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    hub = _hubs.get(loop)
    return hub if hub is not None and hub._started else None
