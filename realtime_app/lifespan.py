"""ASGI lifespan for servers that have it (uvicorn): flush the write-behind stores at shutdown.

``ProtocolTypeRouter({"http": ..., "websocket": ..., "lifespan": lifespan_app})``; daphne
has no lifespan and is covered by a shutdown hook instead (docs/write-behind.md).
"""

from __future__ import annotations

import logging

from realtime_app.persistence.write_behind import flush_all, start_all
from realtime_app.wire.asgi import Receive, Scope, Send

__all__ = ["lifespan_app"]

logger = logging.getLogger("realtime_app.lifespan")


async def lifespan_app(scope: Scope, receive: Receive, send: Send) -> None:
    """At startup, start the stores (taking over journals); at shutdown, flush every store
    (journaling what cannot be written) before answering."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            start_all()  # journals of ended processes are written first
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            try:
                written = await flush_all()
                logger.info("shutdown: %d object(s) flushed", written)
            finally:
                await send({"type": "lifespan.shutdown.complete"})
            return
