"""Admission of inbound requests, as a pure core: caps before tokens, then a token bucket.

A request is decided **before** it is queued, in this order:

1. the process's global cap — requests queued or running (``max_pending``) → -32003
   ``overloaded``;
2. the identity's cap — its requests in flight or waiting (``max_per_identity``) → -32004
   ``too_many_in_flight``;
3. the identity's token bucket — ``bucket_capacity`` tokens, refilled at ``refill_per_s``,
   computed lazily from the time elapsed since the identity's last request
   (``tokens = min(capacity, tokens + elapsed × rate)``); a request costs its method's
   ``cost`` (a float: 0.25 for cheap operations) → -32005 ``rate_limited``.

Caps come first and cost nothing: a request refused by a cap consumes no token, so a
client that is merely early keeps its budget. Every refusal says when to come back
(``retry_after_ms``: exact for the bucket, ``(cost − tokens) / rate``).

A request **merged** into a compatible waiting one (:class:`CoalescingQueue`) takes no
global slot — it adds no work to the queue — but still counts against its identity's cap
and pays its cost.

No asyncio, no Django: the clock is injected, so tests and the replay drive it directly.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from realtime_app.conf import DEFAULTS
from realtime_app.wire.protocol import OVERLOADED, RATE_LIMITED, TOO_MANY_IN_FLIGHT

__all__ = [
    "Admission",
    "AdmissionLimits",
    "CoalescingQueue",
    "Job",
    "Refusal",
    "RefusalBudget",
    "retry_after_ms",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """The limits of one process. ``0`` switches a cap or the bucket off."""

    max_pending: int = DEFAULTS["ADMISSION_MAX_PENDING"]  # requests queued + running in the process
    max_per_identity: int = DEFAULTS["ADMISSION_MAX_PER_IDENTITY"]  # requests of one identity in flight or waiting
    bucket_capacity: float = DEFAULTS["ADMISSION_BUCKET_CAPACITY"]  # tokens
    refill_per_s: float = DEFAULTS["ADMISSION_REFILL_PER_S"]  # tokens per second
    idle_s: float = 60.0  # an identity with nothing pending is forgotten after this long
    cap_retry_ms: int = 250  # the retry hint of a cap refusal (when a slot frees is unknown)

    def __post_init__(self) -> None:
        if self.max_pending < 0 or self.max_per_identity < 0:
            raise ValueError("caps must be >= 0 (0 = no cap)")
        if self.bucket_capacity < 0 or self.refill_per_s < 0:
            raise ValueError("bucket_capacity and refill_per_s must be >= 0 (0 = no bucket)")
        if self.bucket_capacity and not self.refill_per_s:
            raise ValueError("a bucket needs refill_per_s > 0, or it empties for good")


def retry_after_ms(seconds: float) -> int:
    """Milliseconds to wait, rounded up: coming back at that time always passes."""
    return max(0, math.ceil(round(seconds * 1000, 6)))


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request was not admitted, and when to try again."""

    code: int
    reason: str
    retry_after_ms: int
    limit: float

    def data(self) -> dict[str, Any]:
        """``error.data`` of the JSON-RPC error (without the method's snapshot)."""
        return {"reason": self.reason, "retry_after_ms": self.retry_after_ms, "limit": self.limit}


@dataclass(slots=True)
class _Identity:
    pending: int = 0
    tokens: float = 0.0
    stamp: float = 0.0  # when ``tokens`` was last brought up to date
    seen: float = 0.0  # its last request


