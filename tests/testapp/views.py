"""Instrumented views of the HTTP limiter tests: how many are inside at once, in what order."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse

from realtime_app.middleware import concurrency_limit

_lock = threading.Lock()
inside: dict[str, Any] = {"now": 0, "max": 0, "order": []}


class _Inside:
    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __enter__(self) -> None:
        with _lock:
            inside["now"] += 1
            inside["max"] = max(inside["max"], inside["now"])
            inside["order"].append(self.tag)

    def __exit__(self, *exc: object) -> None:
        with _lock:
            inside["now"] -= 1


def _ms(request: HttpRequest) -> float:
    return float(request.GET.get("ms", "200")) / 1000


@concurrency_limit("test")
async def limited(request: HttpRequest) -> HttpResponse:
    """Stay inside ``ms`` milliseconds (async view)."""
    with _Inside(request.GET.get("tag", "")):
        await asyncio.sleep(_ms(request))
    return JsonResponse({"ok": True, "tag": request.GET.get("tag", "")})


@concurrency_limit("test")
def limited_sync(request: HttpRequest) -> HttpResponse:
    """The same, as a sync view (a WSGI server's threads)."""
    with _Inside(request.GET.get("tag", "")):
        time.sleep(_ms(request))
    return JsonResponse({"ok": True, "tag": request.GET.get("tag", "")})


@concurrency_limit("test")
async def limited_raises(request: HttpRequest) -> HttpResponse:
    with _Inside("raise"):
        await asyncio.sleep(0.05)
    raise RuntimeError("deliberate")


@concurrency_limit("test")
async def limited_stream(request: HttpRequest) -> StreamingHttpResponse:
    """Chunks every 50 ms for ``ms``: the slot is held until the last one (or a disconnect)."""

    async def chunks() -> AsyncIterator[bytes]:
        deadline = time.monotonic() + _ms(request)
        while time.monotonic() < deadline:
            yield b"x" * 1024 + b"\n"
            await asyncio.sleep(0.05)

    return StreamingHttpResponse(chunks(), content_type="text/plain")


def stats(request: HttpRequest) -> HttpResponse:
    """What the limited views saw; ``?reset=1`` starts over."""
    with _lock:
        if request.GET.get("reset"):
            inside.update(now=0, max=0, order=[])
        return JsonResponse(dict(inside))
