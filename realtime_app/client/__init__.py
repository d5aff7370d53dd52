"""The Python client (asyncio, on ``websockets``) and the rules it shares with the
browser module: the adaptive cadence (:mod:`.adaptive`), the event cursor
(:mod:`realtime_app.wire.cursor`) and the scenario replay (:mod:`.scenarios`). Imports without Django."""

from __future__ import annotations

from realtime_app.client.adaptive_channel import AdaptiveChannel, bind_adaptive_channel
from realtime_app.client.cli import main
from realtime_app.client.connection import RESUME_TIMEOUT, RealtimeClient, is_reconnectable_close_code

__all__ = [
    "RESUME_TIMEOUT",
    "AdaptiveChannel",
    "RealtimeClient",
    "bind_adaptive_channel",
    "is_reconnectable_close_code",
    "main",
]
