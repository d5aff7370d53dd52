"""Staff closing one connection from the admin's Realtime cluster screen, the way an
operator disconnects a client from a broker's management UI.

The request reaches any process; a control message takes it to every process of the
cluster, and the one holding the connection closes it with 4010 (``CLOSED_BY_OPERATOR``:
the clients do not reconnect) and logs who did it.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from realtime_app.hub.core import Hub
from realtime_app.observability.logsafe import safe
from realtime_app.wire.protocol import CloseCode

__all__ = ["close_connection", "on_close_message"]

logger = logging.getLogger("realtime_app.consumers")

REASON = "closed by an operator"


async def close_connection(instance: str, connection: int, by: str) -> None:
    """Ask the cluster to close connection ``connection`` of process ``instance`` (staff
    user ``by`` asked); raises ``BackplaneUnavailable`` when the cluster cannot be told.
    Through the hub of this process when it serves WebSockets, else straight through
    the backplane (a WSGI process): never a hub started for one request."""
    from realtime_app.hub.publishing import acontrol

    await acontrol({"kind": "close_connection", "instance": instance, "connection": connection, "by": by})


def on_close_message(hub: Hub, message: dict[str, Any]) -> None:
    """A ``close_connection`` control message: close that connection if it is this process's."""
    if message.get("instance") != hub.instance_id:
        return
    wanted = message.get("connection")
    conn = next((c for c in hub.connections if c.id == wanted), None)
    by = safe(str(message.get("by")), 150)
    if conn is None or conn.closed:
        logger.info("connection %s: asked to close by staff user %s, but it is gone already", safe(str(wanted)), by)
        return
    logger.warning("connection %s closed with %s by staff user %s", conn.id, int(CloseCode.CLOSED_BY_OPERATOR), by)
    with contextlib.suppress(Exception):
        conn.guard.close(CloseCode.CLOSED_BY_OPERATOR, REASON)
    hub.forget(conn)
