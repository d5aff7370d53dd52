"""Drain on SIGTERM: a stopping process hands its connections over gently (docs/deployment.md).

On SIGTERM (under daphne or uvicorn) the process, before the server shuts down:

* **stops accepting**: new handshakes are closed with 1012 and ``/realtime/ready``
  answers 503, so a load balancer stops routing to it; its probe says ``draining``;
* **closes its connections with 1012, spread evenly over** ``DRAIN_SECONDS`` (the first
  80 % of it, so that the last ones are gone before a typical 30 s grace period ends),
  each close reason ``retry_after_ms=<n>``: the client waits that long before it
  reconnects (both clients do) — the surviving processes take the handshakes in a trickle,
  not an avalanche; event channels resume as after any reconnect. An anonymous connection
  is also told a reconnect ticket (``ticket=<t>``): shown on its next handshake, it is not
  refused by the survivors' anonymous handshake bucket (:mod:`realtime_app.endpoint.tickets`);
* **hands its tickers over first**: each lease it holds is released at once and the other
  processes are told, so one with subscribers runs the ticker within milliseconds, not a
  lease timeout later (this process competes again from its second beat: a channel nobody
  else serves pauses one to two beats, then ticks here again for the subscribers left);
* then lets the server stop (the write-behind stores flush as they always do).

``DRAIN_SECONDS`` = 0 switches it off (the server's own stop: every socket at once). Under
daphne and uvicorn alike: the handler wraps the server's own.
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import sys
import threading
import weakref
from typing import Any

from realtime_app.conf.runtime import runtime, settings
from realtime_app.endpoint.tickets import mint, ticket_network
from realtime_app.hub.core import Connection, Hub
from realtime_app.wire.protocol import CloseCode

__all__ = ["DRAIN_SHARE", "Drains", "close_reason", "drain", "draining", "install_drain", "schedule"]

logger = logging.getLogger("realtime_app.hub")

#: The part of ``DRAIN_SECONDS`` the closes are spread over (the rest: a margin to stop).
DRAIN_SHARE = 0.8


class Drains:
    """Whether this process's SIGTERM handler is in place, and which hubs were asked to
    drain (a part of the process's runtime)."""

    def __init__(self) -> None:
        self.installed = False
        self.requested: weakref.WeakSet[Hub] = weakref.WeakSet()


def schedule(connections: int, seconds: float, rng: random.Random | None = None) -> list[tuple[float, int]]:
    """When (seconds after the drain began) each of ``connections`` is closed, and the
    ``retry_after_ms`` it is told: evenly over ``DRAIN_SHARE`` of ``seconds``; each waits
    up to one spacing more before it comes back, so that reconnections spread too."""
    if not connections:
        return []
    rng = rng or random.Random()
    window = max(seconds, 0.0) * DRAIN_SHARE
    spacing = window / connections
    return [(i * spacing, int(rng.uniform(0, max(spacing, 0.05)) * 1000)) for i in range(connections)]


def draining(hub: Hub | None) -> bool:
    """True once ``hub``'s process has begun to drain."""
    return hub is not None and hub.gate.draining


def close_reason(conn: Connection, retry_ms: int) -> str:
    """A drained connection's close reason: when to come back and, for an anonymous
    WebSocket, a reconnect ticket (its handshake elsewhere is not refused as a crowd's:
    :mod:`realtime_app.endpoint.tickets`)."""
    network = ticket_network(conn.identity)
    if network is None or conn.scope.get("type") != "websocket":  # a user's, or an event stream's
        return f"retry_after_ms={retry_ms}"
    return f"retry_after_ms={retry_ms} ticket={mint(network)}"


async def drain(hub: Hub, seconds: float) -> int:
    """Stop accepting, then close every connection with 1012 and its ``retry_after_ms``,
    spread over ``seconds``; returns how many were closed."""
    hub.gate.draining = True
    for channel in hub.reconciler.yield_leases():  # the tickers go to the other processes now,
        hub.spawn(hub.convergence.converge(channel))  # beside the closes (a slow cleanup delays none)
    connections = [conn for conn in hub.connections if not conn.closed]
    logger.info("draining %d connection(s) over %.1f s", len(connections), seconds * DRAIN_SHARE)
    loop = asyncio.get_running_loop()
    start = loop.time()
    closed = 0
    plan = schedule(len(connections), seconds)
    for conn, (at, retry_ms) in zip(connections, plan, strict=True):  # pragma: no mutate (strict: same lengths)
        await asyncio.sleep(start + at - loop.time())  # late: no wait (a delay <= 0 is none)
        if conn.closed:
            continue
        conn.guard.close(int(CloseCode.SERVICE_RESTART), close_reason(conn, retry_ms))
        hub.forget(conn)
        closed += 1
    # the last close frames on their way before the server stops (within the margin left)
    await asyncio.sleep(min(1.0, seconds * (1 - DRAIN_SHARE)))  # pragma: no mutate (1 % 0.8 is 1 - 0.8)
    return closed


async def install_drain(hub: Hub) -> None:
    """The hub's part (:mod:`realtime_app.endpoint.wiring`): in the main thread, where a
    server handles SIGTERM (daphne's reactor, uvicorn's ``handle_exit``), a SIGTERM handler
    that drains first and then lets the server's own handler stop it (the server cancels
    or closes every connection as it stops: the drain must be over by then). A second
    SIGTERM stops at once. Elsewhere (tests, no server's handler, ``DRAIN_SECONDS`` = 0):
    nothing."""
    drains = runtime().part(Drains)
    seconds = float(settings().drain_seconds)
    if not seconds or drains.installed or threading.current_thread() is not threading.main_thread():
        return
    if not _server_handles(signal.getsignal(signal.SIGTERM)):
        return
    drains.installed = True
    previous = signal.getsignal(signal.SIGTERM)
    loop = asyncio.get_running_loop()

    def stop(signum: int) -> None:
        if callable(previous):
            previous(signum, None)

    async def drain_then_stop(signum: int) -> None:
        try:
            await drain(hub, seconds)
        except Exception:
            logger.exception("the drain failed: stopping now")
        finally:
            stop(signum)

    def on_sigterm(signum: int, frame: Any) -> None:
        if hub in drains.requested or not hub.started:  # a second SIGTERM, or nothing to drain
            stop(signum)
            return
        drains.requested.add(hub)
        loop.call_soon_threadsafe(lambda: hub.spawn(drain_then_stop(signum)))

    signal.signal(signal.SIGTERM, on_sigterm)


def _server_handles(handler: Any) -> bool:
    """True when SIGTERM's handler is a server's: daphne's (Twisted's reactor, running) or
    uvicorn's (``Server.handle_exit``)."""
    if not callable(handler):
        return False  # the default (the process ends) or ignored: no server to hand over to
    owner = getattr(handler, "__self__", None)
    if type(owner).__module__.startswith("uvicorn."):
        return True
    if "twisted.internet.reactor" in sys.modules:
        from twisted.internet import reactor

        return bool(getattr(reactor, "running", False))
    return False
