"""The server's own transport of a connection: bytes still queued, direct writes, real closes.

ASGI hides all three. Under daphne ``await send()`` never blocks, so a client that stops
reading makes Twisted's write buffer (and the process) grow without bound; under uvicorn
``await send()`` blocks on flow control, so one dead client stalls whoever awaits it; and
daphne's autobahn refuses to send 1003/1008/1009/1013 through the ASGI close. This module
picks, per connection, the adapter that reaches past ASGI to the server's own transport
(the only code that touches a connection below ASGI; the shutdown flush only uses
Twisted's public ``addSystemEventTrigger``, in :mod:`realtime_app.persistence.lifecycle`):

* **daphne** (4.2, autobahn 26, Twisted 26, over TCP or TLS): :mod:`.daphne`;
* **uvicorn** (0.54, ``websockets-sansio``, the default ``--ws``): :mod:`.uvicorn`;
* the Channels test communicator (an in-memory queue), below.

Where the OS offers it (Linux ``SIOCOUTQ``), the kernel's socket send queue (bytes not yet
acknowledged by the peer) is added, so that what the guard bounds is everything between
the application and the client: the server writes only while the total is under the
threshold, hence neither part can grow past threshold plus one frame.

Every private name used is pinned by the versions above (``pyproject.toml`` bounds them,
check ``W020`` names any other installed version); ``tests/test_transport_backpressure.py``
runs real servers and breaks if they move. An unknown server raises
:class:`UnsupportedServer` instead of guessing.
"""

from __future__ import annotations

import asyncio
from typing import Any

from realtime_app.outbound.base import Transport, UnsupportedServer, server_send, text_frame
from realtime_app.outbound.daphne import DaphneTransport, daphne_protocol
from realtime_app.outbound.uvicorn import UvicornTransport, uvicorn_protocol
from realtime_app.wire.asgi import Send

__all__ = ["Transport", "UnsupportedServer", "server_send", "text_frame", "transport_for"]


class QueueTransport(Transport):
    """Channels' ``WebsocketCommunicator``: messages go to an in-memory queue."""

    kind = "memory"

    def __init__(self, send: Send) -> None:
        self.put = send.__self__.put_nowait  # type: ignore[attr-defined]
        self.closed = False

    def write(self, payload: bytes, frame: bytes | None = None) -> bool:
        if self.closed:
            return False
        self.put({"type": "websocket.send", "text": payload.decode("utf-8")})
        return True

    def close(self, code: int, reason: str, drain_s: float) -> None:
        if not self.closed:
            self.closed = True
            self.put({"type": "websocket.close", "code": int(code), "reason": reason})


class AsgiTransport(Transport):
    """Any other server: plain ASGI messages, nothing measured (the guard cannot run)."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self._tasks: set[asyncio.Task[Any]] = set()

    def _spawn(self, message: dict[str, Any]) -> None:
        task = asyncio.ensure_future(self.send(message))  # Send returns an Awaitable, not always a coroutine
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def write(self, payload: bytes, frame: bytes | None = None) -> bool:
        self._spawn({"type": "websocket.send", "text": payload.decode("utf-8")})
        return True

    def close(self, code: int, reason: str, drain_s: float) -> None:
        self._spawn({"type": "websocket.close", "code": int(code), "reason": reason})


def transport_for(send: Send, *, require_measurable: bool = False) -> Transport:
    """The adapter of the server behind ``send``.

    Raises :class:`UnsupportedServer` when ``require_measurable`` (the guard is on) and
    the server's queued bytes cannot be read.
    """
    raw = server_send(send)
    protocol = daphne_protocol(raw)
    if protocol is not None:
        return DaphneTransport(protocol)
    owner = getattr(raw, "__self__", None)
    if isinstance(owner, asyncio.Queue):
        return QueueTransport(raw)
    if uvicorn_protocol(owner):
        return UvicornTransport(owner)
    if require_measurable:
        raise UnsupportedServer(raw)
    return AsgiTransport(send)
