"""The server's input queue of a connection (what the ASGI application's ``receive``
reads), made lighter once the socket is open.

Daphne and uvicorn give every connection an unbounded ``asyncio.Queue``: four
``collections.deque`` of 760 bytes each (its items, its getters, its putters, and the
waiters of the ``Event`` that ``join()`` waits on) — 3 KiB of a 20 KiB connection. Of
those, an unbounded queue never has a putter waiting, and neither server (nor Channels)
ever joins its input queue: :func:`lighten` swaps those two for objects that hold nothing.
asyncio's private names, read behind one check (:data:`TESTED` Python series, the exact
class, the attributes present, ``maxsize`` 0); on any other, the queue is left alone.
"""

from __future__ import annotations

import asyncio
import collections
import sys
from typing import Any

__all__ = ["TESTED", "NotJoinable", "lighten"]

#: The Python series whose ``asyncio.Queue`` internals :func:`lighten` was tested with.
TESTED = ((3, 11), (3, 12), (3, 13))


class NotJoinable:
    """Stands for the ``Event`` that ``Queue.join()`` waits on, where nobody joins: what
    ``put`` and ``task_done`` tell it is not kept; ``join()`` says why it cannot wait."""

    __slots__ = ()

    def clear(self) -> None:
        pass

    def set(self) -> None:
        pass

    def is_set(self) -> bool:
        return False

    async def wait(self) -> bool:
        raise RuntimeError("this input queue was made lighter once its socket opened: it cannot be joined")


def lighten(queue: Any) -> bool:
    """Drop an unbounded input queue's putters deque and its ``join()`` event (about
    1.6 KiB); True when done, False where the queue or Python is not the tested one."""
    if sys.version_info[:2] not in TESTED or type(queue) is not asyncio.Queue:
        return False
    held: Any = queue  # asyncio's private names below, as the checks read them
    if (
        held.maxsize != 0
        or not isinstance(getattr(held, "_putters", None), collections.deque)
        or type(getattr(held, "_finished", None)) is not asyncio.Event
        or held._putters  # nothing can wait to put into an unbounded queue; checked all the same
        or held._finished._waiters  # somebody joins it after all
    ):
        return False
    held._putters = ()  # what _wakeup_next walks: always empty, never appended to (never full)
    held._finished = NotJoinable()
    return True
