"""The per-process hub: a small facade over rooms that each own one job.

:mod:`.core` (the :class:`Hub` facade and its lifecycle), :mod:`.hubs` (one per event
loop, kept by the process's runtime), :mod:`.connections`, :mod:`.convergence` (carrying
out the :mod:`.reconciler`'s actions, the beat), :mod:`.tickers`, :mod:`.ordering`,
:mod:`.replay`, :mod:`.fanout`, :mod:`.gate` (admission), :mod:`.publishing` and
:mod:`.probe`. The rules they follow are pure functions or state machines that take
``now`` (:mod:`.reconciler`, :mod:`.beat`, :mod:`.ordering`, :mod:`.tickers`,
:mod:`.replay`, :mod:`.fed`), tested without Redis or an event loop.
"""

from __future__ import annotations

from realtime_app.hub.core import (
    CONTROL_CHANNEL,
    HUB_PARTS,
    Connection,
    Hub,
    HubParts,
)
from realtime_app.hub.hubs import get_hub, hub_of_current_loop, running_hub

__all__ = [
    "CONTROL_CHANNEL",
    "HUB_PARTS",
    "Connection",
    "Hub",
    "HubParts",
    "get_hub",
    "hub_of_current_loop",
    "running_hub",
]
