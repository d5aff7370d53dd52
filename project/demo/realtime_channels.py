"""Channels of the demo site (README, docs/channels-and-cadence.md), registered when realtime_app starts."""

from __future__ import annotations

import base64
import itertools
import os
import time
from typing import Any

import realtime_app
from realtime_app.declarations.registry import ChannelSpec

from . import auction, inventory  # noqa: F401  (their channels and RPC methods register on import)

FLOOD_PAYLOAD_BYTES = 32 * 1024


@realtime_app.ticker("demo:clock", default=1000, min=100, max=60000)
def clock(channel: ChannelSpec) -> dict[str, int]:
    """A counter per cadence channel (per process running its ticker)."""
    _clock_counters[channel.name] = n = _clock_counters.get(channel.name, 0) + 1
    return {"n": n}


_clock_counters: dict[str, int] = {}


@realtime_app.family("atelier:load", default=1000, min=250, max=60000)
def atelier_load(channel: ChannelSpec, publish: Any) -> Any:
    """CPU time of the serving process per wall second, 0..1, measured over each cadence."""
    import asyncio

    async def run() -> None:
        wall, cpu = time.monotonic(), time.process_time()
        while True:
            await asyncio.sleep(channel.interval_ms / 1000)  # type: ignore[operator]
            now_wall, now_cpu = time.monotonic(), time.process_time()
            load = (now_cpu - cpu) / max(now_wall - wall, 1e-6)
            wall, cpu = now_wall, now_cpu
            publish({"load": round(min(1.0, max(0.0, load)), 3)})

    task = asyncio.get_running_loop().create_task(run())
    return task.cancel


realtime_app.event_channel("demo:events", history_size=1000, history_ttl_s=300, max_bytes=4096)

if os.environ.get("REALTIME_DEMO_FLOOD") == "1":
    _flood_counter = itertools.count(1)

    @realtime_app.ticker("demo:flood", default=1000, min=10, max=60000)
    def flood(channel: ChannelSpec) -> dict[str, Any]:
        """32 KiB of fresh random text per frame: per-message compression cannot shrink it."""
        blob = base64.b64encode(os.urandom(FLOOD_PAYLOAD_BYTES * 3 // 4)).decode("ascii")
        return {"n": next(_flood_counter), "blob": blob}
