"""What the hub needs of a connection's transport, whatever the server: the bytes still
queued, writes that never wait, closes with any code (:class:`Transport`); and the
WebSocket frame of a text message, built once per publication (:func:`text_frame`)."""

from __future__ import annotations

import fcntl
import struct
import termios
from typing import Any

from realtime_app.exceptions import RealtimeError
from realtime_app.wire.asgi import Send

__all__ = ["Transport", "UnsupportedServer", "kernel_queue", "server_send", "text_frame"]

_SIOCOUTQ = getattr(termios, "TIOCOUTQ", None)  # same ioctl as SIOCOUTQ on Linux
_ZERO = b"\0\0\0\0"


class UnsupportedServer(RealtimeError):
    """The ASGI server of a connection is not one whose transport we know how to read."""

    def __init__(self, send: Any) -> None:
        super().__init__(send)
        self.send = send

    def __str__(self) -> str:
        return (
            f"cannot read the transport behind {self.send!r}: transport backpressure supports daphne and uvicorn "
            "(--ws websockets-sansio); set REALTIME_APP['MAX_BACKPRESSURE'] = 0 to run without the guard"
        )


def server_send(send: Send) -> Send:
    """The server's own ``send`` under Channels' middleware wrappers.

    ``SessionMiddleware`` (in ``AuthMiddlewareStack``) hands the application a bound
    ``send`` of a wrapper holding the server's as ``real_send``; unwrap every such layer.
    """
    for _ in range(10):
        inner = getattr(getattr(send, "__self__", None), "real_send", None)
        if inner is None:
            break
        send = inner
    return send


def kernel_queue(fileno: int) -> int:
    """Bytes in the kernel's send queue of a socket (0 where the OS does not tell)."""
    if _SIOCOUTQ is None or fileno < 0:
        return 0
    try:
        return int(_unpack(fcntl.ioctl(fileno, _SIOCOUTQ, _ZERO))[0])
    except OSError:
        return 0


_unpack = struct.Struct("i").unpack
_LEN16 = struct.Struct("!BBH").pack
_LEN64 = struct.Struct("!BBQ").pack


def text_frame(payload: bytes) -> bytes:
    """One WebSocket text message, final, unmasked (RFC 6455 §5.2: a server never masks):
    the same bytes for every subscriber, so the hub builds it once per publication."""
    n = len(payload)
    if n < 126:
        return bytes((0x81, n)) + payload
    if n < 65536:
        return _LEN16(0x81, 126, n) + payload
    return _LEN64(0x81, 127, n) + payload


class Transport:
    """What the hub needs of one connection's transport. Writes are synchronous."""

    kind = "asgi"
    #: True when :meth:`buffered` reads real bytes (the guard can act on it).
    measurable = False

    def buffered(self) -> int:
        """Bytes accepted for this connection and not yet sent on the network."""
        return 0

    def queued(self, under: int) -> int:
        """What the guard reads before each frame: :meth:`buffered`, or 0 where the
        transport knows without reading that at most ``under`` bytes are queued."""
        return self.buffered()

    def write(self, payload: bytes, frame: bytes | None = None) -> bool:
        """Queue one text message (UTF-8 ``payload``; ``frame``, when given, is
        :func:`text_frame` of it, for servers whose socket can take it as is); False if
        the connection is closing."""
        raise NotImplementedError

    def dropped(self, payload: bytes) -> None:
        """The guard dropped ``payload`` (a transport that must say a gap does it here)."""

    def close(self, code: int, reason: str, drain_s: float) -> None:
        """Send a close frame with any valid ``code``; give the client ``drain_s`` seconds
        to read what is queued before the connection is dropped."""
        raise NotImplementedError

    def pause_reading(self, seconds: float) -> None:
        """Read nothing more from this client for ``seconds`` (TCP pushes back on it);
        no-op where the server offers no way. Writing goes on."""
