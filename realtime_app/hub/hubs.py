"""Which hub is this event loop's: the process's hubs, one per loop, kept by the runtime
(:mod:`realtime_app.conf.runtime`), started on first use; and the ways to reach one from a
request, a thread or a probe."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from typing import Any

from realtime_app.conf.runtime import runtime
from realtime_app.exceptions import BackplaneUnavailable
from realtime_app.hub.core import Hub

__all__ = ["Hubs", "get_hub", "hub_of_current_loop", "hubs", "running_hub", "start_failure", "start_hub_soon"]


class Hubs:
    """The process's hubs, one per event loop, and the start under way on each (a part of
    the runtime: :mod:`realtime_app.conf.runtime`)."""

    def __init__(self) -> None:
        self.by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Hub] = weakref.WeakKeyDictionary()
        self.starting: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Task[Any]] = (
            weakref.WeakKeyDictionary()
        )

    async def aclose(self) -> None:
        """Close every hub: the running loop's here, a hub of another live loop (a server's,
        seen from a thread) on its own loop; a stopped loop's has nothing running."""
        try:
            current: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        for loop, hub in list(self.by_loop.items()):
            self.by_loop.pop(loop, None)
            if loop is current:
                await hub.aclose()
            elif loop.is_running() and not loop.is_closed():
                with contextlib.suppress(Exception):
                    await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(hub.aclose(), loop))


def hubs() -> Hubs:
    """This process's hubs (its runtime's part)."""
    return runtime().part(Hubs)


def start_hub_soon() -> None:
    """Start the running loop's hub in a task of its own, unless it runs or is starting:
    what an HTTP request does, which never waits for the backplane (a failed start is
    logged by :meth:`Hub.start`, once per outage; the next request tries again)."""
    loop = asyncio.get_running_loop()
    hub = hubs().by_loop.get(loop)
    if hub is not None and hub.started:
        return
    task = hubs().starting.get(loop)
    if task is not None and not task.done():
        return

    async def start() -> None:
        with contextlib.suppress(BackplaneUnavailable):
            await get_hub()

    hubs().starting[loop] = loop.create_task(start(), name="realtime-hub-start")


async def get_hub() -> Hub:
    """The started hub of the running event loop (created on first use)."""
    loop = asyncio.get_running_loop()
    hub = hubs().by_loop.get(loop)
    if hub is None:
        hub = hubs().by_loop[loop] = Hub()
    if not hub.started:
        await hub.start()
    return hub


def running_hub() -> Hub | None:
    """A started hub of this process on another live loop, for publishing from threads."""
    for loop, hub in list(hubs().by_loop.items()):
        if hub.started and loop.is_running() and not loop.is_closed():
            return hub
    return None


def start_failure() -> str | None:
    """Why this process's hub could not start, while it cannot (no I/O: what the last
    attempt said; from any thread, a sync view's included); None when it runs or was
    not tried."""
    for hub in list(hubs().by_loop.values()):
        if hub.started:
            return None
        if hub._failed is not None:
            return str(hub._failed[1])
    return None


def hub_of_current_loop() -> Hub | None:
    try:
        hub = hubs().by_loop.get(asyncio.get_running_loop())
    except RuntimeError:
        return None
    return hub if hub is not None and hub.started else None
