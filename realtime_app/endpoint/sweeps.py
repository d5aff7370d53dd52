"""Daphne's periodic sweeps, made to cost nothing per idle connection.

Daphne walks every connection it holds once a second (``Server.application_checker``: is
the application done, has a closed socket's application outlived its grace?) and every
2 s (``Server.timeout_checker``: each protocol's ``check_timeouts``, which sends the
WebSocket ping when one is due). At 10,000 idle connections those walks were half of the
process's idle CPU. Here the same checks run only where something can be due:

* the application check visits the connections whose socket closed or whose application
  finished (noted as it happens), not the others;
* the timeout check visits HTTP requests and WebSocket handshakes every second, and each
  open WebSocket when its next ping (or its ``--websocket_timeout``) is due, from a timing
  wheel of 1 s slots (a closed one leaves it at once): a ping goes out within 2 s of its
  due time, as with daphne's own sweep.

What each check does is daphne's own (its ``check_timeouts``, its reaping rules); only who
is visited changes. ``HEARTBEAT_SECONDS``, when set, is the ping interval.

This reaches into daphne's private ``Server`` (its ``connections`` and its two sweeps),
found through Twisted's public ``getDelayedCalls``: fenced here, behind one version check
(:data:`TESTED`). Another daphne keeps its own sweeps (the fallback: correct, just not
cheaper), said once in the log.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import threading
import time
from typing import Any

from realtime_app.conf.runtime import runtime, settings

__all__ = ["TESTED", "InstalledSweeps", "Sweeps", "install_sweeps", "installed", "supported"]

logger = logging.getLogger("realtime_app.hub")
daphne_logger = logging.getLogger("daphne.server")  # what daphne's own sweeps log, logged where it did

#: The daphne releases whose ``Server`` this module knows (major, minor).
TESTED = ((4, 1), (4, 2))
#: Seconds between the timeout sweep's visits: half daphne's period (2 s), so that a ping
#: is sent no later than daphne's would be; only handshakes and what is due are visited.
TICK = 1.0


class InstalledSweeps:
    """The sweeps of this process's daphne server, once installed (a part of the runtime)."""

    def __init__(self) -> None:
        self.sweeps: Sweeps | None = None


def supported(version: str) -> bool:
    """True for a daphne release this module knows."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) in TESTED


def installed() -> Sweeps | None:
    """The sweeps of this process's daphne server, once installed."""
    return runtime().part(InstalledSweeps).sweeps


