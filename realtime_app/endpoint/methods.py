"""The JSON-RPC methods a client may call: the built-ins and the application's, each
with the cost admission charges for it (docs/admission.md)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from realtime_app.conf.runtime import runtime
from realtime_app.inbound.workers import Coalesce
from realtime_app.observability.logsafe import safe
from realtime_app.wire import protocol

__all__ = ["BUILTIN_COSTS", "Method", "encodable", "method_costs", "methods", "rpc_method"]

logger = logging.getLogger("realtime_app.consumers")

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
    max_in_flight: int = 0  # calls of this method one identity may have in flight (0: no limit of its own)
    rate: float = 0.0  # calls a second one identity may make of it (0: none), in bursts of ``burst``
    burst: int = 0
    idempotent: bool = False  # a call with an "idempotency_key" runs once; its repeats get its answer


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
BUILTIN_COSTS: dict[str, float] = {
    "ping": 0.1,
    "subscribe": 0.25,
    "unsubscribe": 0.1,
    "publish": 1.0,
    "presence": 0.5,
    "auth": 1.0,
}


def rpc_method(
    name: str,
    *,
    cost: float = 1.0,
    coalesce: Coalesce | None = None,
    snapshot: Snapshot | None = None,
    max_in_flight: int = 0,
    rate: float = 0.0,
    burst: int = 0,
    idempotent: bool = False,
) -> Callable[[Handler], Handler]:
    """Register an application JSON-RPC method: ``handler(consumer, params) -> result``.

    Each call is admitted first (docs/admission.md): ``cost`` tokens of the caller's
    bucket (a float: 0.25 for cheap operations); a refusal is answered at once with its
    reason and ``retry_after_ms``, plus ``snapshot(consumer)`` (sync or async) when
    given, so that the client can resync. Admitted calls wait their turn in the process's
    pool (``ADMISSION_MAX_RUNNING`` at once): an ``async def`` handler runs on the event
    loop, a plain ``def`` one in a worker thread (it may use the ORM). ``coalesce``
    (:class:`~realtime_app.inbound.workers.Coalesce`) lets compatible waiting calls merge into one
    execution. ``max_in_flight`` and ``rate`` (calls a second, in bursts of ``burst``,
    default the rate rounded up) limit this method for each identity on its own: past them
    a call is refused -32004 ``too_many_in_flight`` / -32005 ``rate_limited``.
    ``idempotent``: a call whose by-name params hold an ``"idempotency_key"`` runs once
    for its caller's identity; a repeat within ``IDEMPOTENCY_TTL_S``, on any connection or
    process, gets the first answer, or waits for it (docs/transactions.md). Raise
    :class:`~realtime_app.exceptions.RPCError` to answer an error; any other exception
    answers -32603 and is logged.
    """
    if callable(name):  # a bare @rpc_method
        fn = getattr(name, "__name__", "handler")
        raise TypeError(
            f"rpc_method needs the method's name: write @realtime_app.rpc_method({fn!r}) "
            f"(or a dotted name such as 'inventory.{fn}') above def {fn}(consumer, params)."
        )
    if not isinstance(name, str) or not name:
        raise TypeError(f"rpc_method's name must be a non-empty string such as 'inventory.consume', got {name!r}")
    if name in BUILTIN_COSTS or name.startswith("rpc."):
        raise ValueError(f"method name {name!r} is reserved")
    if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not 0 <= cost < float("inf"):
        raise ValueError(f"method {name!r}: cost must be a number >= 0, got {cost!r}")
    if coalesce is not None and not isinstance(coalesce, Coalesce):
        raise ValueError(f"method {name!r}: coalesce must be a realtime_app.Coalesce")
    for option, value in (("max_in_flight", max_in_flight), ("burst", burst)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"method {name!r}: {option} must be an int >= 0, got {value!r}")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < float("inf"):
        raise ValueError(f"method {name!r}: rate must be calls a second >= 0, got {rate!r}")
    if idempotent and coalesce is not None:
        raise ValueError(f"method {name!r}: a coalescing method cannot be idempotent (merged calls share one run)")

    def register(handler: Handler) -> Handler:
        existing = _methods.get(name)
        if existing is not None and _where(existing.handler) != _where(handler):
            raise ImproperlyConfigured(
                f"JSON-RPC method {name!r} is registered twice: by {_where(existing.handler)} and by "
                f"{_where(handler)}. Give one of them another name."
            )
        is_async = inspect.iscoroutinefunction(handler)
        _methods[name] = Method(
            handler, float(cost), snapshot, coalesce, is_async, max_in_flight, float(rate), burst, bool(idempotent)
        )
        return handler

    return register


def _where(handler: Any) -> str:
    """``module.qualname`` of a handler: the same function imported again (a module
    reloaded, a test re-importing it) registers again without complaint."""
    return f"{getattr(handler, '__module__', '?')}.{getattr(handler, '__qualname__', repr(handler))}"


def encodable(method: str, result: Any) -> bool:
    """Whether a method's result can be written with the ``JSON_ENCODER``: when it cannot,
    the caller answers -32603 ``result_not_serializable`` at once (never silence), and the
    method's first such result is logged as an error (its later ones at debug level)."""
    try:
        protocol.encode(result)
    except (TypeError, ValueError) as exc:
        level = logging.ERROR if runtime().first_time(method, family="unencodable result") else logging.DEBUG
        logger.log(
            level,
            "method %s returned a result JSON cannot carry (%s); answered -32603 result_not_serializable. "
            "Return JSON types, or name an encoder that knows it in REALTIME_APP['JSON_ENCODER'].",
            safe(method),
            exc,
        )
        return False
    return True
