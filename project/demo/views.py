import asyncio
import json
import mmap

from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render

from project.demo.auction import lot_state


def dashboard(request: HttpRequest) -> HttpResponse:
    """The demo dashboard: live channel values over the realtime WebSocket."""
    return render(request, "demo/dashboard.html")


def room(request: HttpRequest, name: str) -> HttpResponse:
    """A chat room on its own channel, ``demo:room:<name>``."""
    other = "garden" if name == "lobby" else "lobby"
    return render(request, "demo/room.html", {"name": name, "name_json": json.dumps(name), "other": other})


def lot(request: HttpRequest, lot_id: int) -> HttpResponse:
    """An auction lot on its own app-fed channel, ``demo:lot:<id>:<ms>``."""
    state = lot_state(lot_id)
    if state is None:
        raise Http404("no such lot")
    return render(request, "demo/lot.html", {"lot": state, "other": lot_id % 1000 + 1})


def sse(request: HttpRequest) -> HttpResponse:
    """The browser module over Server-Sent Events and HTTP RPC only (docs/sse.md)."""
    return render(request, "demo/sse.html")


def htmx(request: HttpRequest) -> HttpResponse:
    """htmx's ``sse`` extension on ``/realtime/sse``: live values, no script of the page's own."""
    return render(request, "demo/htmx.html")


#: What one heavy request allocates and how long it holds it (SPEC §10).
HEAVY_BYTES = 20 * 1024 * 1024
HEAVY_HOLD_S = 0.2


async def heavy(request: HttpRequest) -> HttpResponse:
    """Allocate and touch 20 MB, hold it 200 ms: a report, an export, an image.

    Served as ``/demo/heavy/`` inside the pool ``heavy`` (``max_concurrent`` 2) and as
    ``/demo/heavy-unlimited/`` outside any pool, for ``bench/http_burst.py``.
    """
    block = bytearray(HEAVY_BYTES)
    block[:: mmap.PAGESIZE] = b"\1" * len(range(0, HEAVY_BYTES, mmap.PAGESIZE))  # every page resident
    await asyncio.sleep(HEAVY_HOLD_S)
    del block
    return JsonResponse({"ok": True})
