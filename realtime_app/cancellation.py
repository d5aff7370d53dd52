"""Stopping a task for certain.

On Python 3.11 a cancellation can be swallowed inside a library: ``asyncio.wait_for``
(redis-py wraps every send in one when a socket timeout is set) drops a cancel that
lands as the awaited call completes, and the task goes on — a receive loop then blocks
in its next ``BZPOPMIN`` and ``await task`` hangs a shutdown. A cancel that is not
honoured is repeated until the task ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

__all__ = ["cancel_and_wait"]


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
