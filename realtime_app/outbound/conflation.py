"""Conflation: for a state channel, the newest frame replaces the one still waiting.

A connection over its backpressure threshold gets no new frame written. With ``drop`` the
frame is lost, and a client that is behind keeps an old value until a later frame
happens to fit; with ``conflate`` (a channel's ``"backpressure"`` in ``POLICIES``) the
frame waits here, **one per channel**, the newer replacing the older in place, and is
written as soon as the connection's queue is back under the threshold: a slow client
converges to the latest state the moment its socket drains, and what the server holds for
it is bounded by one frame per conflated channel. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

__all__ = ["Held"]


@dataclass(slots=True)
class Held:
    """The frames one connection holds back, oldest first, at most one per channel.

    Order across channels is the order of their newest publications: a replaced frame
    moves to the end, so frames leave in the order the server published what they carry.
    """

    frames: OrderedDict[str, tuple[bytes, bytes | None]] = field(default_factory=OrderedDict)
    conflated: int = 0  # frames replaced before they were written: never sent

    def __bool__(self) -> bool:
        return bool(self.frames)

    def __len__(self) -> int:
        return len(self.frames)

    def put(self, channel: str, payload: bytes, frame: bytes | None) -> bool:
        """Hold ``payload`` as ``channel``'s newest frame; True when it replaced one."""
        replaced = channel in self.frames
        if replaced:
            del self.frames[channel]
            self.conflated += 1
        self.frames[channel] = (payload, frame)
        return replaced

    def take(self) -> tuple[str, bytes, bytes | None]:
        """The oldest held frame, removed."""
        channel, (payload, frame) = self.frames.popitem(last=False)
        return channel, payload, frame

    def bytes(self) -> int:
        return sum(len(payload) for payload, _ in self.frames.values())
