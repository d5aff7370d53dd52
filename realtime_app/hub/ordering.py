"""The order in which this process fans out the frames of a channel with history.

Within an epoch frames go out in ``seq`` order; a frame that overtook an earlier one is
held for ``REORDER_WINDOW_S`` (one wait here instead of a resume by every subscriber),
then what was held goes out over the gap, which the subscribers resume. A frame of a
newer epoch starts the order anew; a late frame of a replaced epoch is dropped; a frame
older than the next one expected goes out at once, and each connection's position
decides whether it still needs it (:func:`realtime_app.wire.history.already_sent`).

:class:`Sequencer` is the rule, pure (it takes ``now`` and says what to fan out and when
to wake); :class:`Ordering` runs it on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from realtime_app.wire.history import newer_epoch

__all__ = ["REORDER_WINDOW_S", "Frame", "Ordering", "Sequencer"]

#: How long a frame that overtook an earlier one waits for it before it goes out anyway.
REORDER_WINDOW_S = 0.05

#: One frame to fan out: ``(text, seq, epoch)``.
Frame = tuple[str, int, str]


@dataclass(slots=True)
class _Order:
    epoch: str
    next: int
    held: dict[int, str] = field(default_factory=dict)
    due: float | None = None  # when what is held goes out anyway


class Sequencer:
    """The order of every channel with history in this process (no loop, no clock)."""

    def __init__(self, window_s: float = REORDER_WINDOW_S) -> None:
        self.window_s = window_s
        self.orders: dict[str, _Order] = {}

    def read(self, channel: str, epoch: str, top: int) -> None:
        """A read of the history found ``top`` in ``epoch``: order after it, unless frames
        of that epoch already flow here (a fresh read is authoritative about the epoch)."""
        order = self.orders.get(channel)
        if order is None or order.epoch != epoch:
            self.orders[channel] = _Order(epoch, top + 1)

    def frame(self, channel: str, text: str, seq: int, epoch: str, now: float) -> list[Frame]:
        """One frame arrived at ``now``: the frames to fan out now, in order."""
        order = self.orders.get(channel)
        if order is None or newer_epoch(epoch, order.epoch):  # the first frame here, or a new history
            order = self.orders[channel] = _Order(epoch, seq)
        elif epoch != order.epoch:
            return []  # a late frame of a replaced history
        elif seq < order.next:
            return [(text, seq, epoch)]  # late: each connection's position decides
        if seq > order.next:
            order.held[seq] = text
            if order.due is None:
                order.due = now + self.window_s
            return []
        out = [(text, seq, epoch)]
        order.next = seq + 1
        while (held := order.held.pop(order.next, None)) is not None:
            out.append((held, order.next, epoch))
            order.next += 1
        if not order.held:
            order.due = None
        return out

    def due(self, channel: str) -> float | None:
        """When :meth:`expire` has frames of ``channel`` to release, if it ever will."""
        order = self.orders.get(channel)
        return order.due if order is not None else None

    def expire(self, channel: str, now: float) -> tuple[list[Frame], int]:
        """The window passed: what was held, in order, and how many ``seq`` it skipped."""
        order = self.orders.get(channel)
        if order is None or order.due is None or now < order.due:
            return [], 0
        order.due = None
        out: list[Frame] = []
        gaps = 0
        for seq in sorted(order.held):
            gaps += max(0, seq - order.next)
            out.append((order.held.pop(seq), seq, order.epoch))
            order.next = seq + 1
        return out, gaps

    def forget(self, channel: str) -> None:
        self.orders.pop(channel, None)


class Ordering:
    """Runs the :class:`Sequencer` on the loop: one timer per channel that holds frames."""

    def __init__(self, fanout: Callable[[str, str, int, str], None]) -> None:
        self.sequencer = Sequencer()
        self.gaps = 0  # publications of a channel with history that never reached this process
        self._fanout = fanout
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def read(self, channel: str, epoch: str, top: int) -> None:
        self.sequencer.read(channel, epoch, top)
        self._sync(channel)

    def frame(self, channel: str, text: str, seq: int, epoch: str) -> None:
        """Fan one frame out in order (with the frames it releases)."""
        now = asyncio.get_running_loop().time()
        for out in self.sequencer.frame(channel, text, seq, epoch, now):
            self._fanout(channel, *out)
        self._sync(channel)

    def forget(self, channel: str) -> None:
        self.sequencer.forget(channel)
        self._sync(channel)

    def _expire(self, channel: str) -> None:
        self._timers.pop(channel, None)
        frames, gaps = self.sequencer.expire(channel, asyncio.get_running_loop().time())
        self.gaps += gaps
        for out in frames:
            self._fanout(channel, *out)
        self._sync(channel)  # a timer that fired a little early is set again

    def _sync(self, channel: str) -> None:
        """One timer at the channel's due time, or none."""
        due = self.sequencer.due(channel)
        timer = self._timers.get(channel)
        if timer is not None and (due is None or timer.when() != due):
            timer.cancel()
            del self._timers[channel]
            timer = None
        if due is not None and timer is None:
            self._timers[channel] = asyncio.get_running_loop().call_at(due, self._expire, channel)
