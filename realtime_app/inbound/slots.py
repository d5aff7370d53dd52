"""The request pool's slot accounting, as a pure core: no event loop, no awaits.

Every admitted request holds admission slots (its identity's, and a global one unless it
merged into a waiting job) until it is **released, exactly once**, whatever ends it. A
request moves through::

    queued ──start──▶ running ──finished──▶ released
       └──────────────abandon / close─────────▶ released

:class:`PoolCore` makes each transition and returns what its caller must do: the jobs to
start, the jobs to cancel. The asyncio shell (:class:`~realtime_app.inbound.workers.RequestPool`)
calls :meth:`PoolCore.finished` from each job task's *done callback*, which runs however
the task ended — answered, raising, cancelled while running, or cancelled **before its
first step** (a coroutine that never started never enters its own ``try/finally``; a done
callback still runs). That is the whole guarantee; ``tests/test_slots.py`` interleaves
admits, starts, cancels, closes and stops at random (hypothesis) and checks the books.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Generic, Protocol, TypeVar

from realtime_app.inbound.admission import Admission, CoalescingQueue, Job

__all__ = ["PoolCore", "Ticket"]


class Ticket(Protocol):
    """What the core needs of one admitted request."""

    owner: Any  # the connection that sent it
    identity: Hashable
    merged: bool  # holds no global slot (joined a waiting job)
    cancellable: bool  # an async handler (a sync one runs on in its thread)
    released: bool


C = TypeVar("C", bound=Ticket)


class PoolCore(Generic[C]):
    """Which admitted requests wait, which run (at most ``max_running``; 0 = no bound),
    and the release of their slots."""

    def __init__(self, admission: Admission, max_running: int, anonymous_share: int = 0) -> None:
        self.admission = admission
        self.max_running = max_running
        #: Jobs of anonymous identities (``("address", ...)``) running at once, all of them
        #: together (0: no share of their own): many addresses cannot take every slot.
        self.anonymous_share = anonymous_share
        self.anonymous_running = 0
        self.queue: CoalescingQueue[C] = CoalescingQueue()
        self.running: dict[Job[C], None] = {}  # started jobs whose task has not ended
        self._busy: dict[Hashable, int] = {}  # running jobs per identity (the fair turn)
        self.merges = 0
        self.released = 0
        self.abandoned = 0

    def busy(self, identity: Hashable) -> int:
        return self._busy.get(identity, 0)

    @property
    def waiting(self) -> int:
        """Requests waiting, merged ones included."""
        return sum(len(job.entries) for job in self.queue)

    def would_merge(self, key: Hashable | None, units: float, cap: float) -> bool:
        return self.queue.can_merge(key, units, cap)

    def submit(
        self, call: C, key: Hashable | None = None, units: float = 1.0, cap: float = 0.0, serial: bool = False
    ) -> list[Job[C]]:
        """Queue an admitted ``call`` (admitted as ``call.merged``); returns the jobs to
        start now. When the job it was to join started meanwhile (or the other way
        round), its global slot moves and ``call.merged`` says where it went. ``serial``:
        its job never runs beside another job of ``key``."""
        _, merged = self.queue.push(call, key, units, cap, call.identity, serial)
        if merged != call.merged:
            self.admission.rebook(merged=call.merged)
            call.merged = merged
        if merged:
            self.merges += 1
        return self._take()

    def _take(self) -> list[Job[C]]:
        started: list[Job[C]] = []
        while not self.max_running or len(self.running) < self.max_running:
            full = bool(self.anonymous_share) and self.anonymous_running >= self.anonymous_share
            job = self.queue.pop(self.busy, _anonymous if full else None)
            if job is None:
                break
            self.running[job] = None
            self._busy[job.identity] = self._busy.get(job.identity, 0) + 1
            self.anonymous_running += _anonymous(job.identity)
            started.append(job)
        return started

    def finished(self, job: Job[C]) -> list[Job[C]]:
        """A started job's task ended, whichever way: its calls are released; returns the
        jobs to start in its place. Called once per started job (a second call is a bug)."""
        if job not in self.running:
            raise ValueError("finished() for a job that is not running")
        del self.running[job]
        self.queue.ended(job)
        self.anonymous_running -= _anonymous(job.identity)
        left = self._busy[job.identity] - 1
        if left:
            self._busy[job.identity] = left
        else:
            del self._busy[job.identity]
        for call in job.items:
            self._release(call)
        return self._take()

    def abandon(self, owner: Any) -> tuple[list[C], list[Job[C]], list[Job[C]]]:
        """``owner``'s connection closed: its waiting calls leave and are released; returns
        them, the running jobs to cancel (async jobs only ``owner`` waited for — a sync
        one runs to its end in its thread and is released then), and the jobs to start now
        (a job that waited behind a serial one of ``owner`` that left)."""
        removed = self.queue.remove(lambda call: call.owner is owner)
        for call in removed:
            self._release(call)
        self._keep_global_slots()
        self.abandoned += len(removed)
        cancel = [job for job in self.running if all(call.owner is owner and call.cancellable for call in job.items)]
        return removed, cancel, self._take()

    def close(self) -> tuple[list[C], list[Job[C]]]:
        """The process stops: every waiting call is released; returns them and every
        running job (to cancel; each is released when its task ends)."""
        removed = self.queue.remove(lambda call: True)
        for call in removed:
            self._release(call)
        self.max_running = -1  # nothing starts any more (``_take`` sees a full pool)
        return removed, list(self.running)

    def _keep_global_slots(self) -> None:
        """A waiting job whose caller holding the global slot left keeps one all the same."""
        for job in self.queue:
            if job.entries and all(call.merged for call in job.items):
                head = job.items[0]
                head.merged = False
                self.admission.rebook(merged=False)

    def _release(self, call: C) -> None:
        if call.released:
            raise ValueError("a call released twice")
        call.released = True
        self.released += 1
        self.admission.release(call.identity, merged=call.merged)


def _anonymous(identity: Hashable) -> bool:
    return isinstance(identity, tuple) and bool(identity) and identity[0] == "address"
