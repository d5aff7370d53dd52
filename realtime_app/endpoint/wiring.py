"""What every hub runs beside its own rooms, in one place: the background loops and the
control messages of the parts above it (sessions, the operator's close). The hub finds
this module by name when it starts (:data:`realtime_app.hub.core.HUB_PARTS`): a hub
started in a test, without Django's ``ready()``, runs exactly what a served one does, and
importing a module never registers anything."""

from __future__ import annotations

from realtime_app.endpoint.drain import install_drain
from realtime_app.endpoint.operator import on_close_message
from realtime_app.endpoint.sessions import on_logout_message, revalidation_loop
from realtime_app.endpoint.sse import heartbeat_loop
from realtime_app.endpoint.sweeps import install_sweeps
from realtime_app.hub.core import HubParts
from realtime_app.hub.fanout import drain_held
from realtime_app.hub.heap import freeze_startup_objects
from realtime_app.hub.outbox import drain_outbox

__all__ = ["parts"]


def parts() -> HubParts:
    """The loops (by task name) and control handlers (by message ``kind``) of every hub."""
    return HubParts(
        loops={
            "realtime-drain-held": drain_held,
            "realtime-revalidate": revalidation_loop,
            "realtime-outbox": drain_outbox,
            "realtime-drain": install_drain,
            "realtime-sweeps": install_sweeps,
            "realtime-sse-heartbeat": heartbeat_loop,
            "realtime-freeze-startup": freeze_startup_objects,
        },
        handlers={"logout": on_logout_message, "close_connection": on_close_message},
    )
