"""Bounded execution of admitted requests: a FIFO queue, at most ``max_running`` at once.

Admission (:mod:`realtime_app.inbound.admission`) decides whether a request may wait; this pool
decides when it runs. Application methods run here, not in their connection's receive
loop, so a slow method never holds up that connection's other frames (its pings answer
at once) and responses leave in completion order, each with its own ``id``.

* **Bounded and fair.** At most ``max_running`` requests run at once in the process; the
  others wait, one queue per identity, the identity with the fewest running served next
  (:class:`~realtime_app.inbound.admission.CoalescingQueue`). Async handlers run on the
  event loop, sync ones in a worker thread (they may use the ORM) — a blocked sync
  handler never blocks the loop.
* **Coalescing.** A request of a method that declares :class:`Coalesce` joins a
  compatible request **still waiting** (same key) up to the method's cap; the handler
  runs once with the merged params and every caller gets its own answer. A running
  request never takes new callers: what it does was decided when it started.
* **Released, always.** Every admitted request gives its admission slot back exactly
  once — answered, raising, cancelled, or dropped because its connection closed while it
  waited (:meth:`RequestPool.abandon`), or the process stopping (:meth:`RequestPool.close`):
  the books are kept by the pure :class:`~realtime_app.inbound.slots.PoolCore`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from realtime_app.inbound.admission import Admission, Job
from realtime_app.inbound.slots import PoolCore
from realtime_app.wire.protocol import INTERNAL_ERROR

__all__ = ["Call", "Coalesce", "RequestPool", "Run"]

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
    ``serial``: one execution per key at a time (a player's inventory, as on a game
    server) — the requests that come while one runs wait and merge into the next.
    """

    key: Callable[[Hashable, Any], Hashable | None]
    units: Callable[[Any], float]
    merge: Callable[[list[Any]], Any]
    cap: float
    answer: Callable[[Any, Any, float, int], Any] | None = None
    serial: bool = False

    def __post_init__(self) -> None:
        if not self.cap > 0:
            raise ValueError(f"coalesce cap must be > 0, got {self.cap!r}")

    def answer_for(self, result: Any, params: Any, units: float, requests: int) -> Any:
        if self.answer is not None:
            return self.answer(result, params, units, requests)
        if isinstance(result, dict):
            return {**result, "coalesced": {"requests": requests, "units": units}}
        return result


#: ``run(method, params) -> (ok, result or JSON-RPC error object)``: how an admitted call
#: runs — its connection's dispatch, which the pool never needs to know more of.
Run = Callable[[str, Any], Awaitable[tuple[bool, Any]]]


@dataclass(eq=False, slots=True)
class Call:
    """One admitted request waiting for (or in) its execution."""

    owner: Hashable  # the connection that sent it: :meth:`RequestPool.abandon` drops its calls
    run: Run
    method: str
    params: Any
    identity: Hashable
    merged: bool  # joined a waiting job: holds no global slot
    coalesce: Coalesce | None = None
    cancellable: bool = True  # an async handler; a sync one runs on in its thread
    future: asyncio.Future[Any] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    released: bool = False  # its admission slots were given back (:mod:`realtime_app.inbound.slots`)


class RequestPool:
    """The process's queue of admitted requests and the tasks that run them: the asyncio
    shell around :class:`~realtime_app.inbound.slots.PoolCore`, which keeps the books."""

    def __init__(self, admission: Admission, max_running: int, anonymous_share: int = 0) -> None:
        self.admission = admission
        self.core: PoolCore[Call] = PoolCore(admission, max_running, anonymous_share)
        self._tasks: dict[Job[Call], asyncio.Task[None]] = {}
        self.completed = 0

    @property
    def max_running(self) -> int:
        return self.core.max_running

    @max_running.setter
    def max_running(self, value: int) -> None:
        self.core.max_running = value

    @property
    def running(self) -> int:
        return len(self.core.running)

    @property
    def waiting(self) -> int:
        """Requests waiting, merged ones included."""
        return self.core.waiting

    @property
    def merges(self) -> int:
        return self.core.merges

    @property
    def abandoned(self) -> int:
        return self.core.abandoned

    def would_merge(self, key: Hashable | None, units: float, cap: float) -> bool:
        return self.core.would_merge(key, units, cap)

    def submit(
        self, call: Call, key: Hashable | None = None, units: float = 1.0, cap: float = 0.0, serial: bool = False
    ) -> bool:
        """Queue an admitted call; returns whether it merged into a waiting job (its
        ``merged`` is updated when that differs from what it was admitted as)."""
        self._start(self.core.submit(call, key, units, cap, serial))
        return call.merged

    def _start(self, jobs: list[Job[Call]]) -> None:
        loop = asyncio.get_running_loop()
        for job in jobs:
            task = loop.create_task(self._run(job), name="realtime-request")
            self._tasks[job] = task
            # Released in the done callback: it runs however the task ends, cancelled
            # before its first step included (the coroutine's own finally would not).
            task.add_done_callback(functools.partial(self._ended, job))

    def _ended(self, job: Job[Call], task: asyncio.Task[None]) -> None:
        self._tasks.pop(job, None)
        failed = not task.cancelled() and task.exception() is not None
        if failed:
            logger.error("method %s: its execution failed", job.items[0].method, exc_info=task.exception())
        for call in job.items:
            if failed:
                _resolve(call, False, _INTERNAL)  # answered all the same: never left waiting
            elif not call.future.done():
                call.future.cancel()
        self.completed += len(job.entries)
        self._start(self.core.finished(job))

    async def _run(self, job: Job[Call]) -> None:
        calls = job.items
        head = calls[0]
        if len(calls) == 1:
            ok, outcome = await head.run(head.method, head.params)
            _resolve(head, ok, outcome)
        else:
            await self._run_merged(job, calls)

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
            ok, outcome = await head.run(head.method, params)
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

    def abandon(self, owner: Hashable) -> int:
        """``owner``'s connection closed: its waiting calls leave the queue and give their
        slots back; a running async job that only it waited for is cancelled (a sync one
        runs to its end in its thread — it cannot be interrupted — and frees its slot then)."""
        removed, cancel, start = self.core.abandon(owner)
        self._start(start)
        for call in removed:
            call.future.cancel()
        for job in cancel:
            self._tasks[job].cancel()
        return len(removed)

    def close(self) -> None:
        """The process stops: waiting calls are dropped, running jobs cancelled; every slot
        comes back (the running ones as their tasks end)."""
        removed, cancel = self.core.close()
        for call in removed:
            call.future.cancel()
        for job in cancel:
            self._tasks[job].cancel()


_INTERNAL = {"code": INTERNAL_ERROR, "message": "Internal error", "data": {"reason": "internal_error"}}


def _resolve(call: Call, ok: bool, outcome: Any) -> None:
    if not call.future.done():
        call.future.set_result((ok, outcome))
