"""A client's place in one channel with history: each message once, in order, or a resync.

The clients (the client session, :mod:`realtime_app.wire.session`, and ``EventCursor`` in the browser module, both
tested against ``tests/vectors/cursor.json``) feed it every ``message`` of the channel and
every answer to a ``subscribe`` of it, and do what it returns:

* ``("deliver", params)``: hand the message to the application;
* ``("recover", since)``: a ``seq`` was skipped (a frame dropped by the server's guard, or
  overtaken by a later one): subscribe again with ``since``; later messages are held;
* ``("recovered", replayed)``: a resume filled the gap with ``replayed`` messages;
* ``("resync", {"epoch", "seq", "reason"})``: the gap cannot be filled (history lost or
  too old): the application reloads its state; messages go on from ``seq``.

Pure: no I/O. docs/recovery.md describes the protocol.
"""

from __future__ import annotations

from typing import Any, TypeAlias

from realtime_app.wire.history import newer_epoch

__all__ = ["Action", "EventCursor"]

Action: TypeAlias = tuple[str, Any]

#: Messages held while a gap is recovered, at most; past it the client resyncs.
MAX_HELD = 10_000


class EventCursor:
    """Where the application is in one channel with history (``epoch``, last ``seq``)."""

    def __init__(self) -> None:
        self.epoch: str | None = None
        self.seq = 0
        self.recovering = False
        self._held: dict[tuple[str, int], dict[str, Any]] = {}  # (epoch, seq) -> message
        self._start = 0  # seq when the running resume began (did it make progress?)

    def since(self) -> dict[str, Any] | None:
        """The ``since`` of the next ``subscribe`` (None before the first position)."""
        return None if self.epoch is None else {"seq": self.seq, "epoch": self.epoch}

    def resuming(self) -> None:
        """A ``subscribe`` is being sent: with :meth:`since` (a reconnect), or a first one —
        what arrives before its answer waits for the position it gives."""
        self.recovering = True
        self._start = self.seq

    def closed(self) -> None:
        """The connection closed: what was held comes again with the resume."""
        self.recovering = False
        self._held.clear()

    def message(self, params: dict[str, Any]) -> list[Action]:
        """One ``message`` notification of the channel."""
        epoch, seq = params.get("epoch"), params.get("seq")
        if not isinstance(seq, int) or not isinstance(epoch, str):
            return [("deliver", params)]  # not a channel with history: nothing to order
        if self.epoch is None and not self.recovering:
            self.epoch, self.seq = epoch, seq
            return [("deliver", params)]
        if self.epoch is not None and epoch != self.epoch and not newer_epoch(epoch, self.epoch):
            return []  # a late frame of a history that was replaced (epochs order by time)
        if epoch == self.epoch:
            if seq <= self.seq:
                return []  # had it already (a replay overlapping a live frame)
            if seq == self.seq + 1:
                self.seq = seq
                return [("deliver", params), *self._drain()]
        elif not self.recovering:  # the history was lost under us: a new epoch
            self._held.clear()
            actions: list[Action] = [("resync", {"epoch": epoch, "seq": seq - 1, "reason": "epoch_changed"})]
            self.epoch, self.seq = epoch, seq
            return [*actions, ("deliver", params), *self._drain()]
        self._held[(epoch, seq)] = params  # after a gap, or of the epoch the resume will tell
        if len(self._held) > MAX_HELD:
            self._held.clear()
            return self._give_up(epoch, seq, "too_many_held")
        if not self.recovering:
            return self._recover()
        return []

    def answer(self, result: dict[str, Any]) -> list[Action]:
        """The answer to a ``subscribe`` of the channel (``epoch`` and ``seq`` in it)."""
        epoch, top = result["epoch"], int(result["seq"])
        recovering, self.recovering = self.recovering, False
        if "recovered" not in result:  # a first subscribe: the position to start from
            if self.epoch is None:
                self.epoch, self.seq = epoch, top
            return self._drain()
        if not result["recovered"]:
            return self._give_up(epoch, top, str(result.get("reason", "not_recovered")))
        actions: list[Action] = []
        if epoch == self.epoch and self.seq < top:  # part of the replay did not arrive
            if recovering and self.seq == self._start:
                return self._give_up(epoch, top, "replay_lost")
            return self._recover()
        actions.append(("recovered", int(result.get("replayed", 0))))
        return actions + self._drain()

    def _give_up(self, epoch: str, top: int, reason: str) -> list[Action]:
        if epoch != self.epoch or top > self.seq or reason == "ahead":
            self.epoch, self.seq = epoch, top
        actions: list[Action] = [("resync", {"epoch": self.epoch, "seq": self.seq, "reason": reason})]
        self.recovering = False
        return actions + self._drain()

    def _recover(self) -> list[Action]:
        self.recovering = True
        self._start = self.seq
        return [("recover", self.since())]

    def _drain(self) -> list[Action]:
        """Deliver what was held and now follows; ask for the rest; move to a newer epoch
        whose messages were held while a resume of the old one ran."""
        epoch = self.epoch or ""
        for key in [k for k in self._held if (k[1] <= self.seq if k[0] == epoch else not newer_epoch(k[0], epoch))]:
            del self._held[key]  # had it, or of a history that was replaced
        actions: list[Action] = []
        while (params := self._held.pop((epoch, self.seq + 1), None)) is not None:
            self.seq += 1
            actions.append(("deliver", params))
        if not self._held or self.recovering:
            return actions
        if any(k[0] == epoch for k in self._held):
            return actions + self._recover()
        newer = min(k[0] for k in self._held)  # the history was lost meanwhile
        first = min(k[1] for k in self._held if k[0] == newer)
        self.epoch, self.seq = newer, first - 1
        actions.append(("resync", {"epoch": newer, "seq": first - 1, "reason": "epoch_changed"}))
        return actions + self._drain()