class Admission:
    """The decisions of one process. Call :meth:`admit` before queueing a request and
    :meth:`release` exactly once when an admitted request is answered or dropped."""

    def __init__(self, limits: AdmissionLimits | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits or AdmissionLimits()
        self.clock = clock
        self.pending = 0  # queued + running, merged requests excluded
        self._identities: OrderedDict[Hashable, _Identity] = OrderedDict()  # least recently seen first
        self.admitted = 0
        self.merged = 0
        self.refused: dict[str, int] = {"overloaded": 0, "too_many_in_flight": 0, "rate_limited": 0}
        self._swept = float("-inf")  # when idle identities were last looked for

    def tokens(self, identity: Hashable) -> float:
        """The identity's tokens now (a full bucket for an unknown identity)."""
        state = self._identities.get(identity)
        if state is None:
            return self.limits.bucket_capacity
        return self._refilled(state, self.clock())

    def _refilled(self, state: _Identity, now: float) -> float:
        limits = self.limits
        return min(limits.bucket_capacity, state.tokens + max(0.0, now - state.stamp) * limits.refill_per_s)

    def _identity(self, identity: Hashable, now: float) -> _Identity:
        state = self._identities.get(identity)
        if state is None:
            state = self._identities[identity] = _Identity(tokens=self.limits.bucket_capacity, stamp=now)
        else:
            self._identities.move_to_end(identity)
        state.seen = now
        return state

    def _refuse(self, code: int, reason: str, retry_after_ms: int, limit: float) -> Refusal:
        self.refused[reason] += 1
        return Refusal(code, reason, retry_after_ms, limit)

    def admit(self, identity: Hashable, cost: float = 1.0, *, merged: bool = False) -> Refusal | None:
        """Admit one request of ``identity`` costing ``cost`` tokens, or say why not.

        ``merged``: the request joins a waiting one and takes no global slot.
        """
        refusal = self.reserve(identity, merged=merged)
        if refusal is None:
            refusal = self.charge(identity, cost)
            if refusal is not None:
                self.cancel(identity, merged=merged)
            else:
                self.confirm(merged=merged)
        return refusal

    def reserve(self, identity: Hashable, *, merged: bool = False) -> Refusal | None:
        """Steps 1 and 2, the caps: take a slot, or say why not (no token is touched).

        Split from :meth:`charge` so that a bucket kept elsewhere (one shared by the
        processes of a cluster) can be asked in between while the slot is held; follow with
        :meth:`confirm`, or :meth:`cancel` when the bucket refuses.
        """
        limits = self.limits
        now = self.clock()
        self.forget_idle(now)
        if not merged and limits.max_pending and self.pending >= limits.max_pending:
            return self._refuse(OVERLOADED, "overloaded", limits.cap_retry_ms, limits.max_pending)
        state = self._identity(identity, now)
        if limits.max_per_identity and state.pending >= limits.max_per_identity:
            return self._refuse(TOO_MANY_IN_FLIGHT, "too_many_in_flight", limits.cap_retry_ms, limits.max_per_identity)
        state.pending += 1
        if not merged:
            self.pending += 1
        return None

    def charge(self, identity: Hashable, cost: float) -> Refusal | None:
        """Step 3, this process's bucket: take ``cost`` tokens or say exactly when they will be there."""
        if cost < 0:
            raise ValueError(f"cost must be >= 0, got {cost!r}")
        limits = self.limits
        if not limits.bucket_capacity:
            return None
        now = self.clock()
        state = self._identity(identity, now)
        tokens = self._refilled(state, now)
        if tokens < cost:
            state.tokens, state.stamp = tokens, now
            return self.rate_limited(retry_after_ms((cost - tokens) / limits.refill_per_s))
        state.tokens, state.stamp = tokens - cost, now
        return None

    def rate_limited(self, retry_ms: int) -> Refusal:
        """A bucket refusal (this process's bucket, or a shared one that said no)."""
        return self._refuse(RATE_LIMITED, "rate_limited", retry_ms, self.limits.bucket_capacity)

    def confirm(self, *, merged: bool = False) -> None:
        """The reserved request is admitted."""
        self.admitted += 1
        if merged:
            self.merged += 1

    def rebook(self, *, merged: bool) -> None:
        """A request admitted as merged now queues alone (the job it was to join started
        while its bucket was asked), or the other way round: move its global slot."""
        self.pending += -1 if merged else 1

    def cancel(self, identity: Hashable, *, merged: bool = False) -> None:
        """Give back a reserved slot whose request the bucket refused."""
        self.release(identity, merged=merged)

    def release(self, identity: Hashable, *, merged: bool = False) -> None:
        """An admitted request is done (answered, failed, cancelled or dropped)."""
        state = self._identities.get(identity)
        if state is None or state.pending <= 0:
            raise ValueError(f"release without an admitted request of {identity!r}")
        state.pending -= 1
        if not merged:
            self.pending -= 1

    def forget_idle(self, now: float | None = None) -> int:
        """Forget identities with nothing pending, unseen for ``idle_s`` (by then their
        bucket is full again): memory follows the active identities only. Sweeps at most
        once a second, from the least recently seen, so a decision stays O(1) amortized."""
        now = self.clock() if now is None else now
        if now - self._swept < 1.0 and now >= self._swept:
            return 0
        self._swept = now
        stale: list[Hashable] = []
        for identity, state in self._identities.items():
            if now - state.seen < self.limits.idle_s:
                break  # the rest were seen later
            if state.pending == 0:
                stale.append(identity)
        for identity in stale:
            del self._identities[identity]
        return len(stale)

    def pending_by_identity(self) -> dict[Hashable, int]:
        """The identities with requests admitted and not yet answered, and how many."""
        return {identity: state.pending for identity, state in self._identities.items() if state.pending}

    def in_flight(self, identity: Hashable) -> int:
        """Requests of ``identity`` admitted and not yet answered (its cap counts these)."""
        state = self._identities.get(identity)
        return state.pending if state is not None else 0

    @property
    def identities(self) -> int:
        """Identities tracked now."""
        return len(self._identities)


@dataclass(slots=True)
class RefusalBudget:
    """How many refusals one connection may collect before it is closed (1008): a burst of
    ``capacity`` (a page firing 60 requests at once gets 50 refusals and stays), refilled at
    ``capacity / 10`` per second. A client that ignores ``retry_after_ms`` and keeps
    sending makes the server spend on refusals what it saved on work; this ends that."""

    capacity: float
    tokens: float = -1.0
    stamp: float = 0.0

    def spend(self, now: float) -> bool:
        """Count one refusal; False when the budget is exhausted (close the connection)."""
        if not self.capacity:
            return True
        if self.tokens < 0:
            self.tokens, self.stamp = self.capacity, now
        self.tokens = min(self.capacity, self.tokens + max(0.0, now - self.stamp) * self.capacity / 10)
        self.stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


@dataclass(eq=False, slots=True)
class Job(Generic[T]):
    """Waiting (or running) work: one request, or several merged into one execution.

    ``identity``: whose turn it takes in the fair queue (its first request's identity).
    """

    key: Hashable | None
    entries: list[tuple[T, float]] = field(default_factory=list)  # (item, its units)
    running: bool = False
    identity: Hashable = None
    serial: bool = False  # never runs beside another job of its key

    @property
    def items(self) -> list[T]:
        return [item for item, _ in self.entries]

    @property
    def units(self) -> float:
        return sum(units for _, units in self.entries)


class CoalescingQueue(Generic[T]):
    """Waiting jobs, one FIFO per identity, served fairly; a compatible request joins a job
    **still waiting**.

    **Fair.** :meth:`pop` serves the identity with the fewest jobs running now (``busy``),
    the one whose turn came longest ago among equals, then sends it to the back of the
    turn order. An identity's backlog therefore delays another identity's first request
    by at most one slot's worth of work: whoever has nothing running goes first, and a
    queue of thousands from one client is drained one job per turn.

    **Coalescing.** Requests with the same ``key`` merge while their job waits, up to
    ``cap`` units; past the cap (or once the job runs) a new job is queued. Each merged
    item stays in the job's ``items`` so that every caller gets its own answer.

    **Serial keys.** A job pushed ``serial`` never runs while another job of its key runs
    (a player's inventory, one operation at a time): it waits at the head of its
    identity's queue, gathering the requests that merge into it, until :meth:`ended` is
    called for the running one.
    """

    def __init__(self) -> None:
        self._queues: OrderedDict[Hashable, deque[Job[T]]] = OrderedDict()  # turn order
        self._open: dict[Hashable, Job[T]] = {}  # key -> the waiting job that may grow
        self._serial_running: set[Hashable] = set()  # keys of the serial jobs running now

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def __iter__(self) -> Iterator[Job[T]]:
        return iter([job for queue in self._queues.values() for job in queue])

    def can_merge(self, key: Hashable | None, units: float, cap: float) -> bool:
        """Whether a request would join a waiting job rather than queue one."""
        job = self._open.get(key) if key is not None else None
        return job is not None and job.units + units <= cap

    def push(
        self,
        item: T,
        key: Hashable | None = None,
        units: float = 1.0,
        cap: float = 0.0,
        identity: Hashable = None,
        serial: bool = False,
    ) -> tuple[Job[T], bool]:
        """Queue ``item`` of ``identity``; returns its job and whether it merged into a waiting one."""
        if key is not None and self.can_merge(key, units, cap):
            job = self._open[key]
            job.entries.append((item, units))
            return job, True
        job = Job(key, [(item, units)], identity=identity, serial=serial and key is not None)
        queue = self._queues.get(identity)
        if queue is None:
            queue = self._queues[identity] = deque()
        queue.append(job)
        if key is not None:
            self._open[key] = job  # the newest waiting job of this key takes the next merges
        return job, False

    def pop(
        self, busy: Callable[[Hashable], int] | None = None, skip: Callable[[Hashable], bool] | None = None
    ) -> Job[T] | None:
        """The next job by turn (see the class), now running: nothing merges into it any
        more. ``skip(identity)``: that identity's jobs wait (its class is at its share)."""
        chosen: Hashable = None
        fewest = None
        for identity, waiting in self._queues.items():
            if self.blocked(waiting[0]) or skip is not None and skip(identity):
                continue
            running = busy(identity) if busy is not None else 0
            if fewest is None or running < fewest:
                chosen, fewest = identity, running
                if running <= 0:
                    break
        if fewest is None:
            return None  # nothing waits, or only serial jobs whose key runs
        queue = self._queues[chosen]
        job = queue.popleft()
        if queue:
            self._queues.move_to_end(chosen)
        else:
            del self._queues[chosen]
        if job.key is not None and self._open.get(job.key) is job:
            del self._open[job.key]
        job.running = True
        if job.serial:
            self._serial_running.add(job.key)
        return job

    def blocked(self, job: Job[T]) -> bool:
        """A serial job whose key runs now: it must wait for :meth:`ended`."""
        return job.serial and job.key in self._serial_running

    def ended(self, job: Job[T]) -> None:
        """A job returned by :meth:`pop` has ended: the next job of its key may run."""
        if job.serial:
            self._serial_running.discard(job.key)

    def remove(self, predicate: Callable[[T], bool]) -> list[T]:
        """Take the waiting items matching ``predicate`` out (their connection closed)."""
        removed: list[T] = []
        for identity, queue in list(self._queues.items()):
            for job in list(queue):
                removed += [item for item, _ in job.entries if predicate(item)]
                job.entries[:] = [(item, units) for item, units in job.entries if not predicate(item)]
                if not job.entries:
                    queue.remove(job)
                    if job.key is not None and self._open.get(job.key) is job:
                        del self._open[job.key]
            if not queue:
                del self._queues[identity]
        return removed
