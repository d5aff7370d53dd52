import asyncio
import mmap

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render


def dashboard(request: HttpRequest) -> HttpResponse:
    """The demo dashboard: live channel values over the realtime WebSocket."""
    return render(request, "demo/dashboard.html")


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
