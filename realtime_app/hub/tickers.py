"""Tickers: the channels whose values a factory produces in the process that holds the
channel's lease.

Whether a ticker runs here is the reconciler's ``running`` (one record of it). What a
started ticker owns — its cleanup, its latest unpublished value, whether it is failing —
is kept by :class:`TickerBook`, a pure state machine; :class:`Tickers` calls the
factories and cleanups and publishes the values, latest value wins, channels never
waiting behind each other.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from realtime_app.cluster.roles import Reachable
from realtime_app.conf.runtime import settings
from realtime_app.declarations.registry import ChannelSpec
from realtime_app.exceptions import BackplaneUnavailable, PublicationError
from realtime_app.hub.fed import FedStates
from realtime_app.hub.reconciler import Reconciler
from realtime_app.observability.logsafe import safe

__all__ = ["MISSING", "TickerBook", "TickerPublish", "Tickers"]

logger = logging.getLogger("realtime_app.hub")

#: What :meth:`TickerBook.take` returns when there is no value to publish.
MISSING: Any = object()


@dataclass(slots=True)
class _Ticker:
    cleanup: Callable[[], Any] | None = None
    pending: Any = MISSING  # the latest value not yet handed to the publisher
    started: bool = False  # False while its factory runs


class TickerBook:
    """What each ticker of this process owns, from the call of its factory until its
    cleanup: a value offered to a channel without a ticker is refused, a stop gives the
    cleanup back exactly once and forgets the pending value. ``failing`` holds the
    channels whose factory or publications fail (shown by the probe, logged once)."""

    def __init__(self) -> None:
        self.tickers: dict[str, _Ticker] = {}
        self.failing: set[str] = set()

    def starting(self, channel: str) -> None:
        """Its factory is about to be called (it may publish before it returns)."""
        self.tickers[channel] = _Ticker()

    def started(self, channel: str, cleanup: Callable[[], Any] | None) -> None:
        ticker = self.tickers.get(channel)
        if ticker is not None:
            ticker.cleanup, ticker.started = cleanup, True
            self.failing.discard(channel)

    def stop(self, channel: str) -> Callable[[], Any] | None:
        """Forget the ticker (its factory failed, was cancelled, or it stops): the cleanup
        to call, once."""
        self.failing.discard(channel)
        ticker = self.tickers.pop(channel, None)
        return ticker.cleanup if ticker is not None else None

    def offer(self, channel: str, data: Any) -> bool:
        """A value from the factory: kept (latest wins) while the ticker lives."""
        ticker = self.tickers.get(channel)
        if ticker is None:
            return False
        ticker.pending = data
        return True

    def take(self, channel: str) -> Any:
        """The pending value of ``channel`` (:data:`MISSING` when there is none)."""
        ticker = self.tickers.get(channel)
        if ticker is None:
            return MISSING
        data, ticker.pending = ticker.pending, MISSING
        return data

    def pending(self) -> list[str]:
        return [name for name, ticker in self.tickers.items() if ticker.pending is not MISSING]

    def has_pending(self, channel: str) -> bool:
        ticker = self.tickers.get(channel)
        return ticker is not None and ticker.pending is not MISSING

    def fail(self, channel: str) -> bool:
        """Mark ``channel`` failing; True the first time (log it then, not at every tick)."""
        if channel in self.failing:
            return False
        self.failing.add(channel)
        return True


class TickerPublish:
    """``publish(data)`` of one ticker channel (latest value wins, callable from any thread);
    ``publish.failed(exc)`` marks the ticker failing in the probe until the next value."""

    __slots__ = ("channel", "tickers")

    def __init__(self, tickers: Tickers, channel: str) -> None:
        self.tickers = tickers
        self.channel = channel

    def __call__(self, data: Any) -> None:
        self._on_loop(self.tickers.offer, data)

    def failed(self, exc: BaseException) -> None:
        self._on_loop(self.tickers.tick_failed)

    def _on_loop(self, method: Callable[..., None], *args: Any) -> None:
        hub = self.tickers.hub
        if threading.get_ident() != hub.thread_id:
            assert hub.loop is not None
            hub.loop.call_soon_threadsafe(method, self.channel, *args)
        else:
            method(self.channel, *args)


class Publisher(Protocol):
    """What tickers need of the hub: the channels, the lease, the loop, publishing."""

    instance_id: str
    loop: asyncio.AbstractEventLoop | None
    thread_id: int

    @property
    def backplane(self) -> Reachable | None: ...

    reconciler: Reconciler
    specs: dict[str, ChannelSpec]
    fed: FedStates

    async def publish(self, channel: str, data: Any) -> int: ...


class Tickers:
    """Starts and stops this process's tickers and publishes their values."""

    def __init__(self, hub: Publisher) -> None:
        self.hub = hub
        self.book = TickerBook()
        self.stale_ticks = 0  # ticks not published: the lease could not be renewed in time
        self._in_flight: set[str] = set()
        self._wake = asyncio.Event()

    async def start(self, channel: str) -> bool:
        """Call the channel's factory (or pace an app-fed cadence); False (and logged
        once) when it fails."""
        spec = self.hub.specs.get(channel)
        if spec is None or not spec.has_ticker:
            return False
        book = self.book
        book.starting(channel)
        try:
            if spec.factory is None:
                result: Any = self.hub.fed.start(spec, TickerPublish(self, channel))
            else:
                result = spec.factory(spec, TickerPublish(self, channel))
            if inspect.isawaitable(result):
                result = await result
        except asyncio.CancelledError:
            book.stop(channel)
            raise
        except Exception:
            book.stop(channel)
            if book.fail(channel):
                logger.exception("factory of %s failed; retrying at each beat", safe(channel))
            return False
        book.started(channel, result if callable(result) else None)
        logger.debug("ticker %s started on %s", channel, self.hub.instance_id)
        return True

    async def stop(self, channel: str) -> None:
        cleanup = self.book.stop(channel)
        if cleanup is None:
            return
        try:
            result = cleanup()
            if inspect.isawaitable(result):
                await result
        except Exception:
            logger.exception("cleanup of %s failed", safe(channel))

    def offer(self, channel: str, data: Any) -> None:
        if self.book.offer(channel, data):
            self._wake.set()

    def tick_failed(self, channel: str) -> None:
        if channel in self.book.tickers:
            self.book.fail(channel)  # shown by the probe until a tick succeeds

    async def publisher(self) -> None:
        """Send tickers' latest values; channels never wait behind each other."""
        slots = asyncio.Semaphore(max(1, settings().publish_concurrency))
        while True:
            await self._wake.wait()
            self._wake.clear()
            for channel in [c for c in self.book.pending() if c not in self._in_flight]:
                await slots.acquire()
                data = self.book.take(channel)
                if data is MISSING:
                    slots.release()
                    continue
                self._in_flight.add(channel)
                task = asyncio.get_running_loop().create_task(self._publish_tick(channel, data))

                def done(_: asyncio.Task[None], channel: str = channel) -> None:
                    slots.release()
                    self._in_flight.discard(channel)
                    if self.book.has_pending(channel):
                        self._wake.set()

                task.add_done_callback(done)

    def _undelivered(self, channel: str) -> None:
        """A frame not published: an app-fed cadence sends its newest value again (a
        ticker's next tick does that by itself)."""
        spec = self.hub.specs.get(channel)
        if spec is not None and spec.fed is not None:
            self.hub.fed.undelivered(spec.base, channel)

    async def _publish_tick(self, channel: str, data: Any) -> None:
        hub = self.hub
        backplane = hub.backplane
        if backplane is not None and backplane.clustered:
            ttl_s = settings().lease_ttl_ms / 1000
            if not hub.reconciler.lease_fresh(channel, time.monotonic(), ttl_s):
                self.stale_ticks += 1
                self._undelivered(channel)
                return
        book = self.book
        try:
            await hub.publish(channel, data)
        except BackplaneUnavailable:
            self._undelivered(channel)  # counted and logged by the outage
        except PublicationError as exc:
            if book.fail(channel):
                logger.error("ticker of %s: %s", safe(channel), exc)
        except Exception:
            if book.fail(channel):
                logger.exception("publication on %s failed", safe(channel))
        else:
            book.failing.discard(channel)
