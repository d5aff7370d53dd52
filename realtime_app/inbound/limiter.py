"""Concurrency pools for HTTP requests: at most N run at once, the rest wait — in FIFO order
per client, the clients served in turn.

A pool is shared by the threads and the event loop of one process, so one class serves
Django's sync path (WSGI servers with threads: a waiter blocks on a
:class:`threading.Event`) and its async path (ASGI: a waiter awaits an
:class:`asyncio.Event` woken thread-safely). A slot freed by a finished request passes
straight to a waiter — it is never released and re-taken, so a newcomer cannot overtake
the queue. **Fair per client** (its user, or its address): each client has its own FIFO
and a freed slot goes to the next client in turn, so one client's backlog delays another
client by at most one request; when the queue is full, a client with fewer requests
(running and waiting) than the busiest one takes the busiest one's newest place (that one
is answered 503 ``queue_full``) instead of being refused, and a client below its share
of the slots with nothing waiting takes a place past ``max_waiting`` (at most
``max_concurrent`` such places). Found: a client whose flood held every slot and one
waiting place refused every request of a second client, since only waiters were
compared.

Every way out is counted exactly once: a slot given back (:meth:`Slot.release` is
idempotent), a waiter that timed out, one whose client went away, one refused because
the queue was full.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Busy", "ConcurrencyPool", "PoolSettings", "Slot"]

Reason = Literal["queue_full", "timeout", "client_gone"]


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """One pool of ``REALTIME_APP["HTTP_POOLS"]`` (checked by ``realtime_app.E020``)."""

    max_concurrent: int
    max_waiting: int = 100
    wait_timeout_ms: int = 10_000

    def __post_init__(self) -> None:
        if self.max_concurrent < 1:
            raise ValueError("max_concurrent must be >= 1")
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0 (0: refuse at once when full)")
        if self.wait_timeout_ms < 1:
            raise ValueError("wait_timeout_ms must be >= 1")


class Busy(Exception):
    """The pool refused the request (``reason``); come back after ``retry_after_s``."""

    def __init__(self, pool: str, reason: Reason, retry_after_s: int) -> None:
        super().__init__(pool, reason, retry_after_s)
        self.pool = pool
        self.reason = reason
        self.retry_after_s = retry_after_s


class _Waiter:
    __slots__ = ("client", "event", "granted_at", "loop", "since", "state")

    def __init__(self, loop: asyncio.AbstractEventLoop | None, client: Hashable = None) -> None:
        self.loop = loop
        self.client = client
        self.event: asyncio.Event | threading.Event = asyncio.Event() if loop is not None else threading.Event()
        # -> "granted" (a slot was passed to it), "expired" (its time was up when a slot
        # came: it is answered 503, the slot goes on), "shed" (its place went to another
        # client's request: 503 queue_full) or "gone" (it left the queue)
        self.state = "waiting"
        self.since = time.monotonic()
        self.granted_at = 0.0

    def wake(self) -> None:
        if self.loop is None:
            self.event.set()
        else:
            self.loop.call_soon_threadsafe(self.event.set)


class Slot:
    """A running request's place in its pool; :meth:`release` it exactly once (more is harmless)."""

    __slots__ = ("_pool", "client", "released", "waited_ms")

    def __init__(self, pool: ConcurrencyPool, waited_ms: float, client: Hashable = None) -> None:
        self._pool = pool
        self.waited_ms = waited_ms
        self.client = client
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._pool._release(self.client)


