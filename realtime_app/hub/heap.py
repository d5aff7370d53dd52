"""The process's heap as the hub starts: what exists then (code, settings, URL
configuration, the ORM's caches) lives as long as the process, yet each full collection
of the garbage collector would walk it again. With ``FREEZE_STARTUP_OBJECTS`` the hub
collects once and freezes it (:func:`gc.freeze`): later full collections walk only what
connections and requests made since. docs/performance.md measures what it saves.

The hub starts with its first connection or publication, so what that one holds at the
moment is frozen too: a cycle among it is then never collected (once per process, a few
KiB)."""

from __future__ import annotations

import gc
import logging
from typing import Any

from realtime_app.conf.runtime import settings

__all__ = ["freeze_startup_objects"]

logger = logging.getLogger("realtime_app.hub")


async def freeze_startup_objects(hub: Any) -> None:
    """The hub's part (:mod:`realtime_app.endpoint.wiring`): once per process — not when
    something froze the heap already (the host, or another hub of this process)."""
    if not settings().freeze_startup_objects or gc.get_freeze_count():
        return
    gc.collect()
    gc.freeze()
    logger.debug("froze %d objects of the process's startup", gc.get_freeze_count())