class Sweeps:
    """Daphne's two sweeps over the connections that can be due, not all of them."""

    def __init__(self, server: Any, reactor: Any) -> None:
        self.server = server
        self.reactor = reactor
        #: Closed sockets and finished applications: what the application check visits.
        self.pending: set[Any] = set()
        #: HTTP requests and WebSocket handshakes: visited every tick, as daphne does.
        self.fresh: set[Any] = set()
        #: Open WebSockets by the tick when their next check is due, and each one's tick
        #: (a closed one leaves the wheel at once).
        self.wheel: dict[int, set[Any]] = {}
        self.slot_of: dict[Any, int] = {}
        self.apps: dict[Any, Any] = {}  # application future -> its protocol
        self.last_slot = int(time.time() // TICK)
        self._connected = server.protocol_connected
        self._disconnected = server.protocol_disconnected
        self._create = server.create_application
        for protocol, details in list(server.connections.items()):
            self.fresh.add(protocol)
            if "disconnected" in details:
                self.pending.add(protocol)
            self._watch_app(protocol, details.get("application_instance"))
        server.protocol_connected = self.protocol_connected
        server.protocol_disconnected = self.protocol_disconnected
        server.create_application = self.create_application
        # daphne's own sweeps call themselves again through these names: they become ours
        server.application_checker = self.application_checker
        server.timeout_checker = self.timeout_checker

    # -- what daphne tells us -------------------------------------------------------------

    def protocol_connected(self, protocol: Any) -> None:
        self._connected(protocol)
        self.fresh.add(protocol)

    def protocol_disconnected(self, protocol: Any) -> None:
        self._disconnected(protocol)
        self.pending.add(protocol)
        slot = self.slot_of.pop(protocol, None)
        if slot is not None:
            self.wheel.get(slot, set()).discard(protocol)

    def create_application(self, protocol: Any, scope: Any) -> Any:
        queue = self._create(protocol, scope)
        details = self.server.connections.get(protocol)
        if details is not None:
            self._watch_app(protocol, details.get("application_instance"))
        return queue

    def _watch_app(self, protocol: Any, app: Any) -> None:
        if app is not None and protocol is not None:
            self.apps[app] = protocol
            app.add_done_callback(self._app_done)

    def _app_done(self, app: Any) -> None:
        protocol = self.apps.pop(app, None)
        if protocol is not None:
            self.pending.add(protocol)

    # -- the sweeps ------------------------------------------------------------------------

    def application_checker(self) -> None:
        """Daphne's application check, over the connections that closed or finished."""
        server = self.server
        now = time.time()
        for protocol in list(self.pending):
            details = server.connections.get(protocol)
            if details is None:
                self.pending.discard(protocol)
                continue
            disconnected = details.get("disconnected")
            app = details.get("application_instance")
            if disconnected and now - disconnected > server.application_close_timeout and app and not app.done():
                daphne_logger.warning(
                    "Application instance %r for connection %s took too long to shut down and was killed.",
                    app,
                    repr(protocol),
                )
                app.cancel()
            if app and app.done():
                self._reap(protocol, app, disconnected)
                del details["application_instance"]
                app = None
            if not app and disconnected:
                del server.connections[protocol]
                self.pending.discard(protocol)
                self.fresh.discard(protocol)
            elif not disconnected:
                self.pending.discard(protocol)  # back when its socket closes
        self.reactor.callLater(1, self.application_checker)

    def _reap(self, protocol: Any, app: Any, disconnected: Any) -> None:
        try:
            exception = app.exception()
        except asyncio.CancelledError:
            return
        if exception is None:
            return
        if isinstance(exception, KeyboardInterrupt):
            self.server.stop()  # the application asks the server to exit
            return
        daphne_logger.error("Exception inside application: %s", exception, exc_info=exception)
        if not disconnected:
            protocol.handle_exception(exception)

    def timeout_checker(self) -> None:
        """Daphne's timeout check: handshakes and requests each tick, open WebSockets when due."""
        connections = self.server.connections
        slot = int(time.time() // TICK)
        first, self.last_slot = self.last_slot, slot + 1  # what is scheduled now lands after this tick
        for protocol in list(self.fresh):
            if protocol not in connections:
                self.fresh.discard(protocol)
                continue
            protocol.check_timeouts()
            if self._open(protocol):
                self.fresh.discard(protocol)
                self._schedule(protocol)
        for due in range(first, slot + 1):
            for protocol in self.wheel.pop(due, ()):
                self.slot_of.pop(protocol, None)
                if protocol not in connections:
                    continue
                if self._due(protocol) <= time.time():
                    protocol.check_timeouts()  # pings if one is due, closes a socket past its time
                self._schedule(protocol)
        self.reactor.callLater(TICK, self.timeout_checker)

    def _open(self, protocol: Any) -> bool:
        return getattr(protocol, "state", None) == getattr(protocol, "STATE_OPEN", object()) and hasattr(
            protocol, "last_ping"
        )

    def _due(self, protocol: Any) -> float:
        """When ``check_timeouts`` has something to do for an open WebSocket."""
        server = self.server
        due = protocol.last_ping + server.ping_interval
        if server.websocket_timeout >= 0:
            due = min(due, protocol.socket_opened + server.websocket_timeout)
        return float(due)

    def _schedule(self, protocol: Any) -> None:
        if not self._open(protocol):  # closing: the application check lets it go
            self.fresh.add(protocol)
            return
        slot = max(math.ceil(self._due(protocol) / TICK), self.last_slot)
        self.wheel.setdefault(slot, set()).add(protocol)
        self.slot_of[protocol] = slot

    def counts(self) -> dict[str, int]:
        """How many connections each sweep visits now, and how many daphne holds."""
        return {
            "connections": len(self.server.connections),
            "pending": len(self.pending),
            "fresh": len(self.fresh),
            "scheduled": len(self.slot_of),
        }


def _daphne_server(reactor: Any) -> Any:
    """The daphne ``Server`` behind this reactor: the owner of its scheduled sweeps."""
    from daphne.server import Server

    for call in reactor.getDelayedCalls():
        owner = getattr(call.func, "__self__", None)
        if isinstance(owner, Server):
            return owner
    return None


async def install_sweeps(hub: Any) -> None:
    """The hub's part (:mod:`realtime_app.endpoint.wiring`): under a daphne this module
    knows, replace its sweeps (:class:`Sweeps`) and apply ``HEARTBEAT_SECONDS``.
    Elsewhere (uvicorn, tests without a server): nothing."""
    kept = runtime().part(InstalledSweeps)
    if kept.sweeps is not None or "twisted.internet.reactor" not in sys.modules or "daphne.server" not in sys.modules:
        return
    if threading.current_thread() is not threading.main_thread():
        return  # daphne's reactor runs in the main thread: a hub elsewhere is not its
    import daphne
    from twisted.internet import reactor

    server = _daphne_server(reactor)
    if server is None:
        return
    heartbeat = settings().heartbeat_seconds
    if heartbeat:
        server.ping_interval = heartbeat
    if not supported(daphne.__version__) or not hasattr(server, "connections"):
        logger.info(
            "daphne %s: its own sweeps over every connection are kept (not a release known here)", daphne.__version__
        )
        return
    kept.sweeps = Sweeps(server, reactor)
