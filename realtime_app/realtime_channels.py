"""realtime_app's own channels: the health channel ``realtime:socket[:<ms>]`` (staff only
by the built-in policy), whose frames are the cluster probe."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from realtime_app.declarations.declare import family
from realtime_app.declarations.registry import ChannelSpec, Publish

logger = logging.getLogger("realtime_app.probes")

HEALTH_CHANNEL = "realtime:socket"


@family(HEALTH_CHANNEL, default=2000, min=500, max=60000)
def health_channel(channel: ChannelSpec, publish: Publish) -> Any:
    """Publish the whole cluster's probe at the channel's cadence."""
    from realtime_app.observability.probes import cluster_probe

    async def run() -> None:
        assert channel.interval_ms is not None
        failing = False
        while True:
            try:
                publish(await cluster_probe())
                failing = False
            except Exception:
                if not failing:
                    logger.exception("reading the cluster probe failed")
                failing = True
            await asyncio.sleep(channel.interval_ms / 1000)

    task = asyncio.get_running_loop().create_task(run())
    return task.cancel