class ConcurrencyPool:
    """One named pool: ``acquire`` (sync) or ``aacquire`` (async) a :class:`Slot`, or :class:`Busy`."""

    def __init__(self, name: str, settings: PoolSettings) -> None:
        self.name = name
        self.settings = settings
        self.running = 0
        self.running_by: dict[Hashable, int] = {}  # slots held per client
        self._queues: OrderedDict[Hashable, deque[_Waiter]] = OrderedDict()  # per client, in turn
        self._lock = threading.Lock()
        self.admitted = 0
        self.refused: dict[str, int] = {"queue_full": 0, "timeout": 0, "client_gone": 0}
        self._waits: deque[float] = deque(maxlen=1024)  # recent waits (ms) of admitted requests
        self._service: deque[float] = deque(maxlen=64)  # recent run times (s), for Retry-After

    @property
    def waiting(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    # -- taking a slot ----------------------------------------------------------------

    def _enter(self, loop: asyncio.AbstractEventLoop | None, client: Hashable = None) -> Slot | _Waiter:
        """Under the lock: a slot now, a place in the queue (maybe the busiest client's
        newest), or Busy(queue_full)."""
        if self.running < self.settings.max_concurrent and not self._queues:
            self.running += 1
            self.running_by[client] = self.running_by.get(client, 0) + 1
            self.admitted += 1
            self._waits.append(0.0)
            return Slot(self, 0.0, client)
        waiting = self.waiting
        if waiting >= self.settings.max_waiting:
            mine = self._load(client)
            busiest = max(self._queues, key=self._load, default=None)
            if busiest is not None and busiest != client and self._load(busiest) > mine + 1:
                shed = self._queues[busiest].pop()  # the busiest client's newest: its place goes to this one
                if not self._queues[busiest]:
                    del self._queues[busiest]
                shed.state = "shed"
                self.refused["queue_full"] += 1
                shed.wake()
            elif client in self._queues or mine >= self._share(client) or waiting >= self._most_waiting():
                self.refused["queue_full"] += 1
                raise Busy(self.name, "queue_full", self._retry_after_s())
        waiter = _Waiter(loop, client)
        self._queues.setdefault(client, deque()).append(waiter)
        return waiter

    def _load(self, client: Hashable) -> int:
        """A client's requests in the pool: running and waiting."""
        return self.running_by.get(client, 0) + len(self._queues.get(client, ()))

    def _share(self, client: Hashable) -> int:
        """A client's fair share of the slots: the slots over the clients with requests
        in the pool, this one included (at least one)."""
        active = set(self.running_by) | set(self._queues) | {client}
        return max(1, self.settings.max_concurrent // len(active))

    def _most_waiting(self) -> int:
        """Places past ``max_waiting`` for clients below their share: ``max_concurrent`` more."""
        return self.settings.max_waiting + self.settings.max_concurrent

    def _leave(self, waiter: _Waiter, reason: Reason) -> Slot | None:
        """Under the lock: a waiter gives up. If a slot reached it meanwhile it owns it."""
        if waiter.state == "granted":
            return self._granted(waiter)
        if waiter.state == "shed":  # refused (and counted) when its place went to another client
            return None
        if waiter.state == "waiting":
            queue = self._queues[waiter.client]
            queue.remove(waiter)
            if not queue:
                del self._queues[waiter.client]
        waiter.state = "gone"
        self.refused[reason] += 1
        return None

    def _granted(self, waiter: _Waiter) -> Slot:
        # Measured to when the slot was passed on, not to when the waiter ran again (a busy
        # loop resumes it late): never more than the timeout.
        waited_ms = (waiter.granted_at - waiter.since) * 1000
        self.admitted += 1
        self._waits.append(waited_ms)
        return Slot(self, waited_ms, waiter.client)

    def acquire(self, client: Hashable = None) -> Slot:
        """Take a slot for ``client``, waiting at most ``wait_timeout_ms`` (a blocking call:
        sync code)."""
        with self._lock:
            entered = self._enter(None, client)
        if isinstance(entered, Slot):
            return entered
        assert isinstance(entered.event, threading.Event)
        entered.event.wait(self.settings.wait_timeout_ms / 1000)
        with self._lock:
            if entered.state == "granted":
                return self._granted(entered)
            self._leave(entered, "timeout")
        raise Busy(self.name, _why(entered), self._retry_after_s())  # its time was up, or its place went

    async def aacquire(self, client: Hashable = None) -> Slot:
        """Take a slot for ``client``, waiting at most ``wait_timeout_ms``. Cancelled while
        waiting (the client went away): the place is given up at once, or the slot passed on."""
        with self._lock:
            entered = self._enter(asyncio.get_running_loop(), client)
        if isinstance(entered, Slot):
            return entered
        assert isinstance(entered.event, asyncio.Event)
        try:
            async with asyncio.timeout(self.settings.wait_timeout_ms / 1000):  # wait_for may swallow a cancel
                await entered.event.wait()
        except TimeoutError:
            with self._lock:
                slot = self._leave(entered, "timeout")
            if slot is not None:
                return slot  # granted in the same instant: take it
            raise Busy(self.name, _why(entered), self._retry_after_s()) from None
        except asyncio.CancelledError:
            with self._lock:
                slot = self._leave(entered, "client_gone")
            if slot is not None:
                slot.release()  # nobody will run with it: pass it on
            raise
        with self._lock:
            if entered.state == "granted":
                return self._granted(entered)
            self._leave(entered, "timeout")  # expired: its time was up when the slot came
        raise Busy(self.name, _why(entered), self._retry_after_s())

    # -- giving it back ---------------------------------------------------------------

    def _release(self, client: Hashable = None) -> None:
        with self._lock:
            held = self.running_by.get(client, 0) - 1
            if held > 0:
                self.running_by[client] = held
            else:
                self.running_by.pop(client, None)
            now = time.monotonic()
            timeout_s = self.settings.wait_timeout_ms / 1000
            while self._queues:
                client, queue = next(iter(self._queues.items()))  # the next client in turn
                waiter = queue.popleft()
                if queue:
                    self._queues.move_to_end(client)
                else:
                    del self._queues[client]
                if waiter.state != "waiting":
                    continue
                if now - waiter.since >= timeout_s:
                    waiter.state = "expired"  # answered 503 as it wakes; the slot goes on
                    waiter.wake()
                    continue
                waiter.state = "granted"  # the slot passes on: running is unchanged
                self.running_by[waiter.client] = self.running_by.get(waiter.client, 0) + 1
                waiter.granted_at = now
                waiter.wake()
                return
            self.running -= 1

    def ran(self, seconds: float) -> None:
        """A request held its slot this long (feeds the ``Retry-After`` estimate)."""
        self._service.append(seconds)

    def _retry_after_s(self) -> int:
        """When a place is likely free again: the queue ahead times the typical run time,
        spread over the slots; at least one second (``Retry-After`` counts seconds)."""
        typical = sorted(self._service)[len(self._service) // 2] if self._service else 1.0
        ahead = self.waiting + 1
        return max(1, math.ceil(ahead * typical / self.settings.max_concurrent))

    # -- probe ------------------------------------------------------------------------

    def probe(self) -> dict[str, Any]:
        waits = sorted(self._waits)

        def pct(p: float) -> float:
            return round(waits[min(len(waits) - 1, int(p / 100 * len(waits)))], 1) if waits else 0.0

        return {
            "max_concurrent": self.settings.max_concurrent,
            "max_waiting": self.settings.max_waiting,
            "running": self.running,
            "waiting": self.waiting,
            "admitted": self.admitted,
            "refused": dict(self.refused),
            "wait_ms": {"p50": pct(50), "p99": pct(99)},
        }


def _why(waiter: _Waiter) -> Reason:
    """Why a waiter that got no slot is answered 503: its place went to another client's
    request, or its time was up."""
    return "queue_full" if waiter.state == "shed" else "timeout"
