"""Wait for a condition with a deadline: the one way tests wait (never a fixed sleep)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

__all__ = ["eventually", "eventually_sync"]


async def eventually(condition: Callable[[], Any], timeout: float = 15.0, what: str = "the condition") -> Any:
    """Poll ``condition()`` (sync or async) until it is truthy and return its value; fail
    after ``timeout`` seconds, naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        await asyncio.sleep(0.05)


def eventually_sync(condition: Callable[[], Any], timeout: float = 15.0, what: str = "the condition") -> Any:
    """:func:`eventually` for code without an event loop (threads, HTTP clients)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.02)
