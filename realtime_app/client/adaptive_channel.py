"""A cadenced state family followed at the cadence the client can absorb (the twin of
``bindAdaptiveChannel`` in ``realtime.js``): make-before-break switches, a watchdog."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

from realtime_app.client.adaptive import AdaptiveRate
from realtime_app.client.connection import Handler, RealtimeClient, now_ms
from realtime_app.wire.rate import rate_channel

__all__ = ["AdaptiveChannel", "bind_adaptive_channel"]

logger = logging.getLogger("realtime_app.client")


class AdaptiveChannel:
    """A cadenced state family followed at the cadence the client can absorb.

    Decisions of :class:`AdaptiveRate` are applied make-before-break: subscribe to the
    new cadence, then leave the old one, so the handler sees one uninterrupted stream.
    Never use it on event channels: a slower cadence there would lose messages.
    """

    def __init__(
        self,
        client: RealtimeClient,
        base: str,
        interval_ms: int,
        handler: Handler,
        *,
        default_ms: int | None = None,
        **options: Any,
    ) -> None:
        self.client = client
        self.base = base
        self.handler = handler
        self.default_ms = default_ms
        self.rate = AdaptiveRate(interval_ms, **options)
        self.channel = self._name()
        self.changes: list[tuple[float, str | None, int]] = []
        self.on_change: list[Callable[[str, int], None]] = []
        self._handlers: dict[str, Handler] = {}
        self._switching = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._watchdog: asyncio.Task[None] | None = None
        self._closed = False

    def _name(self) -> str:
        return rate_channel(self.base, self.rate.interval_ms, self.default_ms if self.default_ms else -1)

    @property
    def interval_ms(self) -> int:
        """The effective cadence (for a badge)."""
        return self.rate.interval_ms

    def _handler_for(self, name: str) -> Handler:
        if name not in self._handlers:

            async def on_frame(params: dict[str, Any]) -> None:
                result = self.handler(params)
                if inspect.isawaitable(result):
                    await result
                if name == self.channel:  # only the current cadence is measured
                    self._apply(self.rate.note_frame(now_ms()))

            self._handlers[name] = on_frame
        return self._handlers[name]

    async def start(self) -> AdaptiveChannel:
        await self.client.subscribe(self.channel, self._handler_for(self.channel))
        if self.rate.enabled:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        return self

    async def _watch(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.rate.interval_ms / 1000)
            self._apply(self.rate.check_starvation(now_ms()))

    def _apply(self, decision: str | None) -> None:
        if decision is None or self._closed:
            return
        old, self.channel = self.channel, self._name()
        self.changes.append((time.time(), decision, self.rate.interval_ms))
        for callback in self.on_change:
            callback(decision, self.rate.interval_ms)
        task = asyncio.get_running_loop().create_task(self._switch(old, self.channel))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _switch(self, old: str, new: str) -> None:
        async with self._switching:
            try:
                await self.client.subscribe(new, self._handler_for(new))  # make…
                if old != new:
                    await self.client.unsubscribe(old, self._handler_for(old))  # …before break
            except Exception:
                logger.exception("adaptive switch %s → %s failed", old, new)

    async def close(self) -> None:
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(Exception):
                await task
        await self.client.unsubscribe(self.channel, self._handler_for(self.channel))


async def bind_adaptive_channel(
    client: RealtimeClient, base: str, interval_ms: int, handler: Handler, **options: Any
) -> AdaptiveChannel:
    """Follow ``base`` adaptively from ``interval_ms`` (``AdaptiveRate`` options accepted)."""
    return await AdaptiveChannel(client, base, interval_ms, handler, **options).start()
