"""The two stages meet, end to end, with nothing wiring them together in code.

A real daphne with transport backpressure at a small threshold; a real Python client
following ``demo:flood`` (32 KiB frames) adaptively, its reading throttled (a slow
handler and a small socket receive buffer). First the client reads a little slower than
the server sends, its gaps under the starvation factor: the server drops (memory stays
bounded) and the client keeps its cadence. Then it reads slower still: the gaps it measures lengthen
past the starvation factor, it slows down, the server's queue for it drains below the
threshold, drops stop growing, and no 1013 comes. Then the throttle lifts and the cadence
climbs back.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from realtime_app.client import RealtimeClient, bind_adaptive_channel
from tests.support.health import Probe
from tests.support.servers import Server, prepare_database
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(120)

THRESHOLD = 64 * 1024


async def _drops_over(probe, n):
    return (await probe.aread())["drops"] > n


async def test_backpressure_and_adaptive_cadence_meet(tmp_path):
    database = prepare_database(str(tmp_path / "db.sqlite3"))
    server = Server(
        {**database, "REDIS_URL": "", "REALTIME_DEMO_FLOOD": "1", "REALTIME_MAX_BACKPRESSURE": str(THRESHOLD)}
    ).start()
    try:
        probe = Probe(server)
        sock = socket.socket()
        # a modest receive buffer, not the megabytes Linux would autotune to on loopback
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock.connect(("127.0.0.1", server.port))
        # 130 ms per frame from the start: gaps under the starvation factor (1.8 x 100 ms),
        # so the client keeps its cadence; it takes less than the server sends
        throttle = {"seconds": 0.13}

        async def absorb(params):
            if throttle["seconds"]:
                await asyncio.sleep(throttle["seconds"])  # the client reads nothing meanwhile

        # max_queue: websockets would otherwise read ahead 16 frames (512 KiB) into its own queue
        async with RealtimeClient(server.ws, sock=sock, max_queue=2) as client:
            bound = await bind_adaptive_channel(client, "demo:flood", 100, absorb, ladder=[100, 400], recovery_window=8)
            # the hidden buffers (socket, library) fill, then the server drops: memory stays bounded
            await eventually(lambda: _drops_over(probe, 5), 20)
            totals = await probe.aread()
            assert bound.interval_ms == 100 and totals["closes"] == 0
            assert totals["max_buffered_amount"] <= THRESHOLD + 33 * 1024

            throttle["seconds"] = 0.25  # slower still: the gaps the client measures starve it
            await eventually(lambda: asyncio.sleep(0, bound.interval_ms == 400), 15)
            slowed_at = time.monotonic()

            # the queue drains below the threshold and drops stop growing (probing aside)
            async def quiet():
                first = await probe.aread()
                await asyncio.sleep(1.5)
                second = await probe.aread()
                return second["drops"] == first["drops"] and second["max_buffered_amount"] < THRESHOLD

            await eventually(quiet, 15)
            assert (await probe.aread())["closes"] == 0
            assert [d for _, d, _ in bound.changes].count("slower") >= 1

            throttle["seconds"] = 0.0
            await eventually(lambda: asyncio.sleep(0, bound.interval_ms == 100 and time.monotonic() > slowed_at), 20)
            # Two seconds on, it is (back) at 100 ms and was never closed: a scheduling hiccup
            # of the shared machine may step it slower once, and it recovers from that too.
            await asyncio.sleep(2)
            await eventually(lambda: asyncio.sleep(0, bound.interval_ms == 100), 20)
            totals = await probe.aread()
            assert totals["closes"] == 0 and totals["connections"] >= 1
            await bound.close()
    finally:
        server.stop()
