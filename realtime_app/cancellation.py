"""Stopping a task for certain.

On Python 3.11 a cancellation can be swallowed inside a library: ``asyncio.wait_for``
(redis-py wraps every send in one when a socket timeout is set) drops a cancel that
lands as the awaited call completes, and the task goes on — a receive loop then blocks
in its next ``BZPOPMIN`` and ``await task`` hangs a shutdown. A cancel that is not
honoured is repeated until the task ends. The other way round, a step that must not be
cut — closing connections — runs to its end whatever its caller hears.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

__all__ = ["cancel_and_wait", "uninterrupted"]

T = TypeVar("T")


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None, every_s: float = 0.1) -> None:
    """Cancel ``tasks`` and wait until each has ended, cancelling again every
    ``every_s`` while one has not; their exceptions are retrieved, not raised."""
    pending = {task for task in tasks if task is not None and not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=every_s)
    for ended in tasks:
        if ended is not None and ended.done() and not ended.cancelled():
            with contextlib.suppress(BaseException):
                ended.exception()


async def uninterrupted(step: Awaitable[T]) -> T:
    """Await ``step`` to its end even when the caller is cancelled meanwhile, then pass
    the cancel on. For closing: a close cut in half leaves the sockets it had not closed
    yet open, owned by nothing. Only for steps bounded of their own (a Redis close has
    its socket timeout); the caller waits that long at most."""
    task = asyncio.ensure_future(step)
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait([task])  # (a cancel of this wait leaves the task running)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        if not task.cancelled():
            task.exception()  # retrieved: the cancel is what the caller hears
        raise asyncio.CancelledError
    return task.result()
