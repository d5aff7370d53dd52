"""``ConcurrencyLimitMiddleware``: a burst of heavy HTTP requests queues instead of
allocating all at once (docs/http-limiter.md).

Requests are covered by a named pool of ``REALTIME_APP["HTTP_POOLS"]`` — by path glob, or
by decorating the view with :func:`concurrency_limit` — and the rest pass untouched. The
health and metrics endpoints are never limited. Sync- and async-capable: no thread hop
under ASGI, a blocking wait per thread under WSGI.
"""

from __future__ import annotations

import fnmatch
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import Resolver404, resolve

from realtime_app.conf.runtime import settings
from realtime_app.inbound.limiter import Busy, ConcurrencyPool, Slot
from realtime_app.inbound.pools import decorated_pools, http_pools, pools_probe

__all__ = ["ConcurrencyLimitMiddleware", "concurrency_limit", "http_pools", "pools_probe"]

logger = logging.getLogger("realtime_app.middleware")

V = TypeVar("V", bound=Callable[..., Any])

_NEVER_LIMITED = ("realtime_app:health", "realtime_app:metrics")


def concurrency_limit(pool: str) -> Callable[[V], V]:
    """Run the decorated view (function or ``as_view()``) in the pool ``pool`` of
    ``REALTIME_APP["HTTP_POOLS"]``; needs :class:`ConcurrencyLimitMiddleware`."""

    def mark(view: V) -> V:
        view.realtime_pool = pool  # type: ignore[attr-defined]
        decorated_pools.add(pool)
        return view

    return mark


def _pool_for(request: HttpRequest) -> ConcurrencyPool | None:
    config = settings().http_pools
    if not config:
        return None
    path = request.path_info
    name = next(
        (n for n, options in config.items() for glob in options.get("paths", ()) if fnmatch.fnmatchcase(path, glob)),
        None,
    )
    if name is None and not decorated_pools:
        return None
    try:
        match = resolve(path)
    except Resolver404:
        return None if name is None else http_pools()[name]
    if match.view_name in _NEVER_LIMITED:
        return None
    marked = getattr(match.func, "realtime_pool", None)
    name = marked or name
    return None if name is None else http_pools().get(name)


def _busy(exc: Busy) -> HttpResponse:
    response = JsonResponse(
        {"error": "busy", "pool": exc.pool, "reason": exc.reason, "retry_after_s": exc.retry_after_s}, status=503
    )
    response["Retry-After"] = str(exc.retry_after_s)
    return response


class ConcurrencyLimitMiddleware:
    """Put it in ``MIDDLEWARE`` after the session and authentication middleware."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self.__acall__(request)
        pool = _pool_for(request)
        if pool is None:
            return self.get_response(request)
        try:
            slot = pool.acquire(_client(request))
        except Busy as exc:
            return _busy(exc)
        started = time.monotonic()
        response: HttpResponse | None = None
        try:
            response = self.get_response(request)
        finally:
            _hand_over(pool, slot, response, started)
        return response

    async def __acall__(self, request: HttpRequest) -> Any:
        pool = _pool_for(request)
        if pool is None:
            return await self.get_response(request)
        try:
            slot = await pool.aacquire(_client(request))  # cancelled when the client disconnects while waiting
        except Busy as exc:
            return _busy(exc)
        started = time.monotonic()
        response: HttpResponse | None = None
        try:
            response = await self.get_response(request)
        finally:
            _hand_over(pool, slot, response, started)
        return response


def _client(request: HttpRequest) -> tuple[str, str]:
    """Whose request this is, for the pool's turns: the client's network (its address read
    through ``TRUSTED_PROXIES``). Never the session: a pool answers without the database."""
    from realtime_app.endpoint.addresses import client_address, client_network, trusted_networks

    config = settings()
    header = config.forwarded_header
    value = request.META.get("HTTP_" + header.upper().replace("-", "_"))
    scope = {
        "client": (request.META.get("REMOTE_ADDR") or "unknown", 0),
        "headers": [(header.lower().encode("latin-1"), str(value).encode("latin-1", "replace"))] if value else [],
    }
    address = client_address(scope, trusted_networks(tuple(config.trusted_proxies)), header)
    return ("address", client_network(address, config.address_prefix_v4, config.address_prefix_v6))


def _hand_over(pool: ConcurrencyPool, slot: Slot, response: HttpResponse | None, started: float) -> None:
    """Release now, or — for a streaming response — after its last chunk, its close, or
    the client's disconnect, whichever comes first."""

    def done() -> None:
        if not slot.released:
            pool.ran(time.monotonic() - started)
            slot.release()

    if response is None or not getattr(response, "streaming", False):
        done()
        return
    response._resource_closers.append(done)  # close(): the server is done with it
    # A response dropped before anyone iterates it (the client left while an outer
    # middleware ran; one replaced it) is never closed: its collection releases the slot.
    weakref.finalize(response, done)
    if response.is_async:
        response.streaming_content = _released_after_async(response.streaming_content, done)
    else:
        response.streaming_content = _released_after(response.streaming_content, done)


def _released_after(chunks: Iterator[Any], done: Callable[[], None]) -> Iterator[Any]:
    try:
        yield from chunks
    finally:
        done()


async def _released_after_async(chunks: AsyncIterator[Any], done: Callable[[], None]) -> AsyncIterator[Any]:
    try:
        async for chunk in chunks:
            yield chunk
    finally:  # the last chunk, or the client went away mid-stream (the generator is closed)
        done()
