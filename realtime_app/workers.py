"""Bounded execution of admitted requests: a FIFO queue, at most ``max_running`` at once.

Admission (:mod:`realtime_app.admission`) decides whether a request may wait; this pool
decides when it runs. Application methods run here, not in their connection's receive
loop, so a slow method never holds up that connection's other frames (its pings answer
at once) and responses leave in completion order, each with its own ``id``.

* **Bounded.** At most ``max_running`` requests run at once in the process; the others
  wait in arrival order. Async handlers run on the event loop, sync ones in a worker
  thread (they may use the ORM) — a blocked sync handler never blocks the loop.
* **Coalescing.** A request of a method that declares :class:`Coalesce` joins a
  compatible request **still waiting** (same key) up to the method's cap; the handler
  runs once with the merged params and every caller gets its own answer. A running
  request never takes new callers: what it does was decided when it started.
* **Released, always.** Every admitted request gives its admission slot back exactly
  once — answered, raising, cancelled, or dropped because its connection closed while it
  waited (:meth:`RequestPool.abandon`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from .admission import Admission, CoalescingQueue, Job
from .protocol import INTERNAL_ERROR

__all__ = ["Call", "Coalesce", "RequestPool"]

logger = logging.getLogger("realtime_app.workers")


@dataclass(frozen=True, slots=True)
class Coalesce:
    """How compatible requests of one method merge while they wait.

    ``key(identity, params)``: requests with the same key may merge (``None``: never, e.g.
    params that fail validation — the handler then refuses them on their own).
    ``units(params)``: what one request carries; a job never grows past ``cap`` units.
    ``merge(list_of_params)``: the params of the one execution.
    ``answer(result, params, units, requests)``: one caller's result out of the merged
    execution's; by default a dict result gains ``"coalesced": {"requests": n, "units": u}``.
    """

    key: Callable[[Hashable, Any], Hashable | None]
    units: Callable[[Any], float]
    merge: Callable[[list[Any]], Any]
    cap: float
    answer: Callable[[Any, Any, float, int], Any] | None = None

    def __post_init__(self) -> None:
        if not self.cap > 0:
            raise ValueError(f"coalesce cap must be > 0, got {self.cap!r}")

    def answer_for(self, result: Any, params: Any, units: float, requests: int) -> Any:
        if self.answer is not None:
            return self.answer(result, params, units, requests)
        if isinstance(result, dict):
            return {**result, "coalesced": {"requests": requests, "units": units}}
        return result


@dataclass(eq=False, slots=True)
class Call:
    """One admitted request waiting for (or in) its execution."""

    owner: Any  # the consumer whose connection sent it
    method: str
    params: Any
    identity: Hashable
    merged: bool  # joined a waiting job: holds no global slot
    coalesce: Coalesce | None = None
    cancellable: bool = True  # an async handler; a sync one runs on in its thread
    future: asyncio.Future[Any] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


#: ``execute(owner, method, params) -> (ok, result or JSON-RPC error object)``
Execute = Callable[[Any, str, Any], Any]


class RequestPool:
    """The process's queue of admitted requests and the tasks that run them."""

    def __init__(self, admission: Admission, max_running: int, execute: Execute) -> None:
        self.admission = admission
        self.max_running = max_running
        self.execute = execute
        self.queue: CoalescingQueue[Call] = CoalescingQueue()
        self._running: dict[Job[Call], asyncio.Task[None]] = {}
        self.completed = 0
        self.merges = 0
        self.abandoned = 0

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        """Requests waiting, merged ones included."""
        return sum(len(job.entries) for job in self.queue)

    def would_merge(self, key: Hashable | None, units: float, cap: float) -> bool:
        return self.queue.can_merge(key, units, cap)

    def submit(self, call: Call, key: Hashable | None = None, units: float = 1.0, cap: float = 0.0) -> bool:
        """Queue an admitted call; returns whether it merged into a waiting job."""
        _, merged = self.queue.push(call, key, units, cap)
        if merged:
            self.merges += 1
        self._pump()
        return merged

    def _pump(self) -> None:
        while len(self._running) < self.max_running or not self.max_running:
            job = self.queue.pop()
            if job is None:
                return
            task = asyncio.get_running_loop().create_task(self._run(job), name="realtime-request")
            self._running[job] = task

    async def _run(self, job: Job[Call]) -> None:
        calls = job.items
        head = calls[0]
        try:
            if len(calls) == 1:
                ok, outcome = await self.execute(head.owner, head.method, head.params)
                _resolve(head, ok, outcome)
            else:
                await self._run_merged(job, calls)
        except asyncio.CancelledError:
            for call in calls:
                call.future.cancel()
        finally:
            for call in calls:
                self.admission.release(call.identity, merged=call.merged)
            self.completed += len(calls)
            del self._running[job]
            self._pump()

    async def _run_merged(self, job: Job[Call], calls: list[Call]) -> None:
        head = calls[0]
        coalesce = head.coalesce
        assert coalesce is not None  # only coalescing methods merge
        try:
            params = coalesce.merge([call.params for call in calls])
        except Exception:
            logger.exception("method %s: merging %d requests failed", head.method, len(calls))
            ok, outcome = False, _INTERNAL
        else:
            ok, outcome = await self.execute(head.owner, head.method, params)
        for call, units in job.entries:
            if ok:
                try:
                    mine = coalesce.answer_for(outcome, call.params, units, len(calls))
                except Exception:
                    logger.exception("method %s: answering a merged caller failed", head.method)
                    _resolve(call, False, _INTERNAL)
                    continue
                _resolve(call, True, mine)
            else:
                _resolve(call, False, outcome)

    def abandon(self, owner: Any) -> int:
        """``owner``'s connection closed: its waiting calls leave the queue and give their
        slots back; a running async job that only it waited for is cancelled (a sync one
        runs to its end in its thread — it cannot be interrupted — and frees its slot then)."""
        removed = self.queue.remove(lambda call: call.owner is owner)
        for call in removed:
            call.future.cancel()
            self.admission.release(call.identity, merged=call.merged)
        for job in self.queue:  # a job that lost the call holding its global slot keeps one
            if job.entries and all(call.merged for call in job.items):
                head = job.items[0]
                head.merged = False
                self.admission.rebook(merged=False)
        for job, task in list(self._running.items()):
            if all(call.owner is owner and call.cancellable for call in job.items):
                task.cancel()
        self.abandoned += len(removed)
        return len(removed)


_INTERNAL = {"code": INTERNAL_ERROR, "message": "Internal error", "data": {"reason": "internal_error"}}


def _resolve(call: Call, ok: bool, outcome: Any) -> None:
    if not call.future.done():
        call.future.set_result((ok, outcome))
