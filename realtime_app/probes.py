"""The cluster view: every live process's probe, read without deciding anything."""

from __future__ import annotations

import time
from typing import Any

from .backplane import make_backplane
from .hub import hub_of_current_loop, running_hub

__all__ = ["cluster_probe"]


async def cluster_probe() -> dict[str, Any]:
    """``{"instances": [...], "generated_at": ms}`` for the whole cluster.

    From a serving process the local probe is fresh; elsewhere (a command) it is read
    from the backplane, where each process republishes its probe with a TTL.
    """
    hub = hub_of_current_loop() or running_hub()
    if hub is not None and hub.loop is not None and hub_of_current_loop() is hub:
        instances = await hub.cluster_probes()
    else:
        backplane = make_backplane(None)
        try:
            instances = await backplane.cluster_probes()
        finally:
            await backplane.stop()
    instances.sort(key=lambda p: p.get("instance", ""))
    return {"generated_at": int(time.time() * 1000), "instances": instances}
