"""The JSON-RPC methods a client may call: the built-ins and the application's, each
with the cost admission charges for it (docs/admission.md)."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from realtime_app.inbound.workers import Coalesce

__all__ = ["BUILTIN_COSTS", "Method", "method_costs", "methods", "rpc_method"]

#: ``handler(consumer, params)`` and ``snapshot(consumer)``, sync or async.
Handler = Callable[[Any, Any], Awaitable[Any] | Any]
Snapshot = Callable[[Any], Awaitable[Any] | Any]


@dataclass(frozen=True, slots=True)
class Method:
    """A registered application method and what admission needs to know of it."""

    handler: Handler
    cost: float = 1.0
    snapshot: Snapshot | None = None
    coalesce: Coalesce | None = None
    is_async: bool = True


_methods: dict[str, Method] = {}


def methods() -> dict[str, Method]:
    """The application's registered methods, by name."""
    return _methods


def method_costs() -> dict[str, float]:
    """The cost of every method a client may call: the built-ins and the registered ones."""
    return {**BUILTIN_COSTS, **{name: method.cost for name, method in _methods.items()}}


#: Tokens the built-in methods take from the caller's bucket (docs/admission.md): small,
#: so that a client's own subscriptions and heartbeats never starve its application calls,
#: but not nothing, so that a batch of thousands of subscribes is bounded all the same.
BUILTIN_COSTS: dict[str, float] = {"ping": 0.1, "subscribe": 0.25, "unsubscribe": 0.1, "publish": 1.0}


def rpc_method(
    name: str, *, cost: float = 1.0, coalesce: Coalesce | None = None, snapshot: Snapshot | None = None
) -> Callable[[Handler], Handler]:
    """Register an application JSON-RPC method: ``handler(consumer, params) -> result``.

    Each call is admitted first (docs/admission.md): ``cost`` tokens of the caller's
    bucket (a float: 0.25 for cheap operations); a refusal is answered at once with its
    reason and ``retry_after_ms``, plus ``snapshot(consumer)`` (sync or async) when
    given, so that the client can resync. Admitted calls wait their turn in the process's
    pool (``ADMISSION_MAX_RUNNING`` at once): an ``async def`` handler runs on the event
    loop, a plain ``def`` one in a worker thread (it may use the ORM). ``coalesce``
    (:class:`~realtime_app.inbound.workers.Coalesce`) lets compatible waiting calls merge into one
    execution. Raise :class:`~realtime_app.exceptions.RPCError` to answer an error; any
    other exception answers -32603 and is logged.
    """
    if name in BUILTIN_COSTS or name.startswith("rpc."):
        raise ValueError(f"method name {name!r} is reserved")
    if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not 0 <= cost < float("inf"):
        raise ValueError(f"method {name!r}: cost must be a number >= 0, got {cost!r}")
    if coalesce is not None and not isinstance(coalesce, Coalesce):
        raise ValueError(f"method {name!r}: coalesce must be a realtime_app.Coalesce")

    def register(handler: Handler) -> Handler:
        is_async = inspect.iscoroutinefunction(handler)
        _methods[name] = Method(handler, float(cost), snapshot, coalesce, is_async)
        return handler

    return register
