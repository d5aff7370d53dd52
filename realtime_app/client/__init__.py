"""The Python client (asyncio, on ``websockets``) and the rules it shares with the
browser module: the adaptive cadence (:mod:`.adaptive`), the event cursor
(:mod:`.cursor`) and the scenario replay (:mod:`.scenarios`). Imports without Django."""

from __future__ import annotations

from realtime_app.client.connection import (
    RESUME_TIMEOUT,
    RealtimeClient,
    bind_adaptive_channel,
    is_reconnectable_close_code,
    main,
)

__all__ = ["RESUME_TIMEOUT", "RealtimeClient", "bind_adaptive_channel", "is_reconnectable_close_code", "main"]
