"""A connection's queue for the guard's tests: what was written and not yet read."""

from __future__ import annotations

from collections import deque

from realtime_app.outbound.base import Transport


class QueueModel(Transport):
    """A connection's queue: what was written and not yet read by the client."""

    measurable = True

    def __init__(self) -> None:
        self.queue: deque[bytes] = deque()

    def buffered(self) -> int:
        return sum(len(p) for p in self.queue)

    def write(self, payload: bytes, frame: bytes | None = None) -> bool:
        self.queue.append(payload)
        return True

    def close(self, code: int, reason: str, drain_s: float) -> None:
        raise AssertionError("a conflated channel never closes its connection")


def frame(channel: str, value: int, size: int) -> bytes:
    """A frame that says its channel and value, padded to about ``size`` bytes."""
    return f"{channel}:{value}:".encode() + b"x" * size
