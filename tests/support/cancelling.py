"""Cutting a step short at a chosen point: the sweeps that cancel a stop or a close after
each turn of the event loop in turn, as the product stops a task."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from realtime_app.cancellation import cancel_and_wait

__all__ = ["cancelled_after"]


async def cancelled_after(steps: int, work: Coroutine[Any, Any, Any]) -> bool:
    """Run ``work`` in a task for ``steps + 1`` turns of the loop, then cancel it again and
    again until it ends (:func:`cancel_and_wait`); True when it had finished by then (the
    sweep has reached its end)."""
    task = asyncio.get_running_loop().create_task(work)
    for _ in range(steps + 1):
        await asyncio.sleep(0)
    finished = task.done()
    async with asyncio.timeout(30):
        await cancel_and_wait(task)
    return finished
